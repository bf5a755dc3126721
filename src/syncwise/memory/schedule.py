"""The collectives a step should issue: each mode's switches (:mod:`syncwise.sync.modes`) played through the
FSDP units micro-batch by micro-batch, with counts and bytes.

Used by the engine's audit (counted vs expected, every step), ``syncwise plan`` and ``syncwise bench``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sync.counting import CollectiveCounts
from ..sync.modes import SyncChoice, SyncMode, as_choice, spec
from .accounting import DTYPE_BYTES, ShardedModel

# The engine's own all-reduces: a training step's (normaliser, grad norm, metrics with the memory peak and
# budget) and a forward-only pass's (normaliser, metrics).
TRAIN_ALL_REDUCES = 3
FORWARD_ALL_REDUCES = 2


@dataclass(frozen=True)
class UnitTraffic:
    """One FSDP unit: the bytes of its all-gather output, of its reduce-scatter input and (HSDP) of its
    cross-replica all-reduce buffer (the shard-group shard); ``trainable`` False when every parameter of
    the unit is frozen, so FSDP never reduce-scatters it (it is still gathered for forward and, while
    gradients flow through it to earlier units, for backward)."""

    gather_bytes: int = 0
    reduce_bytes: int = 0
    replica_bytes: int = 0
    trainable: bool = True


def unit_traffic(model: ShardedModel, hsdp: bool) -> list[UnitTraffic]:
    """Bytes each FSDP unit moves per collective, and whether it is reduce-scattered at all."""
    reduce = DTYPE_BYTES[model.reduce_dtype]
    return [
        UnitTraffic(
            gather_bytes=numel * DTYPE_BYTES[model.param_dtype],
            reduce_bytes=trainable * reduce,  # FSDP reduces only the parameters that have gradients
            replica_bytes=trainable // model.shard_size * reduce if hsdp else 0,
            trainable=trainable > 0,
        )
        for numel, trainable in zip(model.unit_padded_numels(), model.unit_padded_numels(trainable_only=True),
                                    strict=True)
    ]


def step_traffic(
    mode: str | SyncChoice,
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
    micro-batch runs with the switches the mode gives it: a forward gathers the units not already
    unsharded; after forward the others are resharded unless ``reshard_after_forward`` is off (for this
    micro-batch); backward gathers what was resharded; after backward every unit is resharded unless its
    switches keep it. A trainable unit that syncs reduce-scatters; under HSDP one that syncs fully also
    all-reduces across replicas. With a shard group of one rank (``sharded=False``) FSDP gathers and
    scatters nothing.
    """
    if num_microbatches < 1 or not units:
        raise ValueError("num_microbatches and the number of units must be >= 1")
    names = [m.value for m in SyncMode if m is not SyncMode.AUTO]
    if not isinstance(mode, SyncChoice) and mode not in names:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(names)}")
    choice = as_choice(mode)
    if spec(choice.mode).needs_hsdp and not hsdp:
        raise ValueError(f"mode {choice.mode.value!r} needs HSDP (hsdp=True)")
    totals = CollectiveCounts()
    unsharded = [False] * len(units)
    for i in range(num_microbatches):
        switches = [choice.switches(i, num_microbatches, k, unsharded_forward) for k in range(len(units))]
        for k, unit in enumerate(units):  # forward
            if not unsharded[k] and sharded:
                totals.add("all_gather", unit.gather_bytes)
            unsharded[k] = True
        for k, unit in enumerate(units):  # backward
            after_forward = switches[k].reshard_after_forward
            if k > 0 and (reshard_after_forward if after_forward is None else after_forward) and sharded:
                totals.add("all_gather", unit.gather_bytes)
            if switches[k].sync_grads and unit.trainable:
                if sharded:
                    totals.add("reduce_scatter", unit.reduce_bytes)
                if hsdp and switches[k].all_reduce_grads:
                    totals.add("all_reduce", unit.replica_bytes)
        unsharded = [s.reshard_after_backward is False for s in switches]
    return totals


def forward_traffic(
    num_microbatches: int, units: list[UnitTraffic], *, reshard_after_forward: bool = True, sharded: bool = True
) -> CollectiveCounts:
    """Collectives of a forward-only pass (log-probs, evaluation): each micro-batch gathers the units
    resharded after the previous one's forward (all but the root, which FSDP keeps); the engine reshards
    everything at the end."""
    totals = CollectiveCounts()
    if not sharded:
        return totals
    for i in range(num_microbatches):
        for k, unit in enumerate(units):
            if i == 0 or (k > 0 and reshard_after_forward):
                totals.add("all_gather", unit.gather_bytes)
    return totals


def uniform_units(num_units: int, trainable_units: int | None = None) -> list[UnitTraffic]:
    """``num_units`` units without bytes, the first ``trainable_units`` (default all) trainable."""
    if num_units < 1:
        raise ValueError("num_microbatches and num_units must be >= 1")
    trainable = num_units if trainable_units is None else trainable_units
    return [UnitTraffic(trainable=k < trainable) for k in range(num_units)]


def expected_collectives(
    mode: str,
    num_microbatches: int,
    num_units: int,
    *,
    reshard_after_forward: bool = True,
    unsharded_forward: bool = False,
    hsdp: bool = False,
    sharded: bool = True,
    engine_all_reduces: int = TRAIN_ALL_REDUCES,
    trainable_units: int | None = None,
    deferred_units: int = 0,
) -> dict[str, int]:
    """Collectives one engine step (FSDP1 or FSDP2, U units of which T trainable, N micro-batches) should
    issue; ``deferred_units`` K for ``partial`` (the first K units: which ones does not change the counts).

    In closed form: all-gathers ``(2U - 1) N`` (``U N`` without ``reshard_after_forward``) for
    ``per_microbatch``, ``deferred`` and ``replica_deferred``; for ``deferred_unsharded``
    ``U + (U - 1) N``, or ``U`` with ``unsharded_forward``. Reduce-scatters ``T N`` for
    ``per_microbatch`` and ``replica_deferred``, ``K + (T - K) N`` for ``partial``, ``T`` otherwise. HSDP
    replica all-reduces ``T N`` for ``per_microbatch``, ``K + (T - K) N`` for ``partial``, ``T`` otherwise.
    Plus ``engine_all_reduces``: the engine's own (loss normaliser, gradient norm, metrics with the memory
    peak). See :func:`step_traffic` for the schedule behind it.
    """
    known = isinstance(mode, str) and mode in {m.value for m in SyncMode}
    choice = SyncChoice(SyncMode(mode), frozenset(range(deferred_units))) if known else mode
    counts = step_traffic(
        choice, num_microbatches, uniform_units(num_units, trainable_units),
        reshard_after_forward=reshard_after_forward, unsharded_forward=unsharded_forward, hsdp=hsdp,
        sharded=sharded,
    ).counts
    return {**counts, "all_reduce": counts["all_reduce"] + engine_all_reduces}
