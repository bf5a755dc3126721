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
- ``arith_tools`` (``syncwise sft --write-example-data DIR --task arith_tools``): arithmetic word problems
  too long to do in the head for a tiny model (products of two-digit numbers and sums of three-digit ones),
  solved with the built-in calculator: a Qwen2.5-style template (tools in the system prompt, ``<tool_call>``
  JSON, tool results as ``<tool_response>``, generation markers), an assistant turn that calls
  ``calculator``, the tool's answer, and a last turn ending in ``#### <number>``. Beside them the same
  problems answered without the tool (``train_no_tools.jsonl``), the baseline. ``arith_python``: the same
  problems, the assistant calling the built-in ``python`` tool with a program that prints the answer.
- ``guess_number`` (``--task guess_number``): games of the built-in environment
  :class:`syncwise.environments.GuessNumber` -- several calls of ``guess`` on one episode's state, each answer
  the range left -- played by guessing anywhere in that range, for the warm-up before GRPO finds a better way.
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
EXAMPLE_TASKS = ("arith_chat", "arith_tools", "arith_python", "guess_number")  # what --write-example-data writes
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
# Qwen2.5-Instruct's template with generation markers around what the assistant writes (its text and calls)
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if loop.first and message.content %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # added, not special (Qwen2.5)
TOOLS_SYSTEM_PROMPT = "Solve the problem. Use the calculator for the arithmetic, then end with '#### <answer>'."
PYTHON_SYSTEM_PROMPT = "Solve the problem. Use Python for the arithmetic, then end with '#### <answer>'."
NO_TOOLS_SYSTEM_PROMPT = "Solve the problem. End with '#### <answer>'."
GUESS_SYSTEM_PROMPT = ("Find the hidden number with the guess tool. Each answer says higher or lower and the range "
                       "left; stop when it says correct.")
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


def chat_tokenizer(rows: list[dict[str, Any]], vocab_size: int = CHAT_VOCAB, texts: list[str] = (),
                   template: str = CHATML_TEMPLATE, added: list[str] = (), split_digits: bool = False):
    """A byte-level BPE tokenizer trained on the conversations' text (and ``texts``), with ``template`` (the
    ChatML one with generation markers), ``added`` tokens (not special) and ``<|im_end|>`` as its end token;
    ``split_digits``: one token per digit (as Llama-3's and Qwen2's tokenizers), so a number is the same
    tokens wherever it stands. Deterministic for the same rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for row in rows for m in row["messages"] if m.get("content")] + list(texts)
    tok.train_from_iterator(corpus + ["system", "user", "assistant"], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                        chat_template=template, padding_side="right")
    if added:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tokenizer


def _tool_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, the expression that answers it, its value): two or three operations on numbers a tiny model
    cannot multiply in its head."""
    name = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(100, 999)
        question = (f"{name} buys {a} boxes of {item} with {b} in each box and already has {c}. "
                    f"How many {item} does {name} have?")
        expression = f"{a} * {b} + {c}"
    elif kind == 1:
        b, c = rng.randint(11, 49), rng.randint(3, 19)
        a = b * c + rng.randint(100, 999)
        question = f"{name} has {a} {item} and gives {b} to each of {c} friends. How many {item} are left?"
        expression = f"{a} - {b} * {c}"
    elif kind == 2:
        a, c, k = rng.randint(12, 99), rng.randint(3, 12), rng.randint(2, 9)
        question = (f"A school orders {a} packs of {c * k} {item}. They are shared equally among {c} classes. "
                    f"How many {item} does each class get?")
        expression = f"{a} * {c * k} / {c}"
    else:
        a, b = rng.randint(12, 99), rng.randint(12, 52)
        c = rng.randint(100, a * b - 1)
        question = f"{name} saves {a} dollars a week for {b} weeks, then spends {c} dollars. How much is left?"
        expression = f"{a} * {b} - {c}"
    from ..tools import calculator

    return question, expression, int(calculator(expression))


