"""Count the collectives of a training step, and the count each sync mode should produce.

FSDP1 and FSDP2 issue their collectives through ``torch.distributed.all_gather_single`` /
``reduce_scatter_single`` / ``all_reduce``, looked up on the module at call time, so wrapping those
functions sees every call at the cost of one Python call each. (A ``TorchDispatchMode`` over the c10d ops
also sees them, but slows every aten op: measured 1.3-1.5x per step on a tiny Qwen2.) DDP's reducer runs
its all-reduces in C++, so DDP is counted through a communication hook instead (:func:`ddp_counting_hook`).

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

# (function name on torch.distributed, kind, name of the argument that holds the full buffer)
_WRAPPED: tuple[tuple[str, str, str], ...] = (
    ("all_gather_single", "all_gather", "output_tensor"),
    ("all_gather_into_tensor", "all_gather", "output_tensor"),
    ("all_gather", "all_gather", "tensor_list"),
    ("reduce_scatter_single", "reduce_scatter", "input"),
    ("reduce_scatter_tensor", "reduce_scatter", "input"),
    ("reduce_scatter", "reduce_scatter", "input_list"),
    ("all_reduce", "all_reduce", "tensor"),
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
        self.counts[kind] += 1
        self.bytes[kind] += nbytes

    def as_metrics(self, prefix: str = "comm/") -> dict[str, int]:
        out = {}
        for kind in KINDS:
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


def ddp_counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the default all-reduce (average), counted by active counters."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buffer = bucket.buffer()
    _record_all("all_reduce", buffer.numel() * buffer.element_size())
    return allreduce_hook(state, bucket)


# DDP checks the hook's annotations as objects; this module's postponed (string) annotations fail that.
ddp_counting_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


@contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """``with count_collectives() as counts: ...`` -- the counts of everything run inside."""
    counter = CollectiveCounter()
    with counter:
        yield counter.totals


@dataclass(frozen=True)
class UnitTraffic:
    """Bytes one FSDP unit moves per collective: its all-gather output, its reduce-scatter input, and
    (HSDP) its cross-replica all-reduce buffer (the shard-group shard)."""

    gather_bytes: int = 0
    reduce_bytes: int = 0
    replica_bytes: int = 0


def step_traffic(
    mode: str,
    num_microbatches: int,
    units: list[UnitTraffic],
    *,
    reshard_after_forward: bool = True,
    unsharded_forward: bool = False,
    hsdp: bool = False,
    sharded: bool = True,
) -> CollectiveCounts:
    """Collectives (count and bytes) of one step's micro-batch loop, by playing the schedule through.

    ``units[0]`` is the root, which FSDP keeps unsharded from its forward to its backward. Each
    micro-batch runs with the switches :func:`syncwise.sync.microbatch_policy` gives it: a forward
    gathers the units not already unsharded; after forward the others are resharded unless
    ``reshard_after_forward`` is off (for this micro-batch); backward gathers what was resharded; after
    backward everything is resharded unless the policy keeps it. A micro-batch that syncs reduce-scatters
    each unit; under HSDP one that syncs fully also all-reduces it across replicas. With a shard group of
    one rank (``sharded=False``) FSDP gathers and scatters nothing.
    """
    from .sync import SyncMode, microbatch_policy

    if num_microbatches < 1 or not units:
        raise ValueError("num_microbatches and the number of units must be >= 1")
    modes = ("per_microbatch", "deferred", "deferred_unsharded", "replica_deferred")
    if mode not in modes:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(modes)}")
    if mode == "replica_deferred" and not hsdp:
        raise ValueError("mode 'replica_deferred' needs HSDP (hsdp=True)")
    totals = CollectiveCounts()
    unsharded = [False] * len(units)
    for i in range(num_microbatches):
        policy = microbatch_policy(SyncMode(mode), i, num_microbatches, unsharded_forward)
        for k, unit in enumerate(units):  # forward
            if not unsharded[k] and sharded:
                totals.add("all_gather", unit.gather_bytes)
            unsharded[k] = True
        reshard_fwd = reshard_after_forward if policy.reshard_after_forward is None else policy.reshard_after_forward
        resharded = [k > 0 and reshard_fwd for k in range(len(units))]
        for k, unit in enumerate(units):  # backward
            if resharded[k] and sharded:
                totals.add("all_gather", unit.gather_bytes)
            if policy.sync_grads:
                if sharded:
                    totals.add("reduce_scatter", unit.reduce_bytes)
                if hsdp and policy.all_reduce_grads:
                    totals.add("all_reduce", unit.replica_bytes)
        keep = policy.reshard_after_backward is False
        unsharded = [keep] * len(units)
    return totals


def expected_collectives(
    mode: str,
    num_microbatches: int,
    num_units: int,
    *,
    reshard_after_forward: bool = True,
    unsharded_forward: bool = False,
    hsdp: bool = False,
    sharded: bool = True,
    engine_all_reduces: int = 3,
) -> dict[str, int]:
    """Collectives one engine step (FSDP1 or FSDP2, U units, N micro-batches) should issue.

    In closed form: all-gathers ``(2U - 1) N`` (``U N`` without ``reshard_after_forward``) for
    ``per_microbatch``, ``deferred`` and ``replica_deferred``; for ``deferred_unsharded``
    ``U + (U - 1) N``, or ``U`` with ``unsharded_forward``. Reduce-scatters ``U N`` for
    ``per_microbatch`` and ``replica_deferred``, ``U`` otherwise. HSDP replica all-reduces ``U N`` for
    ``per_microbatch``, ``U`` otherwise. Plus ``engine_all_reduces``: the engine's own (loss normaliser,
    gradient norm, metrics with the memory peak). See :func:`step_traffic` for the schedule behind it.
    """
    if num_units < 1:
        raise ValueError("num_microbatches and num_units must be >= 1")
    counts = step_traffic(
        mode, num_microbatches, [UnitTraffic()] * num_units,
        reshard_after_forward=reshard_after_forward, unsharded_forward=unsharded_forward, hsdp=hsdp,
        sharded=sharded,
    ).counts
    return {**counts, "all_reduce": counts["all_reduce"] + engine_all_reduces}
