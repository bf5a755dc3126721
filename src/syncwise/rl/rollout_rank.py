"""A rollout rank's job (``dist.rollout_ranks``): sample, score and hand over, never train.

Rollout rank i serves trainers r with r mod M = i, in one of two modes.

**A fixed lag** (``rl.off_policy_lag`` = k, the exact mode): for each message trainer 0 sends (see
:mod:`syncwise.rl.rollout.channel`) it loads the weights into its engine as they arrive, then draws each served
trainer's batches of the steps named, by that version -- the prompts, seeds and scoring the trainer's own
colocated queue would have used (:meth:`~syncwise.rl.drawing.BatchDrawer.draw`, seated as that trainer), so a
job with rollout ranks trains on exactly the batches the colocated job with the same lag does -- and posts them.
While the trainers train step t on the batch drawn by version t - k, it draws step t + k's by version t.

**Drawing on** (``rl.max_staleness`` = s, the fast mode, AReaL's and PipelineRL's): it keeps each served trainer's
partial rollouts (:class:`~syncwise.rl.rollout.partial.PartialPool`) and fills their batches one after another
without waiting for the trainers, in rounds of ``rl.partial_chunk_tokens``; between two rounds it takes the
newest weights the trainers have sent (the conversations in flight go on under them, each token keeping the
version that drew it), and it waits only where the bound says so: step t's batch is drawn by a policy of version
t - s at the oldest. The trainers wait for a rollout rank at most a round when they send (it takes the weights at
the round's end), and for a batch only where sampling is the slower role. Not deterministic: which round takes
which version depends on timing (the fixed lag is the mode that repeats itself).

It ends when the trainers do (they say so); a stop signal is theirs to act on at a step boundary, and they still
need the batches -- and with partial rollouts the conversations in flight -- that they checkpoint.
"""

from __future__ import annotations

import json
import time

import torch
from transformers import CONFIG_MAPPING

from ..config import Config
from ..config.rollout_modes import StalenessBound
from ..runtime.distributed import DistInfo
from ..runtime.job_store import SECRET_ENV, SignedStore, job_secret
from ..runtime.roles import JobRoles
from .drawing import BatchDrawer
from .env.tasks import end_token_ids, load_tokenizer, prompt_source
from .rollout.channel import RolloutChannel
from .rollout.front import Rollout
from .rollout.partial import PartialPool
from .stats import PhaseClock

HF_CONFIG_KEY = "rollout_ranks/hf_config"  # trainer 0 posts the plain network's config: what the engine builds


def share_network(roles: JobRoles, hf_config) -> None:
    """Trainer 0: the config of the network the weights fit (LoRA merged: the plain model's), for the rollout
    ranks to build their engine from."""
    if roles.job_rank == 0:
        SignedStore(roles.store, job_secret()).set(HF_CONFIG_KEY, hf_config.to_json_string())


def rollout_ranks_line(config: Config, trainers: int) -> str:
    """The trainers' first line's words for the rollouts."""
    last = trainers + config.dist.rollout_ranks - 1
    mode = "drawing on" if config.rl.max_staleness else f"{config.rl.off_policy_lag} step(s) ahead"
    unsigned = "" if job_secret() else f"; their messages in the store unsigned: set {SECRET_ENV} alike on every node"
    return (f"rollouts by {config.dist.rollout_ranks} rollout rank(s) of their own (ranks {trainers}-{last}, "
            f"{config.rl.rollout_engine}, {mode}; weights from trainer 0 after each step{unsigned})")


def run_rollout_rank(config: Config, info: DistInfo, roles: JobRoles) -> None:
    """Serve the trainers until they end (drawing on with ``rl.max_staleness``, else at the fixed lag)."""
    rl = config.rl
    tokenizer = load_tokenizer(config)
    source = prompt_source(rl.task, rl.dataset, rl.reward_fn, rl.reward_weights, rl.tools, rl.environment)
    source.encode(tokenizer, rl)
    fields = json.loads(SignedStore(roles.store, job_secret()).get(HF_CONFIG_KEY).decode())
    hf_config = CONFIG_MAPPING[fields["model_type"]].from_dict(fields)
    rollout = Rollout(config, tokenizer, source, hf_config, info, end_token_ids(config.model.path))
    channel = RolloutChannel(roles, info.device, config.dist.timeout_s)
    served = {r: BatchDrawer(config, (r, roles.trainers), rollout, source)
              for r in roles.served_by(roles.rollout_index)}
    if config.rollout_mode.partial:
        draw_on(config, rollout, channel, served)
        return
    number = 0
    while True:
        waited = time.perf_counter()
        draw = channel.next_draw(number)
        if draw is None:
            return
        received = time.perf_counter()
        rollout.sync_weights(channel.receive_weights(number))
        idle_s, weights_s = received - waited, time.perf_counter() - received
        for step in draw.steps:
            for trainer, drawer in served.items():
                clock = PhaseClock()
                scored = drawer.draw(step, draw.version, clock, last=step == draw.steps[-1])
                first = step == draw.steps[0]
                scored.rollout_rank_s = torch.tensor(
                    [clock.seconds["rollout"] + clock.seconds["tools"], clock.seconds["reward"],
                     idle_s if first else 0.0, weights_s if first else 0.0], dtype=torch.float64)
                channel.post(step, trainer, scored)
        number += 1


