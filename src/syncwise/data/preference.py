"""Preference pairs as TRL's ``DPOTrainer`` reads them (trl 1.16), tokenised once and checked before any rank
trains.

A row is ``prompt`` / ``chosen`` / ``rejected`` -- strings, or message lists (conversational) -- or ``chosen`` /
``rejected`` alone, the prompt implicit in both (TRL's ``extract_prompt``: their longest common start, messages
for conversations, characters for text, a space before it left with the completion). As TRL tokenises a pair:

- text: the tokenizer's end token appended to ``chosen`` and ``rejected`` where they lack it; ``prompt``,
  ``prompt + chosen`` and ``prompt + rejected`` each tokenised whole;
- conversational: the chat template (with the row's ``tools``) on the prompt with the generation prompt, and on
  ``prompt + chosen`` and ``prompt + rejected``;
- the completion starts where the prompt's tokens and the pair's part ways (a template that renders the prompt
  alone differently, tokens that merge across the boundary): every token of each sequence after it is trained.

Each sequence is held to ``max_length`` tokens (``keep_start``: its end cut, TRL's; a pair whose prompt alone fills
it is dropped), or a pair longer than it is dropped (``drop``); both counted. A row without a trained token in
either completion, or whose chosen and rejected are the same, is bad: one line naming the file and row, or left
out and counted (``on_bad_row=skip``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .chat import RowError, refusal, row_tools
from .sft_dataset import DatasetError, read_rows, row_name, tokenized_fingerprint

PREFERENCE_COLUMNS = ("chosen", "rejected")
_CACHE_VERSION = "preference-2"  # bump when the tokenisation changes, so cached pairs are not reused


@dataclass
class PreferenceData:
    """Tokenised pairs: per pair the prompt's tokens and each completion's (the prompt shared by both)."""

    source: str
    conversational: bool
    implicit_prompt: bool
    prompts: list[list[int]]
    chosen: list[list[int]]
    rejected: list[list[int]]
    truncated: list[bool]
    skipped: int = 0  # bad rows left out (dpo.on_bad_row=skip)
    dropped: int = 0  # longer than dpo.max_length (truncation=drop, or the prompt alone fills it)
    lengths: list[int] = field(init=False)  # both sequences' tokens: what a pair costs

    def __post_init__(self) -> None:
        self.lengths = [2 * len(p) + len(c) + len(r) for p, c, r in zip(self.prompts, self.chosen, self.rejected,
                                                                        strict=True)]

    def __len__(self) -> int:
        return len(self.prompts)

    def describe(self) -> str:
        kind = "conversational" if self.conversational else "text"
        prompt = "implicit prompt (the pair's common start)" if self.implicit_prompt else "prompt / chosen / rejected"
        left_out = f", {self.skipped} bad row(s) skipped" if self.skipped else ""
        left_out += f", {self.dropped} too long dropped" if self.dropped else ""
        cut = sum(self.truncated)
        left_out += f", {cut} truncated" if cut else ""
        return f"{self.source}: {len(self)} pairs, {kind}, {prompt}{left_out}"

    def sequences(self, pair: int) -> tuple[tuple[list[int], int], tuple[list[int], int]]:
        """(chosen, rejected), each as (its tokens, where its completion starts)."""
        prompt = self.prompts[pair]
        return (prompt + self.chosen[pair], len(prompt)), (prompt + self.rejected[pair], len(prompt))


def load_preference_data(path: str, tokenizer, max_length: int, truncation: str, on_bad_row: str,
                         key: str = "dpo.dataset") -> PreferenceData:
    """Read, tokenise (cached by ``datasets``) and check every pair of ``path``; a :class:`DatasetError` naming
    ``key``, the file and the row for what cannot be trained on."""
    rows = read_rows(path, key)
    if len(rows) == 0:
        raise DatasetError(f"{key}: {path} has no rows")
    missing = [c for c in PREFERENCE_COLUMNS if c not in rows.column_names]
    if missing:
        raise DatasetError(f"{key}: {path} has no {' / '.join(repr(c) for c in missing)} column (its columns: "
                           f"{', '.join(rows.column_names)}); preference pairs need 'chosen' and 'rejected' (and "
                           "'prompt', or a prompt implicit in both)")
    implicit = "prompt" not in rows.column_names
    conversational = isinstance(rows[0]["chosen"], list)

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        try:
            prompt, chosen, rejected = tokenize_pair(row, tokenizer)
        except RowError as exc:
            return {"prompt": [], "chosen": [], "rejected": [], "truncated": False, "dropped": False,
                    "error": str(exc)}
        prompt, chosen, rejected, cut, dropped = _held(prompt, chosen, rejected, max_length, truncation)
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "truncated": cut, "dropped": dropped,
                "error": ""}

    fingerprint = tokenized_fingerprint(rows, _CACHE_VERSION, None, tokenizer, max_length, truncation)
    done = rows.map(encode, remove_columns=rows.column_names, new_fingerprint=fingerprint)
    errors = [i for i, e in enumerate(done["error"]) if e]
    if errors and on_bad_row == "error":
        first = errors[0]
        raise DatasetError(f"{key}: {path} {row_name(path, first)}: {done[first]['error']}"
                           + (f" ({len(errors) - 1} more bad row(s); dpo.on_bad_row=skip leaves them out)"
                              if len(errors) > 1 else " (dpo.on_bad_row=skip leaves such rows out)"))
    keep = [i for i, (e, d) in enumerate(zip(done["error"], done["dropped"], strict=True)) if not e and not d]
    if not keep:
        raise DatasetError(f"{key}: {path}: no pair left to train on ({len(errors)} bad, {sum(done['dropped'])} "
                           f"longer than dpo.max_length={max_length} and dropped)")
    kept = done.select(keep).to_dict()
    return PreferenceData(path, conversational, implicit, kept["prompt"], kept["chosen"], kept["rejected"],
                          kept["truncated"], skipped=len(errors), dropped=sum(done["dropped"]))


def tokenize_pair(row: dict[str, Any], tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) token ids of one row as TRL's DPOTrainer tokenises it (see the module's text);
    a :class:`RowError` saying why it cannot be trained on."""
    if row.get("prompt") is None:  # no 'prompt' column, or a row without one in a file that has it
        row = extract_prompt(row)
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    conversational = isinstance(chosen, list)
    if isinstance(rejected, list) != conversational or (isinstance(prompt, list) != conversational and prompt):
        raise RowError("'prompt', 'chosen' and 'rejected' mix text and message lists; give all three as strings, or "
                       "all as message lists")
    if chosen == rejected:
        raise RowError("'chosen' and 'rejected' are the same: the pair prefers nothing")
    if conversational:
        tools = row_tools(row)
        prompt_ids = _render(tokenizer, prompt, tools, generation_prompt=True)
        with_chosen = _render(tokenizer, prompt + chosen, tools)
        with_rejected = _render(tokenizer, prompt + rejected, tools)
    else:
        for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise RowError(f"'{name}' is {type(value).__name__}, not a string")
        eos = tokenizer.eos_token or ""
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        with_chosen = list(tokenizer(prompt + chosen)["input_ids"])
        with_rejected = list(tokenizer(prompt + rejected)["input_ids"])
    start = min(_common_start(prompt_ids, with_chosen), _common_start(prompt_ids, with_rejected))
    if start == 0:
        raise RowError("the prompt has no token: a completion's first token would have no context")
    chosen_ids, rejected_ids = with_chosen[start:], with_rejected[start:]
    if not chosen_ids or not rejected_ids:
        raise RowError(f"no trained token in {'chosen' if not chosen_ids else 'rejected'} (nothing after the prompt)")
    return prompt_ids[:start], chosen_ids, rejected_ids


