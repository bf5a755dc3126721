"""SFT rows as token ids with a loss mask, in the dataset formats TRL users already have.

- ``text``: language modelling on every token (the tokenizer's end token appended);
- ``prompt`` + ``completion`` (strings): the two tokenised apart and joined, as generation sees them (the
  prompt with the tokenizer's special tokens, the completion with the end token); loss on the completion;
- ``messages`` (a list of ``{"role", "content", ...}``): the tokenizer's chat template; loss on the assistant
  turns only (tool calls included) -- from the template's generation markers (``{% generation %}``) where it
  has them, otherwise by rendering the prefix of each assistant turn (the conversation up to it with the
  generation prompt, and up to its end: the tokens between are the turn's, less the template's separator
  after its end-of-turn token, which the markers leave out too);
- conversational ``prompt`` + ``completion`` (message lists): the prompt rendered with the generation prompt,
  the whole conversation after it; loss on what follows the prompt (less the separator after its last end).

Messages reach the template as the row gives them -- every key (``tool_calls``, ``reasoning_content``, a tool
message's ``name``), as TRL's SFTTrainer passes them -- with the row's ``tools`` column (a list of JSON
schemas, or that list as a JSON string), which templates render into the system prompt.

A row that cannot be trained on raises :class:`RowError` saying why; the caller names the file and the row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FORMATS = {
    "text": "language modelling on every token",
    "prompt_completion": "prompt + completion, loss on the completion",
    "messages": "chat messages, loss on the assistant turns",
    "conversational_prompt_completion": "chat prompt + completion messages, loss on the completion",
}
TRUNCATION = ("right", "left", "drop")


class RowError(ValueError):
    """A row that cannot be trained on; the message says why."""


@dataclass
class TokenizedRow:
    input_ids: list[int]
    loss_mask: list[int]  # 1: the token is a training target
    truncated: bool = False
    dropped: bool = False  # longer than max_length with truncation=drop, or truncation cut every target


def detect_format(columns: list[str], first: dict[str, Any]) -> str:
    """The format a dataset's columns (and its first row) say it is in; a :class:`RowError` if none."""
    cols = set(columns)
    if "messages" in cols:
        return "messages"
    if {"prompt", "completion"} <= cols:
        return "conversational_prompt_completion" if isinstance(first.get("prompt"), list) else "prompt_completion"
    if "text" in cols:
        return "text"
    raise RowError(f"columns {sorted(cols)} match no SFT format: expected 'text', 'prompt' + 'completion', or "
                   "'messages'")


