"""Drawing one trainer's scored batches: its prompts of a step (deterministic: a resumed, lagged or rollout-rank
run sees the same), sampled (the trainer's ``rollout`` phase) and scored (``reward``) -- whole, or as the
partial rollouts a :class:`~syncwise.rl.rollout.partial.PartialPool` carries across steps. Every rollout mode
draws through this (:mod:`syncwise.rl.batches` on a trainer, :mod:`syncwise.rl.rollout_rank` seated as the
trainer it serves)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..config import Config
from .env.scoring import RewardLogs, RewardState, score_samples
from .env.tasks import PromptSource
from .rollout.base import StopStrings
from .rollout.front import Rollout, RolloutResult
from .rollout.partial import PartialPool
from .rollout.queue import ScoredBatch
from .rollout.turns import opened
from .stats import PhaseClock
from .transcripts import transcripts


class BatchDrawer:
    """Draws the batches of the trainer at ``seat`` (its rank, the trainers' count) with ``rollout``."""

    def __init__(self, config: Config, seat: tuple[int, int], rollout: Rollout, source: PromptSource):
        self.config, self.seat, self.rollout, self.source = config, seat, rollout, source

    def partial_pool(self) -> PartialPool:
        """An empty pool of this trainer's partial rollouts (``rl.max_staleness``)."""
        rl, source = self.config.rl, self.source
        tokenizer = self.rollout.tokenizer
        return PartialPool(rl.max_staleness, rl.prompts_per_rank, rl.samples_per_prompt, self.rollout.max_new_tokens,
                           rl.partial_chunk_tokens, tokenizer, StopStrings(rl.stop, tokenizer), self.rollout.turns,
                           lambda k: (source.rows[self.stream(k)], source.encoded.tools[self.stream(k)]))

    def draw(self, step: int, version: int, clock: PhaseClock, last: bool = True) -> ScoredBatch:
        """Step ``step``'s prompts sampled by the policy of version ``version`` and scored; ``last``: the last
        draw before the update (the engine may sleep after it)."""
        rl, source = self.config.rl, self.source
        indices = source.batch_indices(step, self.seat[0], self.seat[1], rl.prompts_per_rank)
        rows, prompt_ids = [source.rows[i] for i in indices], [source.prompt_ids[i] for i in indices]
        with clock("rollout"):
            result = self.rollout.generate(rows, prompt_ids, step, [source.encoded.tools[i] for i in indices],
                                           release=last, version=version, seat=self.seat)
        clock.move("rollout", "tools", result.tool_s)  # run between the turns
        with clock("reward"):
            rewards, reward_parts, episode_metrics, logs = self.score(result, rows, step)
        return ScoredBatch.of(step, version, result, rewards, reward_parts, episode_metrics,
                              self.transcripts(result, rows, logs), logs.metrics)

    def draw_partial(self, pool: PartialPool, step: int, clock: PhaseClock,
                     version_now: Callable[[], int] | None = None) -> ScoredBatch:
        """Partial rollouts: the pool's rounds until ``rl.prompts_per_rank`` groups have finished
        (:mod:`syncwise.rl.rollout.partial`), then scored. Colocated (``version_now`` None) every round is by
        step ``step``'s policy, refreshed before; on a rollout rank ``version_now`` gives the newest policy it
        has, asked before each round (the weights arrive between rounds)."""
        if version_now is None:
            with clock("weight_sync"):
                self.rollout.sync_weights()
        with clock("rollout"):
            result, groups = self.rollout.generate_partial(pool, step, lambda k: self.source.prompt_ids[self.stream(k)],
                                                           version_now, self.seat)
        clock.move("rollout", "tools", result.tool_s)  # opening episodes, running calls between the turns
        rows = [self.source.rows[self.stream(g.index)] for g in groups]
        with clock("reward"):
            rewards, reward_parts, episode_metrics, logs = self.score(result, rows, step)
        # colocated every round drew by this step's policy; drawing on, the newest a round drew by
        version = step if version_now is None else max((v for t in result.trajectories for v in t.versions),
                                                       default=step)
        return ScoredBatch.of(step, version, result, rewards, reward_parts, episode_metrics,
                              self.transcripts(result, rows, logs), logs.metrics)

    def transcripts(self, result: RolloutResult, rows: list[dict[str, Any]],
                    logs: RewardLogs) -> list[dict[str, Any]] | None:
        """Each sample's transcript for the completions table (``rows``: one per prompt, ``samples_per_prompt``
        samples each), with the columns TRL-signature rewards logged (``log_extra``); None where the job writes
        none (``train.log_completions_every=0``)."""
        if not self.config.train.log_completions_every:
            return None
        n = self.config.rl.samples_per_prompt
        samples = result.sample_of or range(len(result.trajectories))  # rl.agent: a sample's segments, a row each
        # an agent's segment starts from what its agent sent (its own system prompt, its tools): that, decoded
        prompts = ([self.rollout.tokenizer.decode(t.prompt, skip_special_tokens=True) for t in result.trajectories]
                   if result.agent is not None else [rows[k // n]["prompt"] for k in samples])
        out = transcripts(result.trajectories, prompts, self.rollout.end_ids)
        for column, values in logs.extra.items():
            for transcript, k in zip(out, samples, strict=True):
                transcript[column if column not in transcript else f"extra/{column}"] = values[k]
        return out

    def stream(self, k: int) -> int:
        """The row of this trainer's k-th prompt: the synchronous job's, in its order (step k // prompts_per_rank)."""
        per_step = self.config.rl.prompts_per_rank
        step, position = divmod(k, per_step)
        return self.source.batch_indices(step, self.seat[0], self.seat[1], per_step)[position]

    def score(self, result: RolloutResult, rows: list[dict[str, Any]], step: int
              ) -> tuple[torch.Tensor, dict, list, RewardLogs]:
        """Every sample's reward (the weighted total), each source's, what each episode says about itself, and
        what TRL-signature functions logged; the episodes are closed after, also when scoring fails. The
        functions see the user's own instances of ``rl.environment``'s class (TRL's ``environments``), each
        sample's prompt as its episode opened it, its completion's token ids and the step (TRL's
        ``trainer_state``)."""
        if result.agent is not None:
            return self._score_agents(result, rows, step)
        env = self.source.environment
        episodes = result.episodes or None
        n = self.config.rl.samples_per_prompt
        trl = any(reward.trl for reward in self.source.rewards)  # what only TRL's signature reads, made for it
        logs = RewardLogs()
        try:
            instances = [getattr(e, "instance", e) for e in episodes] if episodes else None
            prompts = [opened(rows[i // n]["prompt"], t.opening) if t.opening is not None else rows[i // n]["prompt"]
                       for i, t in enumerate(result.trajectories)] if trl else None
            totals, parts = score_samples(self.source.rewards, rows, result.responses, n, instances,
                                          [t.env_reward for t in result.trajectories],
                                          env.name if env is not None else "environment",
                                          [t.tokens for t in result.trajectories] if trl else None, prompts,
                                          RewardState(step, self.config.train.steps), env is not None, logs)
            episode_metrics = [episode.metrics() for episode in result.episodes]
        finally:
            result.close_episodes()
        return torch.tensor(totals), {name: torch.tensor(v) for name, v in parts.items()}, episode_metrics, logs

    def _score_agents(self, result: RolloutResult, rows: list[dict[str, Any]], step: int
                      ) -> tuple[torch.Tensor, dict, list, RewardLogs]:
        """rl.agent: each sample's reward -- its agent's, else ``rl.reward_fn``'s on its final segment, 0 where
        its agent failed -- spread over its segments' rows (``agent`` and each function's part beside)."""
        run, n, logs = result.agent, self.config.rl.samples_per_prompt, RewardLogs()
        last: dict[int, Any] = {}
        for trajectory, k in zip(result.trajectories, run.sample_of, strict=True):
            last[k] = trajectory
        samples = len(run.rewards)
        unscored = [k for k, value in enumerate(run.rewards) if value is None]
        parts: dict[str, list[float]] = {"agent": [math.nan if v is None else v for v in run.rewards]}
        totals = [0.0 if v is None else v for v in run.rewards]
        if unscored:
            if not self.source.rewards:
                raise ValueError(f"rl.agent: {self.config.rl.agent} returned None for a sample and no rl.reward_fn "
                                 "scores it; return a number, or set rl.reward_fn")
            responses = [last[k].messages or last[k].text for k in range(samples)]
            scored, by_function = score_samples(self.source.rewards, rows, responses, n,
                                                completion_ids=[last[k].tokens for k in range(samples)],
                                                state=RewardState(step, self.config.train.steps), logs=logs)
            for k in unscored:
                totals[k] = scored[k]
            parts.update({name: [v if run.rewards[k] is None else math.nan for k, v in enumerate(values)]
                          for name, values in by_function.items()})
        index = torch.tensor(run.sample_of)
        return (torch.tensor(totals)[index], {name: torch.tensor(v)[index] for name, v in parts.items()}, [],
                logs)
