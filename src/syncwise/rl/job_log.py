"""What an RL job says on rank 0: its first line (the task, the ranks, the rollouts, the loss, where it resumed) and
its summary at the end (its logs: :class:`syncwise.logs.JobLogs`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Config
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
