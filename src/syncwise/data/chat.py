"""SFT rows as token ids with a loss mask, in the dataset formats TRL users already have.

- ``text``: language modelling on every token (the tokenizer's end token appended);
- ``prompt`` + ``completion`` (strings): the two tokenised apart and joined, as generation sees them (the
  prompt with the tokenizer's special tokens, the completion with the end token); loss on the completion;
- ``messages`` (a list of ``{"role", "content"}``): the tokenizer's chat template; loss on the assistant
  turns only -- from the template's generation markers (``{% generation %}``) where it has them, otherwise
  by rendering the prefix of each assistant turn (the conversation up to it with the generation prompt, and
  up to its end: the tokens between are the turn's);
- conversational ``prompt`` + ``completion`` (message lists): the prompt rendered with the generation prompt,
  the whole conversation after it; loss on what follows the prompt.

A row that cannot be trained on raises :class:`RowError` saying why; the caller names the file and the row.
"""

from __future__ import annotations

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
        messages = _messages(row, "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise RowError("'messages' has no assistant turn: nothing to train on")
        ids, mask = (_marked(tokenizer, messages) if mask_source == "markers" else _by_prefix(tokenizer, messages))
    elif fmt == "conversational_prompt_completion":
        prompt, completion = _messages(row, "prompt"), _messages(row, "completion")
        head = _render(tokenizer, prompt, generation_prompt=True)
        ids = _render(tokenizer, prompt + completion)
        _check_prefix(head, ids, "the prompt messages")
        mask = [0] * len(head) + [1] * (len(ids) - len(head))
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


def _messages(row: dict[str, Any], key: str) -> list[dict[str, str]]:
    value = row.get(key)
    if not isinstance(value, list) or not value:
        raise RowError(f"'{key}' is {'an empty list' if value == [] else type(value).__name__}, not a list of "
                       "messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise RowError(f"'{key}'[{i}] is not a {{'role': str, 'content': str}} message")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            add_generation_prompt=generation_prompt)
    except Exception as exc:  # the template's own checks (e.g. roles must alternate)
        raise RowError(f"the chat template refused it: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
    return list(out["input_ids"])


def _marked(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The template's own assistant mask (its ``{% generation %}`` blocks)."""
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except Exception as exc:
        raise RowError(f"the chat template refused it: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
    return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]


def _by_prefix(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Each assistant turn's span: between the conversation up to it (with the generation prompt) and the
    conversation up to its end, each rendered by the template; checked to be prefixes of the whole."""
    ids = _render(tokenizer, messages)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], generation_prompt=True)
        through = _render(tokenizer, messages[: k + 1])
        _check_prefix(before, through, f"the conversation before assistant turn {k}")
        _check_prefix(through, ids, f"the conversation through assistant turn {k}")
        for i in range(len(before), len(through)):
            mask[i] = 1
    return ids, mask


def _check_prefix(head: list[int], ids: list[int], what: str) -> None:
    if ids[: len(head)] != head:
        raise RowError(f"the chat template does not render {what} as a prefix of the whole conversation, so the "
                       "trained tokens cannot be found; give the template {% generation %} markers")