def extract_prompt(row: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``extract_prompt``: the longest common start of ``chosen`` and ``rejected`` as the prompt (messages, or
    characters with a space before the split left to the completions)."""
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, (str, list)) and type(chosen) is type(rejected):
        idx = 0
        for idx in range(min(len(chosen), len(rejected))):
            if chosen[idx] != rejected[idx]:
                if chosen[idx - 1] == " ":
                    idx -= 1
                break
        return {**row, "prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}
    raise RowError(f"'chosen' is {type(chosen).__name__} and 'rejected' {type(rejected).__name__}: both strings or "
                   "both message lists")


def preference_batch(data: PreferenceData, pairs: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows, each pair's chosen then its rejected (rows 2k, 2k + 1): ``input_ids``,
    ``attention_mask``, and ``loss_mask`` on each completion's tokens."""
    sequences = [seq for pair in pairs for seq in data.sequences(pair)]
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    loss_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for r, (ids, start) in enumerate(sequences):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        attention[r, :len(ids)] = 1
        loss_mask[r, start:len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}


def _held(prompt: list[int], chosen: list[int], rejected: list[int], max_length: int,
          truncation: str) -> tuple[list[int], list[int], list[int], bool, bool]:
    """The pair within ``max_length`` tokens a sequence: (prompt, chosen, rejected, truncated, dropped)."""
    longest = len(prompt) + max(len(chosen), len(rejected))
    if longest <= max_length:
        return prompt, chosen, rejected, False, False
    if truncation == "drop" or len(prompt) >= max_length:  # keep_start would leave no completion token: TRL drops
        return prompt, chosen, rejected, True, True
    room = max_length - len(prompt)
    return prompt, chosen[:room], rejected[:room], True, False


def _render(tokenizer, messages: Any, tools: list[dict[str, Any]] | None, generation_prompt: bool = False) -> list[int]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in messages):
        raise RowError("a conversational pair's 'prompt', 'chosen' and 'rejected' are lists of {'role', 'content'} "
                       "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise RowError("the tokenizer has no chat template (chat_template), which conversational pairs need")
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            add_generation_prompt=generation_prompt)
    except Exception as exc:  # the template's own checks
        raise RowError(f"the chat template refused it: {refusal(exc)}") from exc
    return list(out["input_ids"])


def _common_start(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        length += 1
    return length
