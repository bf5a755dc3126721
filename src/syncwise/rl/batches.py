"""What each RL step trains on: its prompts sampled by the rollout and scored (the trainer's ``rollout`` and
``reward`` phases), now -- the synchronous job -- or ``rl.off_policy_lag`` steps ahead, kept in this rank's
:class:`~syncwise.rl.rollout.queue.RolloutQueue`, or with ``rl.max_staleness`` the groups a partial rollout
finished (:class:`~syncwise.rl.rollout.partial.PartialPool`, carried across steps) -- here, or with rollout ranks
there, as they draw on; what is drawn ahead or in flight is in the rank's checkpoint file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import Config
from ..runtime.distributed import DistInfo
from .env.scoring import score_samples
from .env.tasks import PromptSource
from .rollout.channel import RolloutChannel
from .rollout.front import Rollout, RolloutResult
from .rollout.partial import PartialPool
from .rollout.queue import RolloutQueue, ScoredBatch
from .stats import PhaseClock


class ScoredBatches:
    """This rank's scored batches, one per step, drawn by the policy of the step or of ``rl.off_policy_lag``
    steps before it."""

    def __init__(self, config: Config, info: DistInfo, rollout: Rollout | None, source: PromptSource,
                 channel: RolloutChannel | None = None, weights: Callable[[], Iterator[dict]] | None = None):
        """``rollout``: this rank's engine (None on a trainer of a job with rollout ranks: ``channel`` brings
        its batches, drawn there by the policy ``weights`` sends)."""
        self.config, self.info, self.rollout, self.source = config, info, rollout, source
        self.channel, self.weights = channel, weights
        self.queue = RolloutQueue(config.rl.off_policy_lag, config.train.steps)
        self.requested: list[int] = []  # with rollout ranks: steps asked for, not fetched yet
        rl = config.rl
        # with rollout ranks and rl.max_staleness the partial rollouts are theirs: they draw on, this rank fetches
        self.streamed = channel is not None and rl.max_staleness > 0
        self.pool = (PartialPool(rl.max_staleness, rl.prompts_per_rank, rl.samples_per_prompt,
                                 rollout.max_new_tokens, rl.partial_chunk_tokens, rollout.tokenizer)
                     if rl.max_staleness and rollout is not None else None)

    def take(self, step: int, clock: PhaseClock) -> ScoredBatch:
        """Step ``step``'s batch: drawn now by the current policy (synchronous), or ``rl.off_policy_lag`` steps
        ago (the queue draws the batches due ahead first, all by the current policy, after one refresh; the
        engine may sleep only after the last -- a sleeping vLLM cannot sample)."""
        if self.pool is not None:  # first any batch a checkpoint of rollout ranks drawing on held for this rank
            ahead = self.queue.ready and self.queue.ready[0].step == step
            return self.queue.take(step) if ahead else self.draw_partial(step, clock)
        if self.streamed:
            return self.take_streamed(step, clock)
        if self.channel is not None:
            return self.take_remote(step, clock)
        due = self.queue.to_draw(step)
        if due:
            with clock("weight_sync"):
                self.rollout.sync_weights()
        for drawn in due:
            self.queue.add(self.draw(drawn, step, clock, last=drawn == due[-1]))
        return self.queue.take(step)

    def take_remote(self, step: int, clock: PhaseClock) -> ScoredBatch:
        """With rollout ranks: the policy of ``step`` sent to them with the steps they draw by it (those the
        colocated queue would draw now), then step ``step``'s batch, drawn there ``rl.off_policy_lag`` steps
        ago -- waiting for it only if they are behind."""
        first = max(self.queue.next_step, step, self.requested[-1] + 1 if self.requested else 0)
        due = list(range(first, min(step + self.queue.lag + 1, self.config.train.steps)))
        if due:
            with clock("weight_sync"):
                self.channel.send_weights(step, due, self.weights())
            self.requested += due
        with clock("rollout_wait"):
            self._fetch(until=step)
        return self.queue.take(step)

    def take_streamed(self, step: int, clock: PhaseClock) -> ScoredBatch:
        """With rollout ranks and partial rollouts: the policy of ``step`` sent to them (they take it between two
        rounds and draw on), then step ``step``'s batch, its groups drawn by policies at most
        ``rl.max_staleness`` versions behind -- waiting for it only if they are behind."""
        with clock("weight_sync"):
            self.channel.send_weights(step, [], self.weights())
        with clock("rollout_wait"):
            self._fetch_posted(until=step)
        return self.queue.take(step)

    def _fetch_posted(self, until: int) -> None:
        """Drawing on: the batches the rollout rank posted for this rank, up to step ``until``'s, into its queue."""
        while self.queue.next_step <= until:
            self.queue.add(self.channel.fetch(self.queue.next_step, self.info.rank))

    def _fetch(self, until: int) -> None:
        """The batches asked for, up to step ``until``'s, into this rank's queue, in order."""
        while self.requested and self.requested[0] <= until:
            self.queue.add(self.channel.fetch(self.requested.pop(0), self.info.rank))

    def draw(self, step: int, version: int, clock: PhaseClock, last: bool = True) -> ScoredBatch:
        """Step ``step``'s prompts (deterministic: a resumed or lagged run sees the same), sampled by the policy
        of version ``version`` and scored; ``last``: the last draw before the update."""
        rl, source = self.config.rl, self.source
        indices = source.batch_indices(step, self.info.rank, self.info.world_size, rl.prompts_per_rank)
        rows, prompt_ids = [source.rows[i] for i in indices], [source.prompt_ids[i] for i in indices]
        with clock("rollout"):
            result = self.rollout.generate(rows, prompt_ids, step, [source.encoded.tools[i] for i in indices],
                                           release=last, version=version, seat=(self.info.rank, self.info.world_size))
        clock.move("rollout", "tools", result.tool_s)  # run between the turns
        with clock("reward"):
            rewards, reward_parts, episode_metrics = self.score(result, rows)
        return ScoredBatch.of(step, version, result, rewards, reward_parts, episode_metrics)

    def draw_partial(self, step: int, clock: PhaseClock, version_now: Callable[[], int] | None = None
                     ) -> ScoredBatch:
        """Partial rollouts: after the refresh, the pool's rounds by this step's policy until
        ``rl.prompts_per_rank`` groups have finished (:mod:`syncwise.rl.rollout.partial`), then scored. On a
        rollout rank (``version_now``: the newest policy it has, asked before each round) no refresh here: the
        weights arrive between rounds."""
        if version_now is None:
            with clock("weight_sync"):
                self.rollout.sync_weights()
        with clock("rollout"):
            result, groups = self.rollout.generate_partial(self.pool, step,
                                                           lambda k: self.source.prompt_ids[self.stream(k)],
                                                           version_now, (self.info.rank, self.info.world_size))
        with clock("reward"):
            rewards, reward_parts, episode_metrics = self.score(result, [self.source.rows[self.stream(g.index)]
                                                                         for g in groups])
        # colocated every round drew by this step's policy; drawing on, the newest a round drew by
        version = step if version_now is None else max((v for t in result.trajectories for v in t.versions),
                                                       default=step)
        return ScoredBatch.of(step, version, result, rewards, reward_parts, episode_metrics)

    def stream(self, k: int) -> int:
        """The row of this rank's k-th prompt: the synchronous job's, in its order (step k // prompts_per_rank)."""
        per_step = self.config.rl.prompts_per_rank
        step, position = divmod(k, per_step)
        return self.source.batch_indices(step, self.info.rank, self.info.world_size, per_step)[position]

    def score(self, result: RolloutResult, rows: list[dict[str, Any]]) -> tuple[torch.Tensor, dict, list]:
        """Every sample's reward (the weighted total), each source's, and what each episode says about itself;
        the episodes are closed after, also when scoring fails."""
        env = self.source.environment
        try:
            totals, parts = score_samples(self.source.rewards, rows, result.responses,
                                          self.config.rl.samples_per_prompt, result.episodes or None,
                                          [t.env_reward for t in result.trajectories],
                                          env.name if env is not None else "environment")
            episode_metrics = [episode.metrics() for episode in result.episodes]
        finally:
            result.close_episodes()
        return torch.tensor(totals), {name: torch.tensor(v) for name, v in parts.items()}, episode_metrics

    def state_dict(self) -> dict[str, Any]:
        """What this rank's checkpoint file keeps: the batches drawn ahead (with rollout ranks, every one asked
        for, fetched first), or the partial rollouts in flight."""
        if self.pool is not None:
            return {"partial_rollouts": self.pool.state_dict(),
                    **({"rollout_queue": self.queue.state_dict()} if self.queue.ready else {})}
        if self.streamed:  # what the rollout rank holds for this rank, and every batch it posted before that
            held = self.channel.snapshot()
            self._fetch_posted(until=held["next_step"] - 1)
            return {"rollout_queue": self.queue.state_dict(), "partial_rollouts": held["partial_rollouts"]}
        self._fetch(until=self.config.train.steps)
        return {"rollout_queue": self.queue.state_dict()}

    def resume(self, rank_state: dict[str, Any] | None, start: int) -> str:
        """The batches a checkpoint's job had drawn ahead on this rank (``rank_state``), trained on as they would
        have been; where it holds none (a synchronous job's, or one saved on another number of ranks) the steps
        ahead are drawn again by the resumed policy. Partial rollouts: the groups in flight, continued; where
        the checkpoint holds none, the stream of prompts goes on from the resumed step's. Returns what the job's
        first line says."""
        if self.streamed:
            return self._start_rollout_rank(rank_state or {}, start)
        if self.pool is not None:
            if "partial_rollouts" in (rank_state or {}):
                self.pool.load_state_dict(rank_state["partial_rollouts"])
                if "rollout_queue" in rank_state:  # rollout ranks drawing on had posted these: they train first
                    self.queue.load_state_dict(rank_state["rollout_queue"])
                return ""
            self.pool.admitted = start * self.config.rl.prompts_per_rank
            return self._no_partial_rollouts(start)
        if "rollout_queue" not in (rank_state or {}):
            first, last = start + 1, min(start + self.config.rl.off_policy_lag, self.config.train.steps)
            steps = f"steps {first}-{last}" if last > first else f"step {first}"
            return (f"; the checkpoint holds no rollouts drawn ahead for {self.info.world_size} rank(s): {steps} "
                    f"drawn by the resumed policy")
        self.queue.load_state_dict(rank_state["rollout_queue"])
        return ""

    def _start_rollout_rank(self, rank_state: dict[str, Any], start: int) -> str:
        """With rollout ranks and partial rollouts: the batches a checkpoint holds for this rank into its queue,
        and the conversations it held in flight to its rollout rank, which goes on from there (from ``start``'s
        prompts where it holds none)."""
        if "rollout_queue" in rank_state:
            self.queue.load_state_dict(rank_state["rollout_queue"])
        self.queue.next_step = max(self.queue.next_step, start)
        ppr = self.config.rl.prompts_per_rank
        pool = rank_state.get("partial_rollouts") or {"admitted": self.queue.next_step * ppr, "groups": []}
        self.channel.post_start(self.info.rank, {"next_step": self.queue.next_step, "partial_rollouts": pool})
        return self._no_partial_rollouts(self.queue.next_step) if start and "partial_rollouts" not in rank_state else ""

    def _no_partial_rollouts(self, step: int) -> str:
        """The first line's words for a checkpoint without partial rollouts: the prompts go on from ``step``'s."""
        return (f"; the checkpoint holds no partial rollouts for {self.info.world_size} rank(s): the prompts go on "
                f"from step {step + 1}'s")