def arith_tools_rows(count: int, seed: int, tools: bool = True, tool: str = "calculator") -> list[dict[str, Any]]:
    """``count`` conversations (``messages``, ``tools``, ``answer``): with ``tools``, the assistant calls
    ``tool`` -- the calculator with the problem's expression, or the python tool with a program printing it
    (exact: integer division) -- reads its answer and answers; without, it answers at once."""
    from transformers.utils import get_json_schema

    from ..tools import BUILTIN_TOOLS

    schema = [get_json_schema(BUILTIN_TOOLS[tool])]
    system = PYTHON_SYSTEM_PROMPT if tool == "python" else TOOLS_SYSTEM_PROMPT
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        question, expression, value = _tool_problem(rng)
        answer = f"The answer is {value}.\n#### {value}"
        if tools:
            arguments, result = {"expression": expression}, str(value)
            if tool == "python":  # what the program prints, as the tool returns it
                arguments, result = {"code": f"print({expression.replace(' / ', ' // ')})"}, f"{value}\n"
            call = {"type": "function", "function": {"name": tool, "arguments": arguments}}
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "name": tool, "content": result},
                        {"role": "assistant", "content": answer}]
            rows.append({"messages": messages, "tools": schema, "answer": str(value)})
        else:
            messages = [{"role": "system", "content": NO_TOOLS_SYSTEM_PROMPT}, {"role": "user", "content": question},
                        {"role": "assistant", "content": f"{expression} = {value}\n#### {value}"}]
            rows.append({"messages": messages, "answer": str(value)})
    return rows


def guess_number_rows(count: int, seed: int, max_guesses: int = 4) -> list[dict[str, Any]]:
    """``count`` games of :class:`syncwise.environments.GuessNumber` (``messages``, ``tools``, and the row's
    ``low``, ``high``, ``secret``), played by guessing anywhere in the range left -- no binary search, which
    is what GRPO is to find -- and kept where found within ``max_guesses`` (the demonstrations a warm-up sees)."""
    from transformers.utils import get_json_schema

    from ..environments import GuessNumber

    schema = [get_json_schema(GuessNumber.guess)]
    rng = random.Random(seed)
    rows = []
    while len(rows) < count:
        low, size = rng.randint(1, 40), rng.randint(8, 15)
        high = low + size - 1
        secret = rng.randint(low, high)
        game = GuessNumber()
        game.reset(low, high, secret)
        messages = [{"role": "system", "content": GUESS_SYSTEM_PROMPT},
                    {"role": "user", "content": f"The hidden number is between {low} and {high}."}]
        while not game.solved and game.guesses < max_guesses:
            number = rng.randint(game.low, game.high)
            call = {"type": "function", "function": {"name": "guess", "arguments": {"number": number}}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "guess", "content": game.guess(number)}]
        if game.solved:
            messages.append({"role": "assistant", "content": f"Found it: {secret}."})
            rows.append({"messages": messages, "tools": schema, "low": low, "high": high, "secret": secret})
    return rows


def tools_tokenizer(rows: list[dict[str, Any]]):
    """The arith_tools tokenizer: BPE trained on the rendered conversations (the tools' schema and the call
    syntax included), one token per digit, with :data:`TOOLS_TEMPLATE`."""
    plain = chat_tokenizer(rows[:1], template=TOOLS_TEMPLATE, added=TOOL_TAGS)  # to render the texts once
    texts = [plain.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False) for row in rows]
    # digits one by one: the numbers the call copies from the question ('has 607' -> '"... + 607"') are the same
    # tokens in both places (with whole-number tokens ' 607' and '607' differ, and a tiny model does not learn
    # the call in a few hundred steps)
    return chat_tokenizer(rows, texts=texts, template=TOOLS_TEMPLATE, added=TOOL_TAGS, split_digits=True)


