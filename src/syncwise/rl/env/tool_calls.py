"""Tool calls in an assistant turn's text, in the model family's own format (``rl.tool_parser``):

- ``hermes`` (Qwen2.5, Qwen3, Hermes, many fine-tunes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, free text before the first;
- ``llama3_json`` (Llama-3.1 / 3.2 / 3.3): the whole turn is a JSON object ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``; several separated by ``;``).

``auto`` picks the parser from the chat template (what it renders a call as), as vLLM's tool parsers are chosen
per model. A turn whose call does not parse is still a call -- the model meant one -- and its error becomes the
tool's answer (``bad_json``), so the model can see what went wrong.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: Any  # a dict when well formed (run_tool says otherwise)


@dataclass
class ParsedTurn:
    content: str  # the turn's text without its calls (the assistant message's content)
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # calls that did not parse: why, one per call

    @property
    def calls_tools(self) -> bool:
        return bool(self.calls or self.errors)


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else " ".join(str(t) for t in dict(template).values())


def check_parser_name(choice: str) -> None:
    """``rl.tool_parser`` names a parser of :data:`PARSERS`, or ``auto``: a ValueError in one line if not."""
    if choice != "auto" and choice not in PARSERS:
        raise ValueError(f"rl.tool_parser: {choice!r} is not one of auto, {', '.join(PARSERS)}")


def choose_parser(tokenizer, choice: str) -> str:
    """``rl.tool_parser``: ``auto`` reads the chat template; a ValueError in one line when it has no tool
    support, the format cannot be told, or a parser set by hand is not the template's format."""
    check_parser_name(choice)
    template = template_text(tokenizer)
    if not template:
        raise ValueError("rl.tools: the tokenizer has no chat template, and tools are shown to the model through "
                         "it; use a model whose template renders tools (Qwen2.5, Llama-3.1, Hermes)")
    if "tools" not in template:
        raise ValueError("rl.tools: the tokenizer's chat template does not render tools (it never reads 'tools'); "
                         "use a model whose template has tool support (Qwen2.5, Llama-3.1, Hermes), or set one "
                         "in the tokenizer's chat_template")
    found = next((name for name, parser in PARSERS.items() if parser.rendered_by(template)), None)
    if choice != "auto":
        if found is not None and found != choice:
            raise ValueError(f"rl.tool_parser={choice}: the chat template renders tool calls as {found} "
                             f"({PARSERS[found].looks}), and the model writes them as it was shown; set "
                             f"rl.tool_parser={found} or auto")
        return choice
    if found is None:
        raise ValueError("rl.tool_parser=auto: the chat template renders tools in a format syncwise does not "
                         f"know (neither <tool_call> nor Llama-3.1's JSON); set rl.tool_parser to one of "
                         f"{', '.join(PARSERS)}")
    return found


def parse_turn(text: str, parser: str) -> ParsedTurn:
    """The calls in one assistant turn's text (decoded with its special tokens but the end of the turn: a
    tokenizer may register ``<tool_call>`` as one)."""
    return PARSERS[parser].parse(text)


def _hermes(text: str) -> ParsedTurn:
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedTurn(text.strip())
    turn = ParsedTurn(text[:start].strip())
    for block in _HERMES_BLOCK.findall(text[start:]):
        _add_call(turn, block.strip(), "arguments")
    return turn


def _llama3_json(text: str) -> ParsedTurn:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip())
    turn = ParsedTurn("")
    for part in _split_objects(body):
        _add_call(turn, part, "parameters")
    return turn


def _split_objects(body: str) -> list[str]:
    """``{...}; {...}`` into its objects (a ``;`` inside a string or an object does not split)."""
    parts, depth, in_string, escaped, start = [], 0, False, False, 0
    for i, ch in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return [p for p in parts if p]


def _add_call(turn: ParsedTurn, block: str, arguments_key: str) -> None:
    try:
        call = json.loads(block)
    except json.JSONDecodeError as exc:
        turn.errors.append(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}): {block[:80]!r}")
        return
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        turn.errors.append(f'a tool call is a JSON object with a "name" and "{arguments_key}": {block[:80]!r}')
        return
    arguments = call.get(arguments_key, call.get("arguments", call.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    turn.calls.append(ToolCall(call["name"], arguments))


@dataclass(frozen=True)
class Parser:
    """One ``rl.tool_parser``: how its calls look, how to read them, how to tell a template that renders them."""

    looks: str
    parse: Callable[[str], ParsedTurn]
    rendered_by: Callable[[str], bool]


# rl.tool_parser's choices besides auto, in the order auto tries them on a template
PARSERS: dict[str, Parser] = {
    "hermes": Parser("<tool_call>{json}</tool_call>", _hermes, lambda template: "<tool_call>" in template),
    "llama3_json": Parser('a bare {"name": ..., "parameters": ...}', _llama3_json,
                          lambda template: "ipython" in template or '"parameters"' in template),
}
