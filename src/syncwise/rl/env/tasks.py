"""Built-in tasks (prompts + rule-based rewards), the tokenizer they use, and user-supplied ones.

The default task, ``target``: prompts such as ``target 7 :`` ask for a digit; the reward is 1 for the
target digit, partial credit for a digit close to it, 0 otherwise. A freshly initialised tiny model
answers at random (mean reward ≈ 0.1) and learns to hit the target within a few minutes of CPU GRPO.

``repeat``, shaped like real RL: ``repeat 7 times 2 3 :`` asks for the digit 7 twenty-three times, then the
end of the sequence. Counts are log-uniform over 1-99, so responses are long-tailed (a few tokens to ~100);
the reward gives partial credit: half for the length (min / max of the words given and n), half for the
right digits among the first n words.

The tokenizer is a word-level ``tokenizers`` model built at run time (no hub) and saved with exports.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from ...config import Config, RLConfig, reward_paths
from ...runtime import script_objects
from .classes import EnvironmentClass
from .prompts import EncodedPrompts, encode_prompts
from .scoring import RewardFunction, reward_functions
from .tools import Tool, load_tools

RewardFn = Callable[[str, str, dict[str, Any]], float]
DIGITS = [str(d) for d in range(10)]
SPECIALS = ["<pad>", "<unk>", "<eos>"]
WORDS = ["target", ":", "answer", "is"]
TASK_WORDS = {"repeat": ["repeat", "times"]}  # beyond WORDS; the target task's vocabulary stays as it was


def builtin_tokenizer(task: str = "target") -> PreTrainedTokenizerFast:
    """Word-level tokenizer over a built-in task's vocabulary (17 tokens for ``target``), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS + DIGITS + TASK_WORDS.get(task, []))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>", padding_side="left",
    )


def target_reward(prompt: str, response: str, sample: dict[str, Any]) -> float:
    """1 for the target digit as the first answer token, 1 - |d - t| / 4 for a digit d near it, else 0."""
    words = response.split()
    if not words or words[0] not in DIGITS:
        return 0.0
    distance = abs(int(words[0]) - int(sample["target"]))
    return max(0.0, 1.0 - distance / 4.0)


def repeat_reward(prompt: str, response: str, sample: dict[str, Any]) -> float:
    """Half for the length (min / max of the words given and ``count``), half for the requested digit's
    copies among the first ``count`` words (over ``count``): 1 only for exactly ``count`` copies."""
    words = response.split()
    count, digit = int(sample["count"]), str(sample["digit"])
    hits = sum(1 for word in words[:count] if word == digit)
    length = min(len(words), count) / max(len(words), count)
    return 0.5 * length + 0.5 * hits / count


@dataclass
class PromptSource:
    """Prompts (with their extra fields), the reward that scores responses to them, and the response
    length the task needs (``rl.max_new_tokens=0`` takes it)."""

    rows: list[dict[str, Any]]
    reward_fn: RewardFn | None  # a built-in task's own reward
    max_new_tokens: int = 0
    # A correct response to a row, for the SFT warm start (rl.warm_start_steps); None: the task has none.
    demonstration: Callable[[dict[str, Any]], str] | None = None
    where: list[str] | None = None  # each row's place in its file ("line 3"), for errors
    name: str = ""  # the file, or "task <name>"
    # what scores responses: rl.reward_fn's functions, or the task's own reward
    rewards: list[RewardFunction] = field(default_factory=list)
    tools: dict[str, Tool] = field(default_factory=dict)  # rl.tools: what the policy may call (multi-turn)
    environment: EnvironmentClass | None = None  # rl.environment: each episode's class (multi-turn)

    prompt_ids: list[list[int]] | None = None  # each row's prompt as tokens (:meth:`encode`)
    encoded: EncodedPrompts | None = None

    def encode(self, tokenizer, cfg: RLConfig) -> EncodedPrompts:
        """Every prompt as the sampler sees it (chat template, ``rl.max_prompt_length``); rows dropped for
        their length leave the source. A prompt that cannot be used is a ValueError naming its row."""
        encoded = encode_prompts(self.rows, self.where, self.name, cfg, tokenizer, self.all_tools)
        self.rows = [self.rows[i] for i in encoded.kept]
        self.where = [self.where[i] for i in encoded.kept] if self.where else None
        self.prompt_ids, self.encoded = encoded.ids, encoded
        return encoded

    @property
    def all_tools(self) -> dict[str, Tool]:
        """Every tool a prompt may show: ``rl.tools``' and the environment's."""
        return {**self.tools, **(self.environment.tools if self.environment else {})}

    def batch(self, step: int, rank: int, world_size: int, count: int) -> list[dict[str, Any]]:
        """The ``count`` rows rank ``rank`` takes at ``step``: a deterministic, epoch-shuffled walk, so a
        resumed run sees exactly the prompts it would have."""
        return [self.rows[i] for i in self.batch_indices(step, rank, world_size, count)]

    def batch_indices(self, step: int, rank: int, world_size: int, count: int) -> list[int]:
        """The rows of :meth:`batch`, as indices (into ``rows`` and ``prompt_ids``)."""
        start = (step * world_size + rank) * count
        out = []
        for position in range(start, start + count):
            epoch, index = divmod(position, len(self.rows))
            out.append(self._order(epoch)[index])
        return out

    def _order(self, epoch: int) -> list[int]:
        if getattr(self, "_epoch", None) != epoch:
            order = list(range(len(self.rows)))
            random.Random(epoch).shuffle(order)
            self._epoch, self._cached_order = epoch, order
        return self._cached_order


