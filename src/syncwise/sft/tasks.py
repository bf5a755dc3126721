"""Built-in SFT tasks, generated at run time (nothing is downloaded).

- ``progression`` (the fast demo): arithmetic progressions modulo a small alphabet (``a, a+d, a+2d, ...``) of
  random length, token ids directly. The first two tokens fix ``a`` and ``d``, so only later tokens carry
  loss: a model that learns the rule drives the loss towards zero, which makes a broken gradient path easy
  to see.
- ``arith_chat``: GSM8K-shaped word problems as chat conversations (a system prompt, the problem as the
  user's turn, a worked answer ending in ``#### <number>`` as the assistant's), a byte-level BPE tokenizer
  trained on them at run time (the ``tokenizers`` library) with a ChatML chat template that marks the
  assistant's turns for the loss (``{% generation %}``) and ends them with ``<|im_end|>``. Nothing toy-shaped
  about the path it takes: it is written to JSONL and trained like a user's data
  (:func:`write_example_data`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

TASKS = ("progression", "arith_chat")
ALPHABET = 64  # progressions live in token ids 1..64
PAD_ID = 0

SYSTEM_PROMPT = "You are a careful tutor. Solve the problem step by step and end with '#### <answer>'."
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CHAT_SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_VOCAB = 1024

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonah", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Priya", "Quinn", "Ravi", "Sara", "Tom"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "coins", "cards"]


def _problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked answer ending in '#### n', n): one of the GSM8K-like shapes, two or three steps."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b, c = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 20)
        c = min(c, a + b)
        n = a + b - c
        question = (f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to {other}. "
                    f"How many {item} does {name} have now?")
        answer = (f"{name} starts with {a} {item}. After buying {b} more, {name} has {a} + {b} = {a + b}. "
                  f"After giving {c} to {other}, {name} has {a + b} - {c} = {n}.")
    elif kind == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        n = a * b
        question = f"{name} packs {a} boxes with {b} {item} in each box. How many {item} does {name} pack in all?"
        answer = f"Each box holds {b} {item}, and there are {a} boxes, so {name} packs {a} * {b} = {n} {item}."
    elif kind == 2:
        per, k, extra = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 30)
        total = per * k
        n = total + extra
        question = (f"{name} collects {per} {item} every day for {k} days and then finds {extra} more. "
                    f"How many {item} does {name} have?")
        answer = (f"In {k} days {name} collects {per} * {k} = {total} {item}. With the {extra} found, "
                  f"{name} has {total} + {extra} = {n}.")
    elif kind == 3:
        k, each = rng.randint(2, 8), rng.randint(2, 15)
        total = k * each
        n = each
        question = f"{name} shares {total} {item} equally among {k} friends. How many {item} does each friend get?"
        answer = f"{total} {item} shared among {k} friends gives {total} / {k} = {n} {item} each."
    else:
        a, b = rng.randint(10, 90), rng.randint(10, 90)
        n = a + b
        question = f"{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {name} read?"
        answer = f"{name} read {a} + {b} = {n} pages."
    return question, f"{answer}\n#### {n}", n


def arith_chat_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` conversations (``messages``: system, user, assistant) with the answer kept in ``answer``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        question, worked, answer = _problem(rng)
        rows.append({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                  {"role": "user", "content": question},
                                  {"role": "assistant", "content": worked}],
                     "answer": str(answer)})
    return rows


def chat_tokenizer(rows: list[dict[str, Any]], vocab_size: int = CHAT_VOCAB):
    """A byte-level BPE tokenizer trained on the conversations' text, with the ChatML template (generation
    markers) and ``<|im_end|>`` as its end token. Deterministic for the same rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for row in rows for m in row["messages"]] + ["system", "user", "assistant"]
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   chat_template=CHATML_TEMPLATE, padding_side="right")


def write_example_data(out_dir: str | Path, train_rows: int = 4000, eval_rows: int = 200, seed: int = 0,
                       preset: str = "llama-chat", prompt_rows: int = 500) -> Path:
    """The ``arith_chat`` task as a user brings data: ``train.jsonl`` and ``eval.jsonl`` (``messages`` rows,
    for SFT), ``prompts.jsonl`` (new problems for GRPO: ``prompt``, the system and user messages, and
    ``answer``) and ``model/`` (an untrained ``preset`` model
    saved with ``save_pretrained``, and the trained tokenizer with its chat template). Each file is renamed
    into place when complete, ``model/`` last; a folder that has one already is kept."""
    from transformers.utils import logging as hf_logging

    from ..config import ModelConfig
    from ..models import build_model

    hf_logging.disable_progress_bar()  # the one-shard writing bar says nothing
    out = Path(out_dir)
    if (out / "model" / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rows = arith_chat_rows(train_rows + eval_rows, seed)
    tokenizer = chat_tokenizer(rows)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    try:
        for name, part in (("train.jsonl", rows[:train_rows]), ("eval.jsonl", rows[train_rows:])):
            (staging / name).write_text("".join(json.dumps(r) + "\n" for r in part))
        prompts = [{"prompt": r["messages"][:2], "answer": r["answer"]} for r in arith_chat_rows(prompt_rows, seed + 1)]
        (staging / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
        model = build_model(ModelConfig(preset=preset, seed=seed), vocab_size=len(tokenizer),
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=None)
        model.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
        for name in ("train.jsonl", "eval.jsonl", "prompts.jsonl", "model"):  # model/ last: the data is complete
            with contextlib.suppress(OSError):  # another rank (torchrun) put the same files there first
                os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def progression_rows(count: int, seed: int, min_len: int, max_len: int, vocab_size: int) -> list[dict[str, Any]]:
    """``count`` progressions as token rows (``input_ids`` and ``loss_mask``: the first two tokens carry none)."""
    alphabet = min(ALPHABET, vocab_size - 1)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    starts = torch.randint(0, alphabet, (count,), generator=gen).tolist()
    strides = torch.randint(1, 5, (count,), generator=gen).tolist()
    rows = []
    for n, a, d in zip(lengths, starts, strides, strict=True):
        ids = [(a + d * i) % alphabet + 1 for i in range(n)]
        rows.append({"input_ids": ids, "loss_mask": [0, 0] + [1] * (n - 2)})
    return rows
