"""The door between the trainers and the rollout ranks (``dist.rollout_ranks``), in two parts each testable alone:
the messages, scored batches and snapshots (:class:`~syncwise.rl.rollout.mailbox.BatchMailbox`, on the job's
store) and the weights (:class:`~syncwise.rl.rollout.weight_transport.WeightTransport`, over the weights group).
This joins them in the order the roles keep: message n announced, then (unless a snapshot or the end) transfer n
of the weights. A rank that died is the launcher's to report first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...runtime.job_store import SignedStore, job_secret
from ...runtime.roles import JobRoles, weights_group
from .mailbox import BatchMailbox, Draw
from .queue import ScoredBatch
from .weight_transport import Transfer, WeightTransport


class RolloutChannel:
    """One rank's end of the door."""

    def __init__(self, roles: JobRoles, device: torch.device, timeout_s: float):
        self.roles = roles
        store = SignedStore(dist.PrefixStore("rollout_ranks", roles.store), job_secret())
        self.mailbox = BatchMailbox(store, roles.rollout_ranks)
        self.weights = WeightTransport(store, weights_group(roles, device, timeout_s), device, roles.rollout_ranks)
        self.sent = 0  # trainers: messages sent (by trainer 0; the others count along)

    @property
    def last(self) -> Transfer:
        """The latest weight transfer this rank took part in."""
        return self.weights.last

    @property
    def writes(self) -> bool:
        """Whether this rank writes the messages (trainer 0)."""
        return self.weights.group is not None and not self.roles.is_rollout

    # --- the trainers' side -------------------------------------------------------------------------------------
    def send_weights(self, version: int, steps: list[int], units: Iterator[dict[str, torch.Tensor]]) -> None:
        """Every trainer: the policy of ``version`` to the rollout ranks, who then draw ``steps``. ``units`` is
        the trainers' collective gather: every trainer consumes it; trainer 0 sends each unit as it comes."""
        n, self.sent = self.sent, self.sent + 1
        if self.writes:
            self.mailbox.announce(n, version, steps)
        self.weights.send(n, units)

    def end(self) -> None:
        """Trainer 0, once the trainers have stopped (done, stopped or failed): the rollout ranks finish."""
        if self.writes:
            self.mailbox.announce_end(self.sent)

    def snapshot(self) -> dict[str, Any]:
        """Every trainer: what its rollout rank holds for it -- the conversations in flight and the next step it
        draws (a checkpoint's; every batch before that step is posted already)."""
        n, self.sent = self.sent, self.sent + 1
        if self.writes:
            self.mailbox.ask_snapshot(n)
        return self.mailbox.take_snapshot(n, self.roles.job_rank)

    def post_start(self, trainer: int, state: dict[str, Any]) -> None:
        """A trainer, before its first step: where its rollout rank starts (a checkpoint's snapshot, or the
        step the job starts at)."""
        self.mailbox.post_start(trainer, state)

    def fetch(self, step: int, trainer: int) -> ScoredBatch:
        return self.mailbox.fetch(step, trainer)

    # --- the rollout ranks' side --------------------------------------------------------------------------------
    def next_draw(self, number: int) -> Draw | None:
        """Message ``number`` (None: the trainers have ended)."""
        return self.mailbox.next_draw(number)

    def has_message(self, number: int) -> bool:
        return self.mailbox.has_message(number)

    def receive_weights(self, number: int) -> Iterator[dict[str, torch.Tensor]]:
        """Message ``number``'s weights, one unit at a time, as trainer 0 broadcasts them."""
        return self.weights.receive(number)

    def post(self, step: int, trainer: int, scored: ScoredBatch) -> None:
        self.mailbox.post(step, trainer, scored)

    def post_snapshot(self, number: int, trainer: int, state: dict[str, Any]) -> None:
        self.mailbox.post_snapshot(number, trainer, state)

    def start_of(self, trainer: int) -> dict[str, Any]:
        """Where ``trainer``'s batches start (:meth:`post_start`)."""
        return self.mailbox.start_of(trainer)
