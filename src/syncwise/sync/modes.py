"""THE table of sync modes: what each mode is, in one place.

A sync mode says which FSDP switches each unit runs each micro-batch with. Everything else follows
from those switches and is derived, never restated:

- :mod:`syncwise.sync.switches` applies them (and restores the previous ones),
- :mod:`syncwise.memory.schedule` plays them through to count the collectives a step issues,
- :mod:`syncwise.memory.accounting` reads from them what a unit holds between micro-batches,
- config validation, ``auto``, ``syncwise plan`` and ``syncwise bench`` read the entries below.

Adding a mode is one :class:`ModeSpec` entry (its switches, the strategies that run it, where it sits in
the speed order) plus tests; see docs/design.md.

This module imports nothing heavy (no torch): the config validates against it before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SyncMode(str, Enum):
    """When gradients are communicated across the micro-batches of one optimizer step."""

    PER_MICROBATCH = "per_microbatch"
    DEFERRED = "deferred"
    DEFERRED_UNSHARDED = "deferred_unsharded"
    REPLICA_DEFERRED = "replica_deferred"
    PARTIAL = "partial"
    AUTO = "auto"  # not a mode of its own: the fastest entry whose predicted peak fits the budget


@dataclass(frozen=True)
class Switches:
    """The FSDP switches one unit runs one micro-batch with (None: leave as wrapped)."""

    sync_grads: bool = True  # reduce-scatter (and HSDP all-reduce) in this backward
    all_reduce_grads: bool = True  # HSDP cross-replica all-reduce in this backward
    reshard_after_backward: bool | None = None
    reshard_after_forward: bool | None = None


SYNC = Switches()  # as wrapped: the unit communicates its gradient in this micro-batch


@dataclass(frozen=True)
class ModeSpec:
    """One sync mode. ``early`` are the switches of every micro-batch but the last, ``last`` those of the
    last; each is given ``unsharded_forward`` (``sync.unsharded_forward``)."""

    mode: SyncMode
    speed: int  # 0 = fastest
    summary: str
    strategies: tuple[str, ...]  # wrapping strategies that can run it
    needs_hsdp: bool
    requirement: str  # what a strategy that cannot run it lacks (for the error message)
    early: Switches | tuple[Switches, Switches]  # (unsharded_forward off, on) when they differ
    last: Switches | tuple[Switches, Switches] = SYNC
    per_unit: bool = False  # the switches apply to a chosen set of units (sync.deferred_units); the rest sync

    def switches(
        self, index: int, num_microbatches: int, unsharded_forward: bool = False, chosen: bool = True
    ) -> Switches:
        """The switches for micro-batch ``index`` (0-based) of ``num_microbatches``, for a unit that is
        (``chosen``) or is not in the mode's set of units; modes that are not per unit apply to all."""
        if self.per_unit and not chosen:
            return SYNC
        picked = self.last if index == num_microbatches - 1 else self.early
        return picked[int(unsharded_forward)] if isinstance(picked, tuple) else picked

    def runs_on(self, strategy: str, hsdp: bool) -> bool:
        return strategy in self.strategies and (hsdp or not self.needs_hsdp)


_NO_GRAD_SYNC = Switches(sync_grads=False, all_reduce_grads=False)
_KEEP_GATHERED = Switches(sync_grads=False, all_reduce_grads=False, reshard_after_backward=False)

