"""Evaluation during RL (``rl.eval_dataset``, as TRL's ``eval_dataset``): the held-out prompts sampled by the
current policy -- ``rl.samples_per_prompt`` each, as a step samples -- and scored with the job's reward functions,
before the first step, every ``train.eval_every`` steps and after the last. Each rank takes every world-th prompt;
the sums are all-reduced once, so every rank returns the same ``eval/...`` metrics."""

from __future__ import annotations

from typing import Any

import torch

from ..config import Config
from ..runtime.distributed import DistInfo, agree_fields
from .drawing import BatchDrawer
from .env.tasks import PromptSource, prompt_source
from .rollout.front import Rollout
from .stats import reward_part_sums

EVAL_SEED_STEP = 1 << 30  # the sampling seeds' step for evaluations: never a training step's


def eval_source(config: Config, tokenizer) -> PromptSource:
    """``rl.eval_dataset``'s prompts, encoded as the training prompts are, with the job's rewards, tools and
    environment (a mistake in them is one line before any rank starts: the preflight builds it too)."""
    rl = config.rl
    source = prompt_source(rl.task, rl.eval_dataset, rl.reward_fn, rl.reward_weights, rl.tools, rl.environment)
    source.encode(tokenizer, rl)
    return source


class Evaluation:
    """This rank's share of ``rl.eval_dataset``, sampled by ``rollout`` and scored as a step's batch is."""

    def __init__(self, config: Config, info: DistInfo, rollout: Rollout, tokenizer):
        self.config, self.info, self.rollout = config, info, rollout
        self.source = eval_source(config, tokenizer)
        self.drawer = BatchDrawer(config, (info.rank, info.world_size), rollout, self.source)
        self.mine = list(range(info.rank, len(self.source.rows), info.world_size))

    def due(self, done: int) -> bool:
        """Whether the policy after ``done`` steps is evaluated: before the first, every ``train.eval_every``
        steps, after the last."""
        every, last = self.config.train.eval_every, self.config.train.steps
        return done == 0 or done == last or bool(every and done % every == 0)

    @torch.no_grad()
    def run(self, version: int) -> dict[str, float]:
        """Collective: the policy of ``version`` (steps taken) on every evaluation prompt; ``eval/...``."""
        self.rollout.sync_weights()
        per_call = self.config.rl.prompts_per_rank
        sums: dict[str, float] = {"samples": 0.0, "reward": 0.0, "solved": 0.0, "response_tokens": 0.0,
                                  "clipped": 0.0}
        names = [r.name for r in self.source.rewards]
        sums |= {f"reward/{n}": 0.0 for n in names} | {f"scored_by/{n}": 0.0 for n in names}
        for start in range(0, len(self.mine), per_call):
            indices = self.mine[start:start + per_call]
            rows = [self.source.rows[i] for i in indices]
            result = self.rollout.generate(rows, [self.source.prompt_ids[i] for i in indices],
                                           EVAL_SEED_STEP + version, [self.source.encoded.tools[i] for i in indices],
                                           version=version)
            totals, parts, _, _ = self.drawer.score(result, rows, version)
            _add(sums, totals, parts, result.response_lengths, result.clipped)
        totals, _ = agree_fields(sums, {}, "the evaluation's all-reduce", self.info.device,
                                 self.config.dist.timeout_s)
        count = max(totals["samples"], 1.0)
        metrics = {"eval/reward/mean": totals["reward"] / count, "eval/solved_fraction": totals["solved"] / count,
                   "eval/response/length_mean": totals["response_tokens"] / count,
                   "eval/response/clipped_fraction": totals["clipped"] / count, "eval/samples": totals["samples"]}
        # each function's mean over the samples it scored (none: left out), a single function's too
        metrics |= {f"eval/reward/{n}": totals[f"reward/{n}"] / totals[f"scored_by/{n}"] for n in names
                    if totals[f"scored_by/{n}"]}
        return metrics


def _add(sums: dict[str, float], totals: torch.Tensor, parts: dict[str, torch.Tensor], lengths: torch.Tensor,
         clipped: torch.Tensor) -> None:
    sums["samples"] += len(totals)
    sums["reward"] += float(totals.double().sum())
    sums["solved"] += float((totals >= 1).sum())
    sums["response_tokens"] += float(lengths.sum())
    sums["clipped"] += float(clipped.sum())
    for key, value in reward_part_sums(parts).items():
        if key in sums:  # the job's functions (an episode's own part is not summed: no rank may lack a field)
            sums[key] += value


def eval_row(version: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """The log's row of an evaluation: the step (the policy's version) and its ``eval/...``."""
    return {"train/step": version, **metrics}