class TrainersEnded(Exception):
    """The trainers have ended (done, stopped or failed): a rollout rank drawing on stops between two rounds."""


class Inbox:
    """A rollout rank's messages from the trainers while it draws on: the newest policy, taken between two
    rounds, and what a checkpoint asks for."""

    def __init__(self, config: Config, rollout: Rollout, channel: RolloutChannel, pools: dict[int, PartialPool]):
        self.bound, self.rollout, self.channel = StalenessBound(config.rl.max_staleness), rollout, channel
        self.pools = pools  # per served trainer: its partial rollouts (what a snapshot posts)
        self.number, self.version = 0, -1  # the next message; the policy in the engine (-1: none yet)
        self.next_step: dict[int, int] = {}  # per served trainer: the step whose batch it fills next
        self.idle_s = self.weights_s = 0.0  # waiting for the trainers; receiving and loading their weights

    def newest(self) -> int:
        """Between rounds: every message already there taken; the version to sample by."""
        while self.channel.has_message(self.number):
            self._take()
        return self.version

    def wait_until_due(self, step: int) -> None:
        """Until the policy is recent enough to draw step ``step``'s batch (``rl.max_staleness`` versions
        behind at most; the first weights in any case)."""
        while self.version < self.bound.oldest(step):
            waited = time.perf_counter()
            loading_s = self._take()
            self.idle_s += time.perf_counter() - waited - loading_s

    def wait_for_end(self) -> None:
        """Every batch posted: the trainers' messages taken until they end."""
        while True:
            self._take()

    def _take(self) -> float:
        """The next message, waiting for it: weights loaded, or a snapshot posted; ``TrainersEnded`` at the end.
        Returns the seconds spent receiving and loading weights."""
        draw = self.channel.next_draw(self.number)
        if draw is None:
            raise TrainersEnded
        self.number += 1
        if draw.snapshot:
            for trainer, pool in self.pools.items():
                self.channel.post_snapshot(draw.number, trainer, {"next_step": self.next_step[trainer],
                                                                  "partial_rollouts": pool.state_dict()})
                if pool.unsaved:
                    print(f"syncwise train: rollout rank, for trainer {trainer}: {pool.unsaved_words()}", flush=True)
            return 0.0
        started = time.perf_counter()
        self.rollout.sync_weights(self.channel.receive_weights(draw.number))
        self.version, loading_s = draw.version, time.perf_counter() - started
        self.weights_s += loading_s
        return loading_s


def draw_on(config: Config, rollout: Rollout, channel: RolloutChannel, served: dict[int, BatchDrawer]) -> None:
    """Partial rollouts drawn on for the served trainers, each one's batches in step order (the one furthest
    behind first), each posted as it fills, until the trainers end."""
    pools = {trainer: drawer.partial_pool() for trainer, drawer in served.items()}
    inbox = Inbox(config, rollout, channel, pools)
    for trainer, pool in pools.items():  # where each starts: a checkpoint's conversations, or a new job
        start = channel.start_of(trainer)
        inbox.next_step[trainer] = int(start["next_step"])
        pool.load_state_dict(start["partial_rollouts"])
    try:
        while True:
            trainer = min(served, key=lambda r: (inbox.next_step[r], r))
            step = inbox.next_step[trainer]
            if step >= config.train.steps:
                inbox.wait_for_end()
            idle, weights = inbox.idle_s, inbox.weights_s
            inbox.wait_until_due(step)
            clock, filling = PhaseClock(), inbox.weights_s
            scored = served[trainer].draw_partial(pools[trainer], step, clock, inbox.newest)
            # [sampling, scoring, idle, weights]: the weights taken between rounds are no sampling
            scored.rollout_rank_s = torch.tensor([clock.seconds["rollout"] - (inbox.weights_s - filling),
                                                  clock.seconds["reward"], inbox.idle_s - idle,
                                                  inbox.weights_s - weights], dtype=torch.float64)
            channel.post(step, trainer, scored)
            inbox.next_step[trainer] = step + 1
    except TrainersEnded:
        return
    finally:
        for pool in pools.values():
            pool.close()
