"""What each RL step trains on: one producer of scored batches per rollout mode (the table,
:mod:`syncwise.config.rollout_modes`), behind one interface -- :meth:`~BatchProducer.take` a step's batch,
:meth:`~BatchProducer.state_dict` what the rank's checkpoint file keeps, :meth:`~BatchProducer.start` from a
checkpoint's (or a new job's) state. Drawing itself is :class:`~syncwise.rl.drawing.BatchDrawer`'s.

- :class:`DrawNow` (synchronous): the step's prompts, sampled by its policy after the refresh.
- :class:`DrawAhead` (``rl.off_policy_lag`` = k): batches drawn k steps ahead, kept in this rank's
  :class:`~syncwise.rl.rollout.queue.RolloutQueue`.
- :class:`PartialRollouts` (``rl.max_staleness``): a :class:`~syncwise.rl.rollout.partial.PartialPool` carried
  across steps.
- :class:`FetchAhead` (rollout ranks, a lag): the policy sent with the steps they draw by it, the batches fetched.
- :class:`FetchDrawnOn` (rollout ranks, partial rollouts): the policy sent; they draw on, the batches fetched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..config import Config
from ..runtime.distributed import DistInfo
from .drawing import BatchDrawer
from .rollout.channel import RolloutChannel
from .rollout.queue import RolloutQueue, ScoredBatch
from .stats import PhaseClock


class BatchProducer:
    """This rank's scored batches, one per step, in one rollout mode."""

    def take(self, step: int, clock: PhaseClock) -> ScoredBatch:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any] | None:
        """What this rank's checkpoint file keeps of the mode (None: nothing)."""
        return None

    def start(self, rank_state: dict[str, Any] | None, start: int) -> str:
        """Before the first step: ``start`` 0 for a new job, else a checkpoint's step and what its rank file held
        of the mode (None: nothing -- a synchronous job's checkpoint, or one saved on another number of ranks).
        Returns what the job's first line says."""
        return ""

    def close(self) -> None:
        """The job's end (done, stopped or failed): what the mode holds open let go (episodes in flight)."""


class DrawNow(BatchProducer):
    """Synchronous: the step's batch drawn by its own policy, after the refresh."""

    def __init__(self, drawer: BatchDrawer):
        self.drawer = drawer

    def take(self, step: int, clock: PhaseClock) -> ScoredBatch:
        with clock("weight_sync"):
            self.drawer.rollout.sync_weights()
        return self.drawer.draw(step, step, clock)


class DrawAhead(BatchProducer):
    """A fixed lag k: step t trains on the batch the policy of step t - k drew (the first k steps, the initial
    policy's); the batches drawn ahead are in the checkpoint."""

    def __init__(self, drawer: BatchDrawer, lag: int, steps: int):
        self.drawer, self.queue = drawer, RolloutQueue(lag, steps)

    def take(self, step: int, clock: PhaseClock) -> ScoredBatch:
        """The batches due ahead drawn first, all by the current policy after one refresh (the engine may sleep
        only after the last: a sleeping vLLM cannot sample), then step ``step``'s taken."""
        due = self.queue.to_draw(step)
        if due:
            with clock("weight_sync"):
                self.drawer.rollout.sync_weights()
        for drawn in due:
            self.queue.add(self.drawer.draw(drawn, step, clock, last=drawn == due[-1]))
        return self.queue.take(step)

    def state_dict(self) -> dict[str, Any]:
        return {"rollout_queue": self.queue.state_dict()}

    def start(self, rank_state: dict[str, Any] | None, start: int) -> str:
        return _restore_queue(self.queue, rank_state, start, self.drawer.seat[1])


class PartialRollouts(BatchProducer):
    """Partial rollouts on this rank: each step the pool's rounds by the step's policy; the groups unfinished
    carried, with the pool, into the next step and the checkpoint."""

    def __init__(self, drawer: BatchDrawer, steps: int):
        self.drawer, self.pool = drawer, drawer.partial_pool()
        self.queue = RolloutQueue(0, steps)  # what a checkpoint of rollout ranks drawing on had posted for this rank

    def take(self, step: int, clock: PhaseClock) -> ScoredBatch:
        if self.queue.ready and self.queue.ready[0].step == step:
            return self.queue.take(step)
        return self.drawer.draw_partial(self.pool, step, clock)

    def state_dict(self) -> dict[str, Any]:
        state = {"partial_rollouts": self.pool.state_dict(),
                 **({"rollout_queue": self.queue.state_dict()} if self.queue.ready else {})}
        if self.pool.unsaved:
            print(f"syncwise train: rank {self.drawer.seat[0]}: {self.pool.unsaved_words()}", flush=True)
        return state

    def close(self) -> None:
        self.pool.close()

    def start(self, rank_state: dict[str, Any] | None, start: int) -> str:
        """The groups in flight, continued; where the checkpoint holds none, the stream of prompts goes on from
        the resumed step's."""
        if "partial_rollouts" in (rank_state or {}):
            self.pool.load_state_dict(rank_state["partial_rollouts"])
            if "rollout_queue" in rank_state:  # rollout ranks drawing on had posted these: they train first
                self.queue.load_state_dict(rank_state["rollout_queue"])
            return ""
        self.pool.admitted = start * self.drawer.config.rl.prompts_per_rank
        return _no_partial_rollouts(start, self.drawer.seat[1]) if start else ""


