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


def expected_collectives(
    mode: str,
    num_microbatches: int,
    num_units: int,
    *,
    reshard_after_forward: bool = True,
    unsharded_forward: bool = False,
    hsdp: bool = False,
    engine_all_reduces: int = 4,
) -> dict[str, int]:
    """Collectives one engine step (FSDP1 or FSDP2, U units, N micro-batches) should issue.

    All-gathers: each micro-batch gathers every unit for forward and, for backward, every unit that was
    resharded after forward (all but the root, which FSDP keeps unsharded until backward): ``2U - 1``, or
    ``U`` when ``reshard_after_forward`` is off. ``deferred_unsharded`` keeps parameters unsharded after
    backward, so only the first forward gathers all U and each micro-batch's backward re-gathers the U - 1
    resharded after forward: ``U + (U - 1) N``; with ``unsharded_forward`` (or ``reshard_after_forward``
    off) just ``U``.

    Reduce-scatters: U per micro-batch that syncs (every one for ``per_microbatch`` and
    ``replica_deferred``, the last one otherwise). HSDP all-reduces across replicas: U per micro-batch
    that syncs fully (only the last one for every mode but ``per_microbatch``). ``engine_all_reduces`` are
    the engine's own (loss normaliser, gradient norm, metrics, agreed memory peak).
    """
    if num_microbatches < 1 or num_units < 1:
        raise ValueError("num_microbatches and num_units must be >= 1")
    n, u = num_microbatches, num_units
    modes = ("per_microbatch", "deferred", "deferred_unsharded", "replica_deferred")
    if mode not in modes:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(modes)}")
    if mode == "replica_deferred" and not hsdp:
        raise ValueError("mode 'replica_deferred' needs HSDP (hsdp=True)")
    if mode == "deferred_unsharded":
        gathers = u if (unsharded_forward or not reshard_after_forward) else u + (u - 1) * n
    else:
        gathers = (2 * u - 1 if reshard_after_forward else u) * n
    scatter_steps = n if mode in ("per_microbatch", "replica_deferred") else 1
    replica_steps = n if mode == "per_microbatch" else 1
    return {
        "all_gather": gathers,
        "reduce_scatter": u * scatter_steps,
        "all_reduce": engine_all_reduces + (u * replica_steps if hsdp else 0),
    }
