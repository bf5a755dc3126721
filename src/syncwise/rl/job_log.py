"""What an RL job says and writes on rank 0: its first line (the task, the ranks, the rollouts, the loss, where it
resumed), its logs (metrics.jsonl, TensorBoard, the progress bar: :class:`JobLogs`) and its summary at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..config import Config, config_to_dict
from ..metrics import TensorBoardLogger, open_job_log, set_aside
from .algorithm.losses import describe_correction
from .env.tasks import PromptSource


def first_line(config: Config, world_size: int, source: PromptSource, rollout_words: str, critic_words: str,
               resumed_from: Path | None, start: int) -> str:
    """``syncwise train: GRPO on ... (N prompts, ...), fsdp2 on W rank(s), ...; <rollouts>, <the loss>``;
    ``rollout_words``: the rollout engine's (or the rollout ranks') own; ``critic_words``: PPO's critic's."""
    rl, prompts = config.rl, source.encoded
    notes = "".join([", through the chat template" if prompts.templated else "",
                     f", {prompts.truncated} cut to rl.max_prompt_length" if prompts.truncated else "",
                     f", {prompts.dropped} longer dropped" if prompts.dropped else ""])
    return (f"syncwise train: {rl.algorithm.upper()} on {rl.dataset or 'task ' + rl.task} "
            f"({len(source.rows)} prompts{notes}), {config.engine.strategy} on {world_size} rank(s), "
            f"{rl.prompts_per_rank} prompts x {rl.samples_per_prompt} samples per rank, responses up to "
            f"{rl.max_new_tokens or source.max_new_tokens} tokens, sync.mode={config.sync.mode}; "
            f"{rollout_words}, {describe_correction(config)}"
            + (f"; {critic_words}" if critic_words else "")
            + (f", resumed from {resumed_from} at step {start}" if resumed_from else ""))


def print_summary(history: list[dict[str, Any]], out_dir: Path) -> None:
    """The job's mean reward over its first and last ten steps (and its last evaluation's), and where its metrics
    and plot are."""
    evaluated = [row for row in history if "eval/reward/mean" in row]
    history = [row for row in history if "reward/mean" in row]
    window = min(10, len(history))
    first = sum(m["reward/mean"] for m in history[:window]) / window
    last = sum(m["reward/mean"] for m in history[-window:]) / window
    held_out = (f"; held out (rl.eval_dataset) {evaluated[0]['eval/reward/mean']:.3f} at step "
                f"{evaluated[0]['train/step']}, {evaluated[-1]['eval/reward/mean']:.3f} at step "
                f"{evaluated[-1]['train/step']}" if evaluated else "")
    print(
        f"mean reward: first {window} steps {first:.3f}, last {window} steps {last:.3f}{held_out}; "
        f"metrics {out_dir / 'metrics.jsonl'}, plot {out_dir / 'curves.png'}",
        flush=True,
    )


class JobLogs:
    """Where a job's steps go on rank 0: ``metrics.jsonl`` (continued where a resumed job starts), TensorBoard
    (``train.logger``), the progress bar (``train.progress``), and the steps kept for the summary (``history``)."""

    def __init__(self):
        self.history: list[dict[str, Any]] = []
        self.loggers: list[Any] = []
        self.bar = None
        self.steps, self.every = 0, 1

    def open(self, config: Config, out_dir: Path, resumed_at: int | None) -> str:
        """The job's ``config.yaml`` written and its logs opened; what the first line says of them."""
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config)))
        log, note = open_job_log(out_dir / "metrics.jsonl", resumed_at)
        note = f"; its config in {out_dir / 'config.yaml'}{note}"
        self.loggers.append(log)
        if config.train.logger == "tensorboard":
            if resumed_at is None:
                set_aside(out_dir / "tensorboard")
            self.loggers.append(TensorBoardLogger(out_dir / "tensorboard"))
        self.steps, self.every = config.train.steps, config.train.log_every
        if config.train.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=config.train.steps, initial=resumed_at or 0, desc=config.rl.algorithm,
                            dynamic_ncols=True)
        return note

    def log(self, metrics: dict[str, Any], progress: str) -> None:
        """One step's metrics; ``progress``: the bar's line for it (with the bar off, printed every
        ``train.log_every`` steps)."""
        for logger in self.loggers:
            logger.log(metrics)
        self.history.append(metrics)
        if self.bar is not None:
            self.bar.set_postfix_str(progress)
            self.bar.update(1)
        elif metrics["train/step"] % self.every == 0 or metrics["train/step"] == self.steps:
            print(f"step {metrics['train/step']}/{self.steps} {progress}", flush=True)

    def log_eval(self, row: dict[str, Any]) -> None:
        """An evaluation's row (its step and ``eval/...``): in the logs beside the steps' rows, not a step."""
        for logger in self.loggers:
            logger.log(row)
        if self.bar is not None:
            self.bar.write(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for logger in self.loggers:
            logger.close()
