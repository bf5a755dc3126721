"""Built-in reward functions for verifiable answers, in the ``rl.reward_fn`` signature
``(prompt, response, row) -> float``: 1.0 when the response's answer equals the row's ``answer``, else 0.0.

- :func:`final_number`: GSM8K's convention -- the number right after the last ``####`` (the first one after
  it, as verl's strict GSM8K extractor and lm-eval read it: ``#### 19 apples in 2 baskets`` answers 19) or,
  without one, the last number in the response;
- :func:`boxed`: LaTeX's ``\\boxed{...}`` (the last one), lightly normalised.

With ``rl.tools`` a response is the conversation after the prompt (assistant and tool messages); these read
its last assistant message.

Numbers compare as numbers: thousands separators (``1,234``), a leading ``+``, trailing zeros (``5.0``) and a
trailing full stop do not matter; ``-3`` and ``3`` do.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


def reads_columns(*columns: str):
    """Mark a reward function as reading these dataset columns: a dataset without them is one line before any
    rank starts (a TRL-signature function's named parameters are read from its signature instead)."""

    def mark(fn):
        fn.syncwise_columns = columns
        return fn

    return mark


@reads_columns("answer")
def final_number(prompt: str, response: str | list[dict[str, Any]], row: dict[str, Any]) -> float:
    """1.0 if the response's final number equals ``row["answer"]`` (GSM8K: the first one after the last
    ``####``, whatever text follows it; else the last number anywhere)."""
    return float(_same(_final_number(final_text(response)), _answer(row)))


@reads_columns("answer")
def boxed(prompt: str, response: str | list[dict[str, Any]], row: dict[str, Any]) -> float:
    """1.0 if the content of the response's last ``\\boxed{...}`` equals ``row["answer"]`` (as numbers where
    both are, else as text without spaces, ``$`` and a ``\\text{}`` wrapper)."""
    return float(_same(_last_boxed(final_text(response)), _answer(row)))


def final_text(response: str | list[dict[str, Any]]) -> str:
    """A response's answer text: the string itself, or a conversation's last assistant message's content
    (multi-turn rollouts with tools; "" when it has none, e.g. only a call)."""
    if isinstance(response, str):
        return response
    last = next((m for m in reversed(response) if m.get("role") == "assistant"), {})
    return str(last.get("content") or "")


def _answer(row: dict[str, Any]) -> str:
    if "answer" not in row:
        raise KeyError("the built-in rewards compare with the row's 'answer' column, which this row lacks")
    return str(row["answer"])


def _final_number(text: str) -> str | None:
    if "####" in text:
        found = _NUMBER.search(text.rsplit("####", 1)[1])
        return found.group(0) if found else None
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced braces: no answer


def _number(text: str) -> Decimal | None:
    cleaned = text.strip().rstrip(".").replace(",", "").replace(" ", "")
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", cleaned):
        return None
    try:
        return Decimal(cleaned)
    except InvalidOperation:  # pragma: no cover - the pattern admits only numbers
        return None


def _normalised(text: str) -> str:
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    return re.sub(r"[\s$]", "", text).rstrip(".")


def _same(given: str | None, wanted: str) -> bool:
    if given is None:
        return False
    a, b = _number(given), _number(wanted)
    if a is not None and b is not None:
        return a == b
    return _normalised(given) == _normalised(wanted)


def batched(fn):
    """Mark a reward function as batched: called once per rollout as ``fn(prompts, responses, rows) ->
    list[float]`` (a model-based or sandboxed reward scores a batch at once). A function whose first
    parameter is named ``prompts`` is taken as batched without it."""
    fn.syncwise_batched = True
    return fn