def target_task(num_prompts: int = 200) -> PromptSource:
    rng = random.Random(1234)
    rows = []
    for _ in range(num_prompts):
        target = rng.randrange(10)
        rows.append({"prompt": f"target {target} :", "target": target})
    return PromptSource(rows, target_reward, max_new_tokens=2, demonstration=lambda row: str(row["target"]))


REPEAT_MAX = 99
DATASET_MAX_NEW_TOKENS = 256  # a user's prompts without rl.max_new_tokens (TRL's max_completion_length)


def repeat_task(num_prompts: int = 400) -> PromptSource:
    """Counts log-uniform over 1-99 (median ~10, a tail to 99), digits uniform."""
    rng = random.Random(4321)
    rows = []
    for _ in range(num_prompts):
        digit = rng.randrange(10)
        count = min(REPEAT_MAX, max(1, round(math.exp(rng.uniform(0.0, math.log(REPEAT_MAX))))))
        rows.append({"prompt": f"repeat {digit} times {count // 10} {count % 10} :", "digit": digit, "count": count})
    return PromptSource(rows, repeat_reward, max_new_tokens=REPEAT_MAX + 1,  # the digits, then the end
                        demonstration=lambda row: " ".join([str(row["digit"])] * row["count"]))


TASKS: dict[str, Callable[[], PromptSource]] = {"target": target_task, "repeat": repeat_task}


