"""The step audit: every collective a step issued, counted, and compared with what its mode should issue.

The commonest deferral bug is a switch that silently does nothing (applied to the wrong module, around
backward only, ignored by a wrapper). A mismatch warns once with both numbers, or raises
:class:`SyncNoOpError` with ``sync.strict``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..memory.schedule import TRAIN_ALL_REDUCES, UnitTraffic, step_traffic
from ..sync.counting import CollectiveCounts
from ..sync.modes import SyncChoice


class SyncNoOpError(RuntimeError):
    """The collectives counted in a step differ from what the sync mode should issue (``sync.strict``)."""


@dataclass
class StepAudit:
    """What a training step of an FSDP engine should issue, and the check of what it did."""

    units: list[UnitTraffic]
    reshard_after_forward: bool
    unsharded_forward: bool
    hsdp: bool
    sharded: bool
    strict: bool
    warned: bool = False

    def traffic(self, mode: SyncChoice, num_microbatches: int) -> CollectiveCounts:
        """The micro-batch loop's collectives (counts and bytes) in ``mode``."""
        return step_traffic(
            mode, num_microbatches, self.units, reshard_after_forward=self.reshard_after_forward,
            unsharded_forward=self.unsharded_forward, hsdp=self.hsdp, sharded=self.sharded,
        )

    def expected(self, mode: SyncChoice, num_microbatches: int) -> dict[str, int]:
        counts = self.traffic(mode, num_microbatches).counts
        return {**counts, "all_reduce": counts["all_reduce"] + TRAIN_ALL_REDUCES}

    def check(self, counted: dict[str, int], mode: SyncChoice, num_microbatches: int) -> dict[str, int]:
        """Compare; returns the expected counts as ``comm/expected_*_count`` metrics."""
        expected = self.expected(mode, num_microbatches)
        counted = {kind: counted.get(kind, 0) for kind in expected}  # FSDP's; sequence parallelism's apart
        if counted != expected:
            message = (
                f"sync.mode={mode.label}: counted collectives {counted} differ from the expected {expected}; "
                "the sync switches may be doing nothing (see docs/perf_tuning.md)"
            )
            if self.strict:
                raise SyncNoOpError(message)
            if not self.warned:
                self.warned = True
                warnings.warn(message, RuntimeWarning, stacklevel=4)
        return {f"comm/expected_{kind}_count": count for kind, count in expected.items()}
