"""The messages between the trainers and the rollout ranks (``dist.rollout_ranks``), on the job's store (signed:
:class:`~syncwise.runtime.job_store.SignedStore`). Message n, from trainer 0: the policy version and the steps
whose batches the rollout ranks draw by it (none with partial rollouts: they draw on; the weights follow over
:mod:`~syncwise.rl.rollout.weight_transport`), or "snapshot" (each rollout rank posts, for each trainer it
serves, the conversations in flight and the next step it draws: the trainers' checkpoint), or "end". The last
rollout rank to read a message deletes it. Scored batches go back to the trainer they are for (``torch.save``
of plain tensors, loaded with ``weights_only``), as do snapshots; each trainer posts where its rollout rank
starts. What has one reader is deleted once read. Every wait is bounded by the store's timeout."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import torch

from ...runtime.job_store import SignedStore
from .queue import ScoredBatch

END = "end"
SNAPSHOT = "snapshot"


@dataclass
class Draw:
    """Message n: draw ``steps`` (each served trainer's batch of each) by the policy of ``version``."""

    number: int
    version: int
    steps: list[int]
    snapshot: bool = False  # no weights: post what a checkpoint keeps


class BatchMailbox:
    """One rank's mailbox; ``readers``: the rollout ranks (every one reads every message)."""

    def __init__(self, store: SignedStore, readers: int):
        self.store, self.readers = store, readers

    # --- trainer 0 writes the messages ------------------------------------------------------------------------
    def announce(self, number: int, version: int, steps: list[int]) -> None:
        self.store.set(f"msg/{number}", json.dumps({"version": version, "steps": steps}))

    def ask_snapshot(self, number: int) -> None:
        self.store.set(f"msg/{number}", SNAPSHOT)

    def announce_end(self, number: int) -> None:
        self.store.set(f"msg/{number}", END)

    # --- the rollout ranks read them --------------------------------------------------------------------------
    def next_draw(self, number: int) -> Draw | None:
        """Message ``number``, waiting for it (None: the trainers have ended)."""
        text = self.store.get(f"msg/{number}").decode()
        if text == END:
            return None
        if self.store.add(f"read/{number}", 1) == self.readers:  # the last reader cleans up
            self.store.delete_key(f"msg/{number}")
            self.store.delete_key(f"read/{number}")
        if text == SNAPSHOT:
            return Draw(number, -1, [], snapshot=True)
        message = json.loads(text)
        return Draw(number, int(message["version"]), [int(s) for s in message["steps"]])

    def has_message(self, number: int) -> bool:
        """Whether message ``number`` is there (without waiting for it)."""
        return self.store.check([f"msg/{number}"])

    # --- batches, snapshots and starting points: one writer, one reader ---------------------------------------
    def post(self, step: int, trainer: int, scored: ScoredBatch) -> None:
        self._put(f"batch/{step}/{trainer}", scored.state())

    def fetch(self, step: int, trainer: int) -> ScoredBatch:
        """Step ``step``'s scored batch for ``trainer``, waiting until its rollout rank has posted it."""
        return ScoredBatch.from_state(self._take(f"batch/{step}/{trainer}"))

    def post_snapshot(self, number: int, trainer: int, state: dict[str, Any]) -> None:
        self._put(f"snap/{number}/{trainer}", state)

    def take_snapshot(self, number: int, trainer: int) -> dict[str, Any]:
        return self._take(f"snap/{number}/{trainer}")

    def post_start(self, trainer: int, state: dict[str, Any]) -> None:
        self._put(f"start/{trainer}", state)

    def start_of(self, trainer: int) -> dict[str, Any]:
        return self._take(f"start/{trainer}")

    def _put(self, key: str, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.store.set(key, buffer.getvalue())

    def _take(self, key: str) -> dict[str, Any]:
        """The state under ``key``, waiting until it is posted; deleted once read (it has one reader)."""
        state = torch.load(io.BytesIO(self.store.get(key)), weights_only=True)
        self.store.delete_key(key)
        return state