def write_example_data(out_dir: str | Path, train_rows: int = 4000, eval_rows: int = 200, seed: int = 0,
                       preset: str = "llama-chat", prompt_rows: int = 500, task: str = "arith_chat") -> Path:
    """A built-in task as a user brings data: ``train.jsonl`` and ``eval.jsonl`` (``messages`` rows, for SFT),
    ``prompts.jsonl`` (new problems for GRPO: ``prompt``, the system and user messages, and ``answer``), for
    ``arith_chat`` ``pairs.jsonl`` and ``eval_pairs.jsonl`` (preference pairs for DPO: :func:`preference_pairs`), and
    ``model/`` (an untrained ``preset`` model saved with ``save_pretrained``, and the trained tokenizer with
    its chat template). ``task``: ``arith_chat``, ``arith_tools`` (tool-use chats with a ``tools`` column,
    and ``train_no_tools.jsonl`` / ``eval_no_tools.jsonl`` / ``prompts_no_tools.jsonl``: the same problems
    answered without the tool), ``arith_python`` (the same problems solved with the built-in python tool), or
    ``guess_number`` (games of ``syncwise.environments:GuessNumber``, the
    prompts with each game's ``low``, ``high`` and ``secret`` for its ``reset``). Each
    file is renamed into place when complete, ``model/`` last; a folder that has one already is kept."""
    from transformers.utils import logging as hf_logging

    from ..config import ModelConfig
    from ..models import build_model

    hf_logging.disable_progress_bar()  # the one-shard writing bar says nothing
    out = Path(out_dir)
    if (out / "model" / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[dict[str, Any]]] = {}
    if task == "guess_number":
        rows = guess_number_rows(train_rows + eval_rows, seed)
        tokenizer = tools_tokenizer(rows)
        prompts = [{"prompt": r["messages"][:2], **{k: r[k] for k in ("low", "high", "secret")}}
                   for r in guess_number_rows(prompt_rows, seed + 1)]  # the tools: the environment's
    elif task == "arith_python":
        rows = arith_tools_rows(train_rows + eval_rows, seed, tool="python")
        tokenizer = tools_tokenizer(rows)
        prompts = [{"prompt": r["messages"][:2], "answer": r["answer"]}
                   for r in arith_tools_rows(prompt_rows, seed + 1, tool="python")]  # the tool: rl.tools
    elif task == "arith_tools":
        rows = arith_tools_rows(train_rows + eval_rows, seed)
        plain = arith_tools_rows(train_rows + eval_rows, seed, tools=False)  # the same problems, in that order
        tokenizer = tools_tokenizer(rows + plain)
        files["train_no_tools.jsonl"], files["eval_no_tools.jsonl"] = plain[:train_rows], plain[train_rows:]
        problems = arith_tools_rows(prompt_rows, seed + 1, tools=False)
        files["prompts_no_tools.jsonl"] = [{"prompt": r["messages"][:2], "answer": r["answer"]} for r in problems]
        prompts = [{"prompt": [{"role": "system", "content": TOOLS_SYSTEM_PROMPT}, r["messages"][1]],
                    "answer": r["answer"]} for r in problems]  # the tools: rl.tools, shown by the template
    else:
        rows = arith_chat_rows(train_rows + eval_rows, seed)
        tokenizer = chat_tokenizer(rows)
        prompts = [{"prompt": r["messages"][:2], "answer": r["answer"]}
                   for r in arith_chat_rows(prompt_rows, seed + 1)]
        pairs = preference_pairs(arith_chat_rows(prompt_rows, seed + 2))
        cut = max(len(pairs) * 9 // 10, 1)
        files["pairs.jsonl"], files["eval_pairs.jsonl"] = pairs[:cut], pairs[cut:]
    files["train.jsonl"], files["eval.jsonl"], files["prompts.jsonl"] = rows[:train_rows], rows[train_rows:], prompts
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    try:
        for name, part in files.items():
            (staging / name).write_text("".join(json.dumps(r) + "\n" for r in part))
        model = build_model(ModelConfig(preset=preset, seed=seed), vocab_size=len(tokenizer),
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=None)
        model.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
        for name in [*files, "model"]:  # model/ last: the data is complete
            with contextlib.suppress(OSError):  # another rank (torchrun) put the same files there first
                os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def preference_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's preference rows from arith_chat conversations: ``prompt`` (system and user), ``chosen`` (the worked
    answer) and ``rejected`` (the same working with a wrong final number), for ``syncwise dpo``."""
    pairs = []
    for i, row in enumerate(rows):
        *prompt, answer = row["messages"]
        wrong = answer["content"].rsplit("#### ", 1)[0] + f"#### {int(row['answer']) + 1 + i % 7}"
        pairs.append({"prompt": prompt, "chosen": [answer], "rejected": [{"role": "assistant", "content": wrong}]})
    return pairs


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
