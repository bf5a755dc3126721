"""A policy's weights from trainer 0 to the rollout ranks (``dist.rollout_ranks``), unit by unit as the trainers
gather them: each unit's names, shapes and dtypes on the job's store (signed), its tensors broadcast one by one
over the weights group (:func:`syncwise.runtime.roles.weights_group`: trainer 0 and the rollout ranks), each unit
dropped before the next exists -- so each side holds one unit beyond its model (the sender, for a moment, two:
gloo's worker lets go of what it sent just after the send completes). The last receiver of a transfer deletes its
keys. Every wait is bounded by the store's timeout (``dist.timeout_s``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...runtime.job_store import SignedStore

END = "end"


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


class WeightTransport:
    """One rank's end of the weights' way: ``group`` None on the trainers other than trainer 0 (they only take
    part in the gather); ``receivers``: the rollout ranks."""

    def __init__(self, store: SignedStore, group: dist.ProcessGroup | None, device: torch.device, receivers: int):
        self.store, self.group, self.device, self.receivers = store, group, device, receivers
        self.last = Transfer()  # the latest transfer, sent or received

    def send(self, number: int, units: Iterator[dict[str, torch.Tensor]]) -> Transfer:
        """Transfer ``number``: every trainer consumes ``units`` (the trainers' collective gather); trainer 0 sends
        each unit as it comes."""
        started, moved = time.perf_counter(), Transfer()
        if self.group is None:
            for _ in units:
                pass
            return moved
        count = 0  # not enumerate(): it would hold the last unit while the next is gathered
        for unit in units:
            count += 1
            self.store.set(f"unit/{number}/{count - 1}",
                           json.dumps([[name, list(t.shape), str(t.dtype).removeprefix("torch.")]
                                       for name, t in unit.items()]))
            moved.add(unit)
            for tensor in unit.values():
                self._broadcast(tensor.detach().contiguous())
            tensor = unit = None  # dropped before the trainers gather the next: one unit beyond the model
        self.store.set(f"unit/{number}/{count}", END)
        moved.seconds = time.perf_counter() - started
        self.last = moved
        return moved

    def receive(self, number: int) -> Iterator[dict[str, torch.Tensor]]:
        """Transfer ``number``, one unit at a time, as trainer 0 broadcasts them."""
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
        if self.store.add(f"units_read/{number}", 1) == self.receivers:  # the last receiver cleans up
            for key in [f"units_read/{number}"] + [f"unit/{number}/{k}" for k in range(i + 1)]:
                self.store.delete_key(key)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
