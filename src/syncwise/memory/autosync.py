"""``sync.mode=auto``: the fastest sync configuration whose predicted peak memory fits the budget.

The candidates come from :func:`syncwise.memory.costs.candidates`, fastest first: ``deferred_unsharded``,
``deferred``, ``partial`` deferring U-1 units, ..., 1 unit, (``replica_deferred``,) ``per_microbatch``.
The first step runs in the safe mode (``per_microbatch``) and measures its peak. Every candidate's
predicted peak is that measured base plus the bytes it holds beyond ``per_microbatch`` (the estimator in
:mod:`syncwise.memory.accounting`); the fastest that fits is chosen, and the decision is logged with its numbers.
Later steps keep measuring (CUDA: the allocator's peak, every step; CPU: a full tracked step every
``sync.peak_every`` steps, else the base plus the sync bytes measured from the tensors); if a peak exceeds
the budget, auto steps down to the next candidate that fits -- one unit fewer deferred, not straight to
``per_microbatch`` -- and never back up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..sync.modes import SyncChoice, SyncMode
from .accounting import ShardedModel, format_bytes

log = logging.getLogger("syncwise.auto")


@dataclass
class AutoSync:
    estimator: ShardedModel
    candidates: list[SyncChoice]  # fastest first (syncwise.memory.costs.candidates)
    budget: int
    base_peak: int | None = None  # measured peak of per_microbatch (activations, params, optimizer, ...)
    ceiling: int = 0  # index into the candidates auto may not go above after stepping down
    mode: SyncChoice = SyncChoice(SyncMode.PER_MICROBATCH)
    decisions: list[str] = field(default_factory=list)

    @property
    def decided(self) -> bool:
        return self.base_peak is not None

    def decide(
        self, measured_peak: int, measured_mode: SyncChoice, num_microbatches: int, source: str = "measured"
    ) -> SyncChoice:
        """Take a peak (of a step run in ``measured_mode``; ``source`` says how it was obtained) and choose
        the configuration for what follows."""
        self.base_peak = measured_peak - self.estimator.extra_bytes(measured_mode, num_microbatches)
        return self._choose(
            num_microbatches, reason=f"{source} peak {format_bytes(measured_peak)} in {measured_mode.label}"
        )

    def _choose(self, num_microbatches: int, reason: str) -> SyncChoice:
        free = self.budget - self.base_peak
        rejected: list[tuple[str, int]] = []
        chosen = self.candidates[-1]
        found = None
        for index, mode in enumerate(self.candidates):
            if index < self.ceiling:
                continue
            extra = self.estimator.extra_bytes(mode, num_microbatches)
            if self.base_peak + extra <= self.budget:
                chosen, found, self.ceiling = mode, f"{mode.label} needs +{format_bytes(extra)} -> fits", index
                break
            rejected.append((mode.label, extra))
        parts = _collapse(rejected, free)
        if found:
            parts.append(found)
        else:
            self.ceiling = len(self.candidates) - 1
            parts.append(f"nothing fits: the cheapest, {chosen.label}")
        changed = chosen != self.mode or not self.decisions
        self.mode = chosen
        trainable, total = sum(self.estimator.unit_trainable_numels), self.estimator.num_params
        frozen = (f"; {trainable / 1e6:.3g}M of {total / 1e6:.4g}M parameters train (LoRA / frozen): deferring "
                  f"holds their gradients only, deferred_unsharded also every parameter" if trainable < total else "")
        message = (
            f"auto sync ({reason}; budget {format_bytes(self.budget)}, {num_microbatches} micro-batches{frozen}): "
            + "; ".join(parts) + f" => {chosen.label}"
        )
        if changed:
            self.decisions.append(message)
            log.info(message)
        return chosen

    def observe(self, peak: int, num_microbatches: int) -> SyncChoice:
        """After a step in ``self.mode``: step down if its peak went over the budget."""
        if peak <= self.budget:
            return self.mode
        self.base_peak = peak - self.estimator.extra_bytes(self.mode, num_microbatches)
        current = self.candidates.index(self.mode)
        self.ceiling = min(current + 1, len(self.candidates) - 1)
        return self._choose(
            num_microbatches, reason=f"peak {format_bytes(peak)} over budget in {self.mode.label}, stepping down"
        )


def _collapse(rejected: list[tuple[str, int]], free: int) -> list[str]:
    """"X needs +a, f free -> no" for each rejected candidate, a run of partial(K) in one part."""
    parts: list[str] = []
    index = 0
    while index < len(rejected):
        end = index
        while end + 1 < len(rejected) and rejected[index][0].startswith("partial(") and rejected[end + 1][0].startswith(
            "partial("
        ):
            end += 1
        (first, most), (last, least) = rejected[index], rejected[end]
        if end == index:
            parts.append(f"{first} needs +{format_bytes(most)}, {format_bytes(free)} free -> no")
        else:
            parts.append(f"{first}..{last} need +{format_bytes(most)}..+{format_bytes(least)}, "
                         f"{format_bytes(free)} free -> no")
        index = end + 1
    return parts
