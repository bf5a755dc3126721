"""``sync.mode=auto``: the fastest sync mode whose predicted peak memory fits the budget.

The first step runs in the safe mode (``per_microbatch``) and measures its peak. Every mode's predicted
peak is that measured base plus the bytes the mode holds beyond ``per_microbatch`` (the estimator in
:mod:`syncwise.memory`); the fastest that fits is chosen, and the decision is logged with its numbers.
Later steps keep measuring (CUDA: the allocator's peak, every step; CPU: a full tracked step every
``sync.peak_every`` steps, else the base plus the sync bytes measured from the tensors); if a
peak exceeds the budget, auto steps down to the next cheaper mode that fits -- never back up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .memory import ShardedModel, format_bytes
from .modes import SPEED_ORDER, SyncMode

log = logging.getLogger("syncwise.auto")


@dataclass
class AutoSync:
    estimator: ShardedModel
    candidates: tuple[SyncMode, ...]  # concrete modes this strategy supports
    budget: int
    base_peak: int | None = None  # measured peak of per_microbatch (activations, params, optimizer, ...)
    ceiling: int = 0  # index into the candidates (speed order) auto may not go above after stepping down
    mode: SyncMode = SyncMode.PER_MICROBATCH
    decisions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.candidates = tuple(m for m in SPEED_ORDER if m in self.candidates)

    @property
    def decided(self) -> bool:
        return self.base_peak is not None

    def predicted_peak(self, mode: SyncMode, num_microbatches: int) -> int:
        if self.base_peak is None:
            raise RuntimeError("auto sync: no measured base peak yet")
        return self.base_peak + self.estimator.extra_bytes(mode, num_microbatches)

    def decide(
        self, measured_peak: int, measured_mode: SyncMode, num_microbatches: int, source: str = "measured"
    ) -> SyncMode:
        """Take a peak (of a step run in ``measured_mode``; ``source`` says how it was obtained) and choose
        the mode for what follows."""
        self.base_peak = measured_peak - self.estimator.extra_bytes(measured_mode, num_microbatches)
        return self._choose(
            num_microbatches, reason=f"{source} peak {format_bytes(measured_peak)} in {measured_mode.value}"
        )

    def _choose(self, num_microbatches: int, reason: str) -> SyncMode:
        free = self.budget - self.base_peak
        parts = []
        chosen = self.candidates[-1]
        for index, mode in enumerate(self.candidates):
            if index < self.ceiling:
                continue
            extra = self.estimator.extra_bytes(mode, num_microbatches)
            if self.base_peak + extra <= self.budget:
                chosen = mode
                self.ceiling = index
                parts.append(f"{mode.value} needs +{format_bytes(extra)} -> fits")
                break
            parts.append(f"{mode.value} needs +{format_bytes(extra)}, {format_bytes(free)} free -> no")
        else:
            self.ceiling = len(self.candidates) - 1
            parts.append(f"nothing fits: the cheapest, {chosen.value}")
        changed = chosen is not self.mode or not self.decisions
        self.mode = chosen
        message = (
            f"auto sync ({reason}; budget {format_bytes(self.budget)}, {num_microbatches} micro-batches): "
            + "; ".join(parts) + f" => {chosen.value}"
        )
        if changed:
            self.decisions.append(message)
            log.info(message)
        return chosen

    def observe(self, peak: int, num_microbatches: int) -> SyncMode:
        """After a step in ``self.mode``: step down if its peak went over the budget."""
        if peak <= self.budget:
            return self.mode
        self.base_peak = peak - self.estimator.extra_bytes(self.mode, num_microbatches)
        current = self.candidates.index(self.mode)
        self.ceiling = min(current + 1, len(self.candidates) - 1)
        return self._choose(
            num_microbatches, reason=f"peak {format_bytes(peak)} over budget in {self.mode.value}, stepping down"
        )
