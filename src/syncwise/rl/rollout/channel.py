"""What passes between the trainers and the rollout ranks (``dist.rollout_ranks``): which batches to draw by
which policy version, the weights, the scored batches, and with partial rollouts what a checkpoint keeps.

A message n, from trainer 0 on the job's store: the version and the steps whose batches the rollout ranks draw
by it (none with partial rollouts: they draw on), then the weights over the weights group
(:func:`syncwise.runtime.roles.weights_group`) unit by unit as the trainers gather them -- each unit's names,
shapes and dtypes on the store, its tensors broadcast one by one, each unit dropped before the next exists, so
each side holds one unit beyond its model (the sender, for a moment, two: gloo's worker lets go of what it sent
just after the send completes) -- or "snapshot" (each rollout rank posts, for each trainer it serves, the
conversations in flight and the next step it draws: the trainers' checkpoint), or "end". A scored batch goes
back to the trainer it is for on the store (``torch.save`` of its plain tensors) and is deleted once read. Every
wait is bounded by the store's timeout (``dist.timeout_s``); a rank that died is the launcher's to report first.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...runtime.job_store import SignedStore, job_secret
from ...runtime.roles import JobRoles, weights_group
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


@dataclass
class Transfer:
    """What one weight transfer moved: bytes, its largest unit (the most either side held beyond its model)
    and seconds."""

    bytes: int = 0
    largest_unit_bytes: int = 0
    seconds: float = 0.0

    def add(self, unit: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in unit.values())
        self.bytes += size
        self.largest_unit_bytes = max(self.largest_unit_bytes, size)


class RolloutChannel:
    """One rank's end of the door between the roles."""

    def __init__(self, roles: JobRoles, device: torch.device, timeout_s: float):
        self.roles, self.device = roles, device
        self.store = SignedStore(dist.PrefixStore("rollout_ranks", roles.store), job_secret())
        self.group = weights_group(roles, device, timeout_s)
        self.sent = 0  # trainers: messages sent (by trainer 0; the others count along)
        self.last = Transfer()

    # --- the trainers' side -------------------------------------------------------------------------------------
    def send_weights(self, version: int, steps: list[int], units: Iterator[dict[str, torch.Tensor]]) -> None:
        """Every trainer: the policy of ``version`` to the rollout ranks, who then draw ``steps``. ``units`` is
        the trainers' collective gather: every trainer consumes it; trainer 0 sends each unit as it comes."""
        started, moved = time.perf_counter(), Transfer()
        n, self.sent = self.sent, self.sent + 1
        if self.group is None:
            for _ in units:
                pass
            return
        self.store.set(f"msg/{n}", json.dumps({"version": version, "steps": steps}))
        count = 0  # not enumerate(): it would hold the last unit while the next is gathered
        for unit in units:
            count += 1
            self.store.set(f"unit/{n}/{count - 1}",
                           json.dumps([[name, list(t.shape), str(t.dtype).removeprefix("torch.")]
                                       for name, t in unit.items()]))
            moved.add(unit)
            for tensor in unit.values():
                self._broadcast(tensor.detach().contiguous())
            tensor = unit = None  # dropped before the trainers gather the next: one unit beyond the model
        self.store.set(f"unit/{n}/{count}", END)
        moved.seconds = time.perf_counter() - started
        self.last = moved

    def end(self) -> None:
        """Trainer 0, once the trainers have stopped (done, stopped or failed): the rollout ranks finish."""
        if self.group is not None:
            self.store.set(f"msg/{self.sent}", END)

    def snapshot(self) -> dict[str, Any]:
        """Every trainer: what its rollout rank holds for it -- the conversations in flight and the next step it
        draws (a checkpoint's; every batch before that step is posted already)."""
        n, self.sent = self.sent, self.sent + 1
        if self.group is not None:
            self.store.set(f"msg/{n}", SNAPSHOT)
        return self._take(f"snap/{n}/{self.roles.job_rank}")

    def post_start(self, trainer: int, state: dict[str, Any]) -> None:
        """A trainer, before its first step: where its rollout rank starts (a checkpoint's snapshot, or the
        step the job starts at)."""
        self._put(f"start/{trainer}", state)

    def fetch(self, step: int, trainer: int) -> ScoredBatch:
        """Step ``step``'s scored batch for ``trainer``, waiting until its rollout rank has posted it."""
        return ScoredBatch.from_state(self._take(f"batch/{step}/{trainer}"))

    # --- the rollout ranks' side --------------------------------------------------------------------------------
    def next_draw(self, number: int) -> Draw | None:
        """Message ``number`` (None: the trainers have ended)."""
        text = self.store.get(f"msg/{number}").decode()
        if text == END:
            return None
        if text == SNAPSHOT:
            self._forget(number, -1)
            return Draw(number, -1, [], snapshot=True)
        message = json.loads(text)
        return Draw(number, int(message["version"]), [int(s) for s in message["steps"]])

    def has_message(self, number: int) -> bool:
        """Whether message ``number`` is there (without waiting for it)."""
        return self.store.check([f"msg/{number}"])

    def receive_weights(self, number: int) -> Iterator[dict[str, torch.Tensor]]:
        """Message ``number``'s weights, one unit at a time, as trainer 0 broadcasts them."""
        moved, started = Transfer(), time.perf_counter()
        for i in range(1 << 30):
            text = self.store.get(f"unit/{number}/{i}").decode()
            if text == END:
                break
            unit = {}
            for name, shape, dtype in json.loads(text):
                unit[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                self._broadcast(unit[name])
            moved.add(unit)
            yield unit
            del unit
        moved.seconds = time.perf_counter() - started
        self.last = moved
        self._forget(number, i)

    def post(self, step: int, trainer: int, scored: ScoredBatch) -> None:
        self._put(f"batch/{step}/{trainer}", scored.state())

    def post_snapshot(self, number: int, trainer: int, state: dict[str, Any]) -> None:
        self._put(f"snap/{number}/{trainer}", state)

    def start_of(self, trainer: int) -> dict[str, Any]:
        """Where ``trainer``'s batches start (:meth:`post_start`)."""
        return self._take(f"start/{trainer}")

    # --- both -----------------------------------------------------------------------------------------------------
    def _put(self, key: str, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.store.set(key, buffer.getvalue())

    def _take(self, key: str) -> dict[str, Any]:
        """The state under ``key``, waiting until it is posted; deleted once read (it has one reader)."""
        state = torch.load(io.BytesIO(self.store.get(key)), weights_only=True)
        self.store.delete_key(key)
        return state

    def _forget(self, number: int, units: int) -> None:
        """The last rollout rank to read message ``number`` deletes its keys."""
        if self.store.add(f"read/{number}", 1) == self.roles.rollout_ranks:
            for key in [f"msg/{number}", f"read/{number}"] + [f"unit/{number}/{i}" for i in range(units + 1)]:
                self.store.delete_key(key)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
