"""Count the collectives of a training step, one way for every strategy.

FSDP1 and FSDP2 issue their collectives through ``torch.distributed.all_gather_single`` /
``reduce_scatter_single`` / ``all_reduce`` (before torch 2.13: ``all_gather_into_tensor`` /
``reduce_scatter_tensor``), looked up on the module at call time, so wrapping those
functions sees every call at the cost of one Python call each. (A ``TorchDispatchMode`` over the c10d ops
also sees them, but slows every aten op: measured 1.3-1.5x per step on a tiny Qwen2.) DDP's reducer would
run its all-reduces in C++, out of sight; the wrapped DDP model uses the Python ``allreduce_hook``, whose
``dist.all_reduce`` is counted here like any other. What a step *should* issue is
:mod:`syncwise.memory.schedule`'s business.

Bytes are those of the full (unsharded) buffer of each collective: the gathered output of an all-gather,
the input of a reduce-scatter, the tensor of an all-reduce.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# sequence parallelism's exchanges (syncwise.data.ulysses): counted apart, present only where a step made any
ALL_TO_ALL = "all_to_all"

# The c10d functions FSDP2 sends its all-gathers and reduce-scatters through: ``*_single`` from torch 2.13,
# ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` before (torch 2.11 has no ``*_single``).
FSDP2_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
FSDP2_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

# (function name on torch.distributed, kind, name of the argument that holds the full buffer)
_WRAPPED: tuple[tuple[str, str, str], ...] = (
    ("all_gather_single", "all_gather", "output_tensor"),
    ("all_gather_into_tensor", "all_gather", "output_tensor"),
    ("all_gather", "all_gather", "tensor_list"),
    ("reduce_scatter_single", "reduce_scatter", "input"),
    ("reduce_scatter_tensor", "reduce_scatter", "input"),
    ("reduce_scatter", "reduce_scatter", "input_list"),
    ("all_reduce", "all_reduce", "tensor"),
    ("all_to_all_single", ALL_TO_ALL, "output"),
)


def _nbytes(buffer: Any) -> int:
    if isinstance(buffer, torch.Tensor):
        return buffer.numel() * buffer.element_size()
    if isinstance(buffer, (list, tuple)):
        return sum(_nbytes(t) for t in buffer)
    return 0


@dataclass
class CollectiveCounts:
    """Number and bytes of each kind of collective."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, kind: str, nbytes: int) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def as_metrics(self, prefix: str = "comm/") -> dict[str, int]:
        out = {}
        for kind in self.counts:
            out[f"{prefix}{kind}_count"] = self.counts[kind]
            out[f"{prefix}{kind}_bytes"] = self.bytes[kind]
        return out


class CollectiveCounter:
    """Counts collectives while active. Use as a context manager; nesting counts each call once.

    Patches the functions on ``torch.distributed`` for the duration and restores them on exit.
    """

    _lock = threading.Lock()
    _active: list[CollectiveCounter] = []
    _originals: dict[str, Callable[..., Any]] = {}
    _depth = threading.local()

    def __init__(self) -> None:
        self.totals = CollectiveCounts()

    def record(self, kind: str, nbytes: int) -> None:
        self.totals.add(kind, nbytes)

    def __enter__(self) -> CollectiveCounter:
        with self._lock:
            if not CollectiveCounter._active:
                _install()
            CollectiveCounter._active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            CollectiveCounter._active.remove(self)
            if not CollectiveCounter._active:
                _uninstall()


def _record_all(kind: str, nbytes: int) -> None:
    for counter in CollectiveCounter._active:
        counter.record(kind, nbytes)


def _make_wrapper(name: str, kind: str, buffer_arg: str, original: Callable[..., Any]):
    depth = CollectiveCounter._depth
    signature = inspect.signature(original)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Deprecated aliases call their replacement through the module: count the outermost call only.
        level = getattr(depth, "value", 0)
        if level == 0:
            buffer = signature.bind_partial(*args, **kwargs).arguments.get(buffer_arg)
            _record_all(kind, _nbytes(buffer))
        depth.value = level + 1
        try:
            return original(*args, **kwargs)
        finally:
            depth.value = level

    wrapper.__wrapped__ = original
    wrapper.__name__ = name
    return wrapper


def _install() -> None:
    for name, kind, buffer_arg in _WRAPPED:
        original = getattr(dist, name, None)
        if original is None:
            continue
        CollectiveCounter._originals[name] = original
        setattr(dist, name, _make_wrapper(name, kind, buffer_arg, original))


def _uninstall() -> None:
    for name, original in CollectiveCounter._originals.items():
        setattr(dist, name, original)
    CollectiveCounter._originals.clear()


@contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """``with count_collectives() as counts: ...`` -- the counts of everything run inside."""
    counter = CollectiveCounter()
    with counter:
        yield counter.totals