class FetchAhead(BatchProducer):
    """Rollout ranks at a fixed lag: they draw what :class:`DrawAhead` would, by the policy this rank's trainers
    send; the batches asked for and not yet trained are fetched into the checkpoint."""

    def __init__(self, config: Config, info: DistInfo, channel: RolloutChannel,
                 weights: Callable[[], Iterator[dict]]):
        self.config, self.info, self.channel, self.weights = config, info, channel, weights
        self.queue = RolloutQueue(config.rl.off_policy_lag, config.train.steps)
        self.requested: list[int] = []  # steps asked for, not fetched yet

    def take(self, step: int, clock: PhaseClock) -> ScoredBatch:
        """The policy of ``step`` sent with the steps they draw by it (those the colocated queue would draw now),
        then step ``step``'s batch, drawn there ``rl.off_policy_lag`` steps ago -- waiting only if they are
        behind."""
        first = max(self.queue.next_step, step, self.requested[-1] + 1 if self.requested else 0)
        due = list(range(first, min(step + self.queue.lag + 1, self.config.train.steps)))
        if due:
            with clock("weight_sync"):
                self.channel.send_weights(step, due, self.weights())
            self.requested += due
        with clock("rollout_wait"):
            self._fetch(until=step)
        return self.queue.take(step)

    def _fetch(self, until: int) -> None:
        while self.requested and self.requested[0] <= until:
            self.queue.add(self.channel.fetch(self.requested.pop(0), self.info.rank))

    def state_dict(self) -> dict[str, Any]:
        self._fetch(until=self.config.train.steps)
        return {"rollout_queue": self.queue.state_dict()}

    def start(self, rank_state: dict[str, Any] | None, start: int) -> str:
        return _restore_queue(self.queue, rank_state, start, self.info.world_size)


class FetchDrawnOn(BatchProducer):
    """Rollout ranks drawing partial rollouts on: each step the policy sent (they take it between two rounds),
    then the step's batch, its groups drawn by policies at most ``rl.max_staleness`` versions behind."""

    def __init__(self, config: Config, info: DistInfo, channel: RolloutChannel,
                 weights: Callable[[], Iterator[dict]]):
        self.config, self.info, self.channel, self.weights = config, info, channel, weights
        self.queue = RolloutQueue(0, config.train.steps)

    def take(self, step: int, clock: PhaseClock) -> ScoredBatch:
        with clock("weight_sync"):
            self.channel.send_weights(step, [], self.weights())
        with clock("rollout_wait"):
            self._fetch(until=step)
        return self.queue.take(step)

    def _fetch(self, until: int) -> None:
        """The batches the rollout rank posted for this rank, up to step ``until``'s, into its queue."""
        while self.queue.next_step <= until:
            self.queue.add(self.channel.fetch(self.queue.next_step, self.info.rank))

    def state_dict(self) -> dict[str, Any]:
        """What the rollout rank holds for this rank, and every batch it posted before that."""
        held = self.channel.snapshot()
        self._fetch(until=held["next_step"] - 1)
        return {"rollout_queue": self.queue.state_dict(), "partial_rollouts": held["partial_rollouts"]}

    def start(self, rank_state: dict[str, Any] | None, start: int) -> str:
        """The batches a checkpoint holds for this rank into its queue, and the conversations it held in flight
        to the rollout rank, which goes on from there (from ``start``'s prompts where it holds none) -- told in
        a new job too."""
        rank_state = rank_state or {}
        if "rollout_queue" in rank_state:
            self.queue.load_state_dict(rank_state["rollout_queue"])
        self.queue.next_step = max(self.queue.next_step, start)
        pool = rank_state.get("partial_rollouts") or {
            "admitted": self.queue.next_step * self.config.rl.prompts_per_rank, "groups": []}
        self.channel.post_start(self.info.rank, {"next_step": self.queue.next_step, "partial_rollouts": pool})
        held = "partial_rollouts" in rank_state
        return _no_partial_rollouts(self.queue.next_step, self.info.world_size) if start and not held else ""


def batch_producer(config: Config, info: DistInfo, drawer: BatchDrawer | None, channel: RolloutChannel | None,
                   weights: Callable[[], Iterator[dict]]) -> BatchProducer:
    """The producer of ``config``'s rollout mode: on this rank through ``drawer``, or from the rollout ranks over
    ``channel``, sent the policy ``weights`` gathers."""
    mode = config.rollout_mode
    if mode.on_rollout_ranks:
        return (FetchDrawnOn if mode.partial else FetchAhead)(config, info, channel, weights)
    if mode.partial:
        return PartialRollouts(drawer, config.train.steps)
    return DrawAhead(drawer, config.rl.off_policy_lag, config.train.steps) if mode.off_policy else DrawNow(drawer)


def _restore_queue(queue: RolloutQueue, rank_state: dict[str, Any] | None, start: int, ranks: int) -> str:
    """A lag's batches drawn ahead, from the checkpoint; where it holds none, the steps ahead are drawn again by
    the resumed policy (and the first line says so)."""
    if "rollout_queue" in (rank_state or {}):
        queue.load_state_dict(rank_state["rollout_queue"])
        return ""
    if not start:
        return ""
    first, last = start + 1, min(start + queue.lag, queue.steps)
    steps = f"steps {first}-{last}" if last > first else f"step {first}"
    return f"; the checkpoint holds no rollouts drawn ahead for {ranks} rank(s): {steps} drawn by the resumed policy"


def _no_partial_rollouts(step: int, ranks: int) -> str:
    """The first line's words for a checkpoint without partial rollouts: the prompts go on from ``step``'s."""
    return f"; the checkpoint holds no partial rollouts for {ranks} rank(s): the prompts go on from step {step + 1}'s"
