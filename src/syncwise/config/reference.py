"""Every config key's doc from one source -- the comments beside and above its field in the config dataclasses --
and the resolved config as YAML with each key's doc and default (``syncwise config``)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
from typing import Any

import yaml

from .root import Config


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` -> its doc: the comment lines right above it and the comment on its line."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    docs = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in comments and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1)
                  if n in comments and not lines[n - 1].strip().startswith("#")]
        docs[node.target.id] = " ".join(above + beside).strip()
    return docs


def keys(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, str]]:
    """Every key of the config, dotted, with its default and doc (sections walked into)."""
    out = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += keys(type(default), f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", default, docs.get(f.name, "")))
    return out


def sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def describe(config: Config, job: str, only: tuple[str, ...] = ()) -> str:
    """``config`` as YAML: each key with its doc and default above it (``only``: these sections)."""
    from .loading import config_to_dict

    values = config_to_dict(config)
    out = [f"# syncwise {job}: the resolved config -- each key's doc and (default) above it"]
    opened: list[str] = []  # the sections whose header is printed, outermost first
    for key, default, doc in keys():
        *parents, leaf = key.split(".")
        if only and parents[0] not in only:
            continue
        same = 0
        while same < min(len(opened), len(parents)) and opened[same] == parents[same]:
            same += 1
        out += [f"{'  ' * depth}{parents[depth]}:" for depth in range(same, len(parents))]
        opened = parents
        node = values
        for part in parents:
            node = node[part]
        indent = "  " * len(parents)
        out += [f"{indent}# {line}" for line in textwrap.wrap(f"{doc} (default: {_inline(default)})", 110,
                                                             break_on_hyphens=False)]
        out.append(f"{indent}{leaf}: {_inline(node[leaf])}")
    return "\n".join(out)


def _inline(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
