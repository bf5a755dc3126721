"""The jobs' own sections: ``syncwise sft``'s (``sft``) and every job's run (``train``: steps, seed, output,
checkpoints)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from .checks import ConfigError, choice, non_negative, positive

SFT_TASKS = ("progression", "arith_chat")
# Where a job's metrics go beside metrics.jsonl (always written): the packages are optional extras
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")
LOGGER_PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def logger_names(key: str, value: str | list[str]) -> list[str]:
    """``train.logger`` / ``sft.logger`` as a list, jsonl first (always written): a name, a comma-separated list
    or a list; a ConfigError naming the key for an unknown one, or one whose package is not installed."""
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n).strip() for n in value]
    for name in names:
        choice(key, name, LOGGERS)
    missing = [n for n in names if n in LOGGER_PACKAGES and importlib.util.find_spec(LOGGER_PACKAGES[n]) is None]
    if missing:
        extras = ",".join(missing)
        raise ConfigError(f"{key}: {', '.join(missing)} needs its package, which is not installed: "
                          f"pip install 'syncwise[{extras}]'")
    return ["jsonl", *dict.fromkeys(n for n in names if n != "jsonl")]


def progress_choice(key: str, value: bool | str) -> bool | str:
    if value not in (True, False, "auto"):
        raise ConfigError(f"{key}: must be true, false or auto, got {value!r}")
    return value
SFT_TRUNCATION = ("right", "left", "drop")


@dataclass
class SFTConfig:
    """`syncwise sft`: supervised fine-tuning on a dataset (JSONL, Parquet, a save_to_disk folder) or a
    built-in task (``progression``: the fast synthetic demo; ``arith_chat``: GSM8K-shaped chat problems)."""

    task: str = "progression"  # used when no sft.dataset is given
    dataset: str | None = None  # chat (messages), prompt/completion or text rows: JSONL, Parquet, save_to_disk
    eval_dataset: str | None = None  # held-out rows in the same form: their loss every sft.eval_every steps
    eval_fraction: float = 0.0  # without sft.eval_dataset: hold out this fraction of sft.dataset
    tokenizer: str | None = None  # default: model.path's
    max_length: int = 1024  # longer samples are truncated (sft.truncation) and counted
    truncation: str = "right"  # right (keep the start) | left (keep the end) | drop
    # A mixture of experts: its router's load-balancing loss (transformers' load_balancing_loss_func, per
    # micro-batch) x this, added to the loss. auto: the model config's router_aux_loss_coef (0 for a dense model)
    router_aux_loss_coef: float | str = "auto"
    on_bad_row: str = "error"  # error (one line naming the file and row) | skip (left out, counted)
    epochs: float = 1.0  # passes over sft.dataset (a fraction allowed)
    steps: int = 0  # > 0: this many steps instead of sft.epochs
    batch_size: int = 16  # sequences per step over all ranks
    batch_tokens: int = 0  # > 0: a step is this many real tokens over all ranks instead
    eval_every: int = 0  # evaluate every N steps (0: only at the end)
    checkpoint_every: int = 0  # 0: only the final checkpoint
    resume: str = "none"  # none | auto (from <out_dir>/checkpoints/latest) | a checkpoint directory
    export: bool = True  # a Hugging Face model (and its tokenizer with the chat template) in <out_dir>/export
    progress: bool | str = "auto"  # a progress bar on rank 0: true | false | auto (on a terminal only)
    logger: str | list[str] = "jsonl"  # also: tensorboard, wandb, mlflow, trackio -- a list, e.g. [jsonl,wandb]
    seed: int = 0  # the sample order (and the progression task's rows)
    out_dir: str = "runs/sft"  # metrics.jsonl, curves.png, checkpoints/, export/
    log_every: int = 1  # with the bar off: a line every N steps (its loss, collectives, time)
    min_len: int = 8  # the progression task's shortest sequence
    max_len: int = 32  # the progression task's longest sequence

    def validate(self) -> SFTConfig:
        choice("sft.task", self.task, SFT_TASKS)
        if self.router_aux_loss_coef != "auto":
            non_negative("sft.router_aux_loss_coef", self.router_aux_loss_coef, "auto: the model config's")
        choice("sft.truncation", self.truncation, SFT_TRUNCATION)
        choice("sft.on_bad_row", self.on_bad_row, ("error", "skip"))
        non_negative("sft.steps", self.steps, "0: sft.epochs passes")
        positive("sft.epochs", self.epochs)
        positive("sft.batch_size", self.batch_size)
        non_negative("sft.batch_tokens", self.batch_tokens, "0: sft.batch_size sequences")
        positive("sft.max_length", self.max_length)
        non_negative("sft.eval_every", self.eval_every, "0: at the end only")
        non_negative("sft.checkpoint_every", self.checkpoint_every, "0: the final checkpoint only")
        positive("sft.log_every", self.log_every)
        self.progress = progress_choice("sft.progress", self.progress)
        self.logger = logger_names("sft.logger", self.logger)
        positive("sft.min_len", self.min_len)
        if self.max_len < self.min_len:
            raise ConfigError(f"sft.max_len: must be >= sft.min_len ({self.min_len}), got {self.max_len}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"sft.eval_fraction: must be in [0, 1), got {self.eval_fraction}")
        if self.eval_fraction and self.eval_dataset:
            raise ConfigError("sft.eval_fraction and sft.eval_dataset: give one (a held-out fraction, or a file)")
        if (self.eval_fraction or self.eval_dataset) and not self.dataset:
            raise ConfigError("sft.eval_dataset / sft.eval_fraction need sft.dataset (a built-in task has its own)")
        return self


@dataclass
class TrainConfig:
    """`syncwise train`'s run: how long, where, what it writes."""

    steps: int = 60  # RL steps (each: a rollout, its rewards and the update)
    seed: int = 0  # the prompt order, the sampling seeds and the ranks' generators
    out_dir: str = "runs/grpo"  # metrics.jsonl, curves.png, phases.png, checkpoints/, export/
    # also: tensorboard, wandb, mlflow, trackio (rank 0; a resumed job continues their runs) -- a list, e.g.
    # [jsonl,wandb]; wandb and trackio read WANDB_* / TRACKIO_* (WANDB_MODE=offline), mlflow MLFLOW_TRACKING_URI
    # (unset: a SQLite store <out_dir>/mlflow.db)
    logger: str | list[str] = "jsonl"
    progress: bool | str = "auto"  # a progress bar on rank 0: true | false | auto (on a terminal only)
    log_every: int = 1  # with the bar off: a line every N steps (its reward, loss, collectives, phases)
    # each step's samples (prompt, completion, rewards, advantage, how it ended) every N steps to
    # <out_dir>/completions/completions_<step>.parquet and the loggers' tables (0: none); syncwise show reads them
    log_completions_every: int = 1
    checkpoint_every: int = 20  # 0: only the final checkpoint
    resume: str = "none"  # none | auto (from <out_dir>/checkpoints/latest) | a checkpoint directory
    export: bool = True  # write a Hugging Face model (safetensors) to <out_dir>/export at the end
    max_consecutive_skips: int = 5  # stop (with a checkpoint) after this many non-finite steps in a row
    eval_every: int = 0  # with rl.eval_dataset: evaluate every N steps (0: before the first and after the last only)

    def validate(self) -> TrainConfig:
        self.logger = logger_names("train.logger", self.logger)
        self.progress = progress_choice("train.progress", self.progress)
        non_negative("train.log_completions_every", self.log_completions_every, "0: no completions table")
        positive("train.steps", self.steps)
        non_negative("train.checkpoint_every", self.checkpoint_every)
        non_negative("train.eval_every", self.eval_every, "0: before the first step and after the last only")
        positive("train.log_every", self.log_every)
        return self