# In the order the docs present them; ``speed`` ranks them fastest first (the order auto tries, and
# steps down in).
MODES: dict[SyncMode, ModeSpec] = {
    spec.mode: spec
    for spec in (
        ModeSpec(
            SyncMode.PER_MICROBATCH, speed=4,
            summary="reduce-scatter after every micro-batch: least memory",
            strategies=("fsdp2", "fsdp1", "ddp", "none"), needs_hsdp=False, requirement="",
            early=SYNC,
        ),
        ModeSpec(
            SyncMode.DEFERRED, speed=1,
            summary="accumulate the unsharded gradient locally; one reduce-scatter per unit on the last micro-batch",
            strategies=("fsdp2", "fsdp1", "ddp", "none"), needs_hsdp=False, requirement="",
            early=_NO_GRAD_SYNC,
        ),
        ModeSpec(
            SyncMode.DEFERRED_UNSHARDED, speed=0,
            summary="as deferred, and parameters stay gathered between micro-batches (one all-gather per unit)",
            strategies=("fsdp2",), needs_hsdp=False,
            requirement="it needs engine.strategy=fsdp2 (FSDP2's set_reshard_after_backward)",
            # The last micro-batch syncs and reshards after backward but, with unsharded_forward, still
            # skips the gather that resharding after its forward would force on its backward.
            early=(_KEEP_GATHERED, Switches(False, False, reshard_after_backward=False, reshard_after_forward=False)),
            last=(SYNC, Switches(reshard_after_forward=False)),
        ),
        ModeSpec(
            SyncMode.PARTIAL, speed=2,
            summary="deferred for the units in sync.deferred_units (they hold their unsharded gradient), "
            "per micro-batch for the rest: the memory of deferral where it fits",
            strategies=("fsdp2",), needs_hsdp=False,
            requirement="it needs engine.strategy=fsdp2 (FSDP2's per-unit set_requires_gradient_sync)",
            early=_NO_GRAD_SYNC, per_unit=True,
        ),
        ModeSpec(
            SyncMode.REPLICA_DEFERRED, speed=3,
            summary="HSDP: reduce-scatter every micro-batch, all-reduce across replicas once",
            strategies=("fsdp2",), needs_hsdp=True,
            requirement="it defers only the cross-replica all-reduce, which needs FSDP2 with HSDP "
            "(engine.strategy=fsdp2, engine.hsdp_replicas > 1)",
            early=Switches(all_reduce_grads=False),
        ),
    )
}
SPEED_ORDER: tuple[SyncMode, ...] = tuple(sorted(MODES, key=lambda m: MODES[m].speed))
MODE_NAMES: tuple[str, ...] = tuple(m.value for m in MODES) + (SyncMode.AUTO.value,)


@dataclass(frozen=True)
class SyncChoice:
    """A concrete mode and, for a per-unit mode (``partial``), the units it applies to: indices into the
    engine's FSDP units, root first. What the engine runs, auto chooses and the estimators price."""

    mode: SyncMode
    units: frozenset[int] = frozenset()

    @property
    def label(self) -> str:
        return f"{self.mode.value}({len(self.units)})" if spec(self.mode).per_unit else self.mode.value

    def switches(self, index: int, num_microbatches: int, unit: int, unsharded_forward: bool = False) -> Switches:
        return spec(self.mode).switches(index, num_microbatches, unsharded_forward, chosen=unit in self.units)


def as_choice(mode: SyncMode | str | SyncChoice) -> SyncChoice:
    return mode if isinstance(mode, SyncChoice) else SyncChoice(SyncMode(mode))


def spec(mode: SyncMode | str) -> ModeSpec:
    mode = SyncMode(mode)
    if mode is SyncMode.AUTO:
        raise ValueError("'auto' is not a concrete mode: resolve it first")
    return MODES[mode]


def supported_modes(strategy: str, hsdp: bool) -> tuple[SyncMode, ...]:
    """Concrete modes a wrapping strategy can run, fastest first."""
    return tuple(m for m in SPEED_ORDER if MODES[m].runs_on(strategy, hsdp))


def unsupported_reason(mode: SyncMode | str, strategy: str, hsdp: bool) -> str | None:
    """Why ``strategy`` cannot run ``mode`` (a message naming the keys), or None when it can."""
    mode = SyncMode(mode)
    if mode is SyncMode.AUTO or MODES[mode].runs_on(strategy, hsdp):
        return None
    allowed = ", ".join(m.value for m, s in MODES.items() if s.runs_on(strategy, hsdp))
    return (
        f"sync.mode={mode.value!r} is not available with engine.strategy={strategy!r}"
        f"{' and HSDP' if hsdp else ''}: {MODES[mode].requirement}; choose one of {allowed} or auto"
    )


def check_mode(mode: SyncMode | str, strategy: str, hsdp: bool) -> None:
    """Raise a clear error when ``strategy`` cannot run ``mode``."""
    reason = unsupported_reason(mode, strategy, hsdp)
    if reason:
        raise ValueError(reason)