def load_dataset(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of a JSONL or Parquet file or a ``datasets`` ``save_to_disk`` folder (as ``sft.dataset`` reads them) and
    where each is ("line 3" / "row 3"); each needs a ``prompt``: a non-empty string or a non-empty list of
    ``{"role", "content"}`` messages (TRL's two prompt formats); every other column reaches the rewards. Errors
    name the file and the line (JSONL) or row (Parquet, a folder)."""
    file = Path(path)
    if not script_objects.is_reference(path) and not file.exists():
        raise ValueError(f"rl.dataset: file not found: {path}")
    if script_objects.is_reference(path) or file.is_dir():
        from ...data.sft_dataset import read_rows

        numbered = [(f"row {i}", row) for i, row in enumerate(read_rows(path, "rl.dataset").to_list(), start=1)]
    elif file.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional: only for Parquet datasets

        try:
            numbered = [(f"row {i}", row) for i, row in enumerate(pq.read_table(file).to_pylist(), start=1)]
        except Exception as exc:  # pyarrow raises its own kinds for a file that is not Parquet
            raise ValueError(f"rl.dataset: {path} is not a readable Parquet file ({exc})") from exc
    else:
        numbered = []
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    numbered.append((f"line {number}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"rl.dataset: {path} line {number} is not JSON: {exc}") from exc
    if not numbered:
        raise ValueError(f"rl.dataset: {path} has no rows")
    for where, row in numbered:
        problem = _prompt_problem(row)
        if problem:
            raise ValueError(f"rl.dataset: {path} {where} {problem}")
    return [row for _, row in numbered], [where for where, _ in numbered]


def _prompt_problem(row: Any) -> str | None:
    if not isinstance(row, dict) or "prompt" not in row:
        return "has no 'prompt'"
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return "has an empty 'prompt'" if not prompt.strip() else None
    if isinstance(prompt, list):
        if not prompt:
            return "has an empty 'prompt' (no messages)"
        for i, message in enumerate(prompt):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                return f"has 'prompt'[{i}] that is not a {{'role': str, 'content': str}} message"
        return None
    return f"has a 'prompt' of type {type(prompt).__name__} (a string or a list of messages)"


def check_reward_columns(rewards: list[RewardFunction], rows: list[dict[str, Any]], where: str) -> None:
    """Before any rank starts: each reward function fits a signature and finds the columns it reads by name (a
    TRL function's parameters, a built-in reward's ``answer``) in every row."""
    columns = set.intersection(*(set(row) for row in rows)) if rows else set()
    for reward in rewards:
        reward.check(columns, where)


def prompt_source(task: str, dataset: str | None, reward_fn: str | list[str] | None,
                  reward_weights: list[float] = (), tools: list[str] = (), environment: str | None = None
                  ) -> PromptSource:
    """A built-in task's prompts and reward, or a dataset's with ``rl.reward_fn``'s functions (and
    ``rl.tools``' functions for the policy to call, ``rl.environment``'s class for each episode)."""
    paths = reward_paths(reward_fn)
    if dataset:
        rows, where = load_dataset(dataset)
        source = PromptSource(rows, None, max_new_tokens=DATASET_MAX_NEW_TOKENS, where=where, name=dataset,
                              rewards=reward_functions(paths, list(reward_weights)), tools=load_tools(list(tools)))
        check_reward_columns(source.rewards, rows, dataset)
        if environment:
            source.environment = EnvironmentClass(environment)
            clash = sorted(set(source.tools) & set(source.environment.schemas))
            if clash:
                raise ValueError(f"rl.environment: {source.environment.name} has tool(s) {', '.join(clash)}, and "
                                 f"rl.tools defines them too; rename one (a call must name one function)")
            for row, place in zip(rows, where, strict=True):
                source.environment.check_rows(set(row), f"{dataset} {place}")
                source.environment.row_places[id(row)] = f"{dataset} {place}"
            if not paths and not source.environment.scores:
                raise ValueError(f"rl.environment: {source.environment.name} has no get_reward(), and rl.reward_fn is "
                                 f"not set: nothing scores the episodes")
        return source
    if environment:
        raise ValueError("rl.environment: an environment starts its episodes from rows of rl.dataset (reset(**row)); "
                         "give prompts with rl.dataset")
    if task not in TASKS:
        raise ValueError(f"rl.task: {task!r} is not one of {', '.join(TASKS)}")
    if tools:
        raise ValueError("rl.tools: the built-in tasks call no tools; give prompts with rl.dataset (e.g. "
                         "syncwise sft --write-example-data DIR --task arith_tools writes some)")
    source = TASKS[task]()
    source.name = f"task {task}"
    source.rewards = (reward_functions(paths, list(reward_weights)) if paths
                      else [RewardFunction(task, "rl.reward_fn", source.reward_fn)])
    check_reward_columns(source.rewards, source.rows, source.name)
    return source


def end_token_ids(model_path: str | None) -> list[int]:
    """The end tokens of the model's ``generation_config.json`` (an int or a list: chat models end turns with
    their own token); none without one."""
    if not model_path or not (Path(model_path) / "generation_config.json").is_file():
        return []
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_path, local_files_only=True).eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def load_tokenizer(config: Config):
    """The job's tokenizer: ``rl.tokenizer``'s, the model directory's (left padding; the end token pads where
    it has no pad token), or the built-in task's."""
    from transformers import AutoTokenizer

    path = config.rl.tokenizer or config.model.path
    if path:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    return builtin_tokenizer(config.rl.task)
