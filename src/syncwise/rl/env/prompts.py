"""Prompts as token ids: through the tokenizer's chat template where asked (``rl.chat_template``), cut to
``rl.max_prompt_length`` (``rl.prompt_overflow``), all of a job's prompts once at its start -- so a prompt that
cannot be used stops the job before any rank trains, naming its file and line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...config import RLConfig
from ...data.chat import RowError, refusal, row_tools


@dataclass
class EncodedPrompts:
    ids: list[list[int]]  # per kept row
    kept: list[int]  # indices of the source's rows that are kept (rl.prompt_overflow=drop leaves some out)
    truncated: int  # cut on the left to rl.max_prompt_length
    dropped: int  # longer than rl.max_prompt_length with rl.prompt_overflow=drop
    templated: bool  # some prompt went through the chat template
    tools: list[list[dict[str, Any]] | None] | None = None  # per kept row: the tool schemas its template shows


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt as messages: a conversation as it is, a string as one user message."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def uses_template(prompt: Any, cfg: RLConfig) -> bool:
    """Whether ``prompt`` goes through the chat template: message lists always (``false`` refuses them),
    strings with ``rl.chat_template=true`` or ``rl.tools`` (the template shows the tools)."""
    if isinstance(prompt, list):
        return True
    return cfg.chat_template == "true" or bool(cfg.tools)


def row_tool_schemas(row: dict[str, Any], tools: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The tool schemas the row's prompt shows: without ``rl.tools`` its ``tools`` column as given; with them,
    every tool of ``rl.tools``, or those the column names (function names, or schemas of functions that
    ``rl.tools`` defines -- a tool the job cannot run is a RowError)."""
    raw = row.get("tools")
    names_only = bool(tools) and isinstance(raw, list) and all(isinstance(t, str) for t in raw)
    given = raw if names_only else row_tools(row)
    if not tools:
        return given
    if given is None:
        return [tool.schema for tool in tools.values()]
    schemas = []
    for entry in given:
        name = entry if isinstance(entry, str) else (entry.get("function") or entry).get("name")
        if name not in tools:
            raise RowError(f"'tools' names {name!r}, which rl.tools does not define (rl.tools: "
                           f"{', '.join(tools)})")
        schemas.append(tools[name].schema)
    return schemas


def encode_prompt(prompt: Any, cfg: RLConfig, tokenizer, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """One prompt's token ids, before any length limit (``tools``: the row's, for the template's system
    prompt); a ValueError saying why it cannot be encoded -- a template's refusal (a system message it does not
    take, roles that must alternate) in one line."""
    if uses_template(prompt, cfg):
        if cfg.chat_template == "false":
            raise ValueError("is a list of messages, but rl.chat_template=false")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("needs the tokenizer's chat template, and the tokenizer has none")
        messages = prompt_messages(prompt)
        try:
            out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                add_generation_prompt=True)
        except Exception as exc:  # jinja2's TemplateError (raise_exception), a TypeError of a bad message, ...
            raise ValueError(f"was refused by the chat template: {refusal(exc)}") from exc
        ids = list(out["input_ids"])
    else:
        ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        raise ValueError("has no tokens")
    return ids


def encode_prompts(rows: list[dict[str, Any]], where: list[str] | None, name: str, cfg: RLConfig,
                   tokenizer, tools: dict[str, Any] | None = None) -> EncodedPrompts:
    """Every row's prompt encoded and fitted to ``rl.max_prompt_length``, with the tools it shows (``tools``:
    ``rl.tools`` loaded); errors name ``rl.dataset``, the file and the row."""
    ids, kept, truncated, dropped, shown = [], [], 0, 0, []
    limit = cfg.max_prompt_length
    for i, row in enumerate(rows):
        place = f"{name} {where[i]}" if where else f"{name} row {i + 1}"
        try:
            schemas = row_tool_schemas(row, tools)
        except RowError as exc:
            raise ValueError(f"rl.dataset: {place}: {exc}") from exc
        try:
            encoded = encode_prompt(row["prompt"], cfg, tokenizer, schemas)
        except ValueError as exc:
            raise ValueError(f"rl.dataset: {place}: the prompt {exc}") from exc
        if len(encoded) > limit:
            if cfg.prompt_overflow == "error":
                raise ValueError(f"rl.dataset: {place}: the prompt has {len(encoded)} tokens, more than "
                                 f"rl.max_prompt_length={limit} (rl.prompt_overflow=truncate_left or drop)")
            if cfg.prompt_overflow == "drop":
                dropped += 1
                continue
            encoded = encoded[-limit:]  # keep the end, where the question and the generation prompt are
            truncated += 1
        ids.append(encoded)
        kept.append(i)
        shown.append(schemas)
    if not kept:
        raise ValueError(f"rl.dataset: {name}: every prompt is longer than rl.max_prompt_length={limit}")
    templated = any(uses_template(row["prompt"], cfg) for row in rows)
    return EncodedPrompts(ids, kept, truncated, dropped, templated, shown)