def assistant_mask_source(tokenizer) -> str:
    """How the assistant turns of ``messages`` are found: ``markers`` (the template's ``{% generation %}``)
    or ``prefix`` (rendering each turn's prefix). A tokenizer without a chat template is a RowError."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise RowError("the tokenizer has no chat template (chat_template), which 'messages' rows need; use a "
                       "tokenizer that has one, or 'prompt' + 'completion' strings")
    text = template if isinstance(template, str) else " ".join(str(t) for t in dict(template).values())
    return "markers" if "generation" in text and "endgeneration" in text else "prefix"


def tokenize_row(row: dict[str, Any], fmt: str, tokenizer, mask_source: str = "prefix") -> tuple[list, list]:
    """(input_ids, loss_mask) of one row in format ``fmt``; a :class:`RowError` if it is malformed, empty or
    has no trainable token."""
    if fmt == "text":
        text = _string(row, "text")
        ids = _ids(tokenizer, text, special=True) + _eos(tokenizer)
        mask = [1] * len(ids)
    elif fmt == "prompt_completion":
        prompt, completion = _string(row, "prompt"), _string(row, "completion")
        head, tail = _ids(tokenizer, prompt, special=True), _ids(tokenizer, completion, special=False) + _eos(tokenizer)
        ids, mask = head + tail, [0] * len(head) + [1] * len(tail)
    elif fmt == "messages":
        messages, tools = _messages(row, "messages"), row_tools(row)
        if not any(m["role"] == "assistant" for m in messages):
            raise RowError("'messages' has no assistant turn: nothing to train on")
        ids, mask = (_marked(tokenizer, messages, tools) if mask_source == "markers"
                     else _by_prefix(tokenizer, messages, tools))
    elif fmt == "conversational_prompt_completion":
        prompt, completion, tools = _messages(row, "prompt"), _messages(row, "completion"), row_tools(row)
        head = _render(tokenizer, prompt, tools, generation_prompt=True)
        ids = _render(tokenizer, prompt + completion, tools)
        _check_prefix(head, ids, "the prompt messages")
        mask = [0] * len(ids)
        for i in range(len(head), _end_of_turn(tokenizer, ids, len(head), len(ids))):
            mask[i] = 1
    else:
        raise ValueError(f"unknown SFT format {fmt!r}")
    if not any(mask[1:]):  # the first token is never a target
        raise RowError("no trainable token (the loss mask is empty)")
    return ids, mask


def truncated(ids: list[int], mask: list[int], max_length: int, truncation: str) -> TokenizedRow:
    """The row cut to ``max_length`` tokens: ``right`` keeps the first, ``left`` the last, ``drop`` drops it."""
    if len(ids) <= max_length:
        return TokenizedRow(ids, mask)
    if truncation == "drop":
        return TokenizedRow([], [], truncated=True, dropped=True)
    keep = slice(None, max_length) if truncation == "right" else slice(len(ids) - max_length, None)
    ids, mask = ids[keep], mask[keep]
    if truncation == "left":
        mask = [0, *mask[1:]]  # the first token kept has no context: not a target
    return TokenizedRow(ids, mask, truncated=True, dropped=not any(mask[1:]))


def _string(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise RowError(f"'{key}' is {type(value).__name__}, not a string")
    if not value.strip():
        raise RowError(f"'{key}' is empty")
    return value


def _messages(row: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The row's messages as given (every key), checked: a string role, and a string content -- which an
    assistant turn that calls tools may leave empty or out (``None``, as OpenAI's format has it)."""
    value = row.get(key)
    if not isinstance(value, list) or not value:
        raise RowError(f"'{key}' is {'an empty list' if value == [] else type(value).__name__}, not a list of "
                       "messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowError(f"'{key}'[{i}] is not a {{'role': str, 'content': str}} message")
        content, calls = message.get("content"), message.get("tool_calls")
        if not isinstance(content, str) and not (content is None and calls):
            raise RowError(f"'{key}'[{i}] is not a {{'role': str, 'content': str}} message"
                           + (" (content may be null only beside tool_calls)" if content is None else ""))
        if calls is not None and not isinstance(calls, list):
            raise RowError(f"'{key}'[{i}]['tool_calls'] is {type(calls).__name__}, not a list of calls")
    return [dict(m) for m in value]


def row_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The row's ``tools`` column (JSON schemas of the functions the template shows the model), or None."""
    tools = row.get("tools")
    if tools is None or tools == "":
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise RowError(f"'tools' is a string but not JSON ({exc.msg})") from exc
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowError(f"'tools' is {type(tools).__name__}, not a list of JSON schemas")
    return tools or None


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def refusal(exc: Exception) -> str:
    """A chat template's refusal (its ``raise_exception``, a jinja2 error, a bad argument) in one line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
            generation_prompt: bool = False) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            add_generation_prompt=generation_prompt)
    except Exception as exc:  # the template's own checks (e.g. roles must alternate)
        raise RowError(f"the chat template refused it: {refusal(exc)}") from exc
    return list(out["input_ids"])


def _marked(tokenizer, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """The template's own assistant mask (its ``{% generation %}`` blocks)."""
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except Exception as exc:
        raise RowError(f"the chat template refused it: {refusal(exc)}") from exc
    return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]


def _by_prefix(tokenizer, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """Each assistant turn's span: between the conversation up to it (with the generation prompt) and the
    conversation up to its end, each rendered by the template; checked to be prefixes of the whole. The
    span ends with the turn's end-of-turn token: the separator the template writes after it is not the
    model's to produce (what ``{% generation %}`` markers leave out too)."""
    ids = _render(tokenizer, messages, tools)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], tools, generation_prompt=True)
        through = _render(tokenizer, messages[: k + 1], tools)
        _check_prefix(before, through, f"the conversation before assistant turn {k}")
        _check_prefix(through, ids, f"the conversation through assistant turn {k}")
        for i in range(len(before), _end_of_turn(tokenizer, through, len(before), len(through))):
            mask[i] = 1
    return ids, mask


def _end_of_turn(tokenizer, ids: list[int], start: int, end: int) -> int:
    """Where a turn spanning ``ids[start:end]`` ends for the loss: just after its last special token (the
    end-of-turn token: ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``) where only whitespace follows it
    (the template's separator, e.g. ChatML's newline); ``end`` where the turn has no such token."""
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for i in range(end - 1, start - 1, -1):
        if ids[i] in special:
            tail = tokenizer.decode(ids[i + 1 : end]) if i + 1 < end else ""
            return i + 1 if not tail.strip() else end
    return end


def _check_prefix(head: list[int], ids: list[int], what: str) -> None:
    if ids[: len(head)] != head:
        raise RowError(f"the chat template does not render {what} as a prefix of the whole conversation, so the "
                       "trained tokens cannot be found; give the template {% generation %} markers")
