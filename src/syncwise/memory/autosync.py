"""``auto``: the fastest configuration whose predicted peak memory fits the budget.

What auto chooses among: the sync configurations (``sync.mode=auto``; from
:func:`syncwise.memory.costs.candidates`: ``deferred_unsharded``, ``deferred``, ``partial`` deferring U-1
units, ..., 1 unit, (``replica_deferred``,) ``per_microbatch``), and where they are ``auto`` too, the LM
head's path (``engine.fused_lm_head``: logits materialised, or fused) and the token cap
(``engine.max_tokens_per_micro_batch``: powers of two). Each :class:`Setting` is one point of that space.

The first step runs in the safest setting (``per_microbatch``, the fused head, each rank's longest sequence
as the cap) and measures its peak. Every setting's predicted peak is that measured peak with the measured
setting's own extra taken out -- the bytes its sync mode holds beyond ``per_microbatch`` (the estimator in
:mod:`syncwise.memory.accounting`) and its largest micro-batch's activations (:class:`StepShape`, from the
activation model ``syncwise plan`` uses) -- and the candidate's put in; where the measured step peaked in its
optimizer step rather than in forward/backward (small models, short sequences), the forward/backward peak is
what the settings change, and the optimizer step's stays a floor under every prediction. Settings are
ranked by predicted step time (:class:`StepShape` ``seconds``: communication over the links, plus the fused
head's extra compute -- at the device type's nominal figures, or as timed here with ``sync.auto_timing``,
when the chosen cap and the next smaller ones are also timed for a step each); the fastest that fits is
chosen, and the decision is logged with its numbers, the runner-up and where its times come from. Later
steps keep measuring; if a peak exceeds the budget, auto steps down to the next setting in that order that
fits -- never back up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..sync.modes import SyncChoice, SyncMode
from .accounting import ShardedModel, format_bytes

log = logging.getLogger("syncwise.auto")

LONGEST = 1  # the cap of the first step under an auto cap: each rank's longest sequence sets it (FIRST_CAP_FLOOR)
TRIAL_CAPS = 3  # the chosen cap and the next smaller ones that fit, each timed for a step before auto settles
CAPS = tuple(2**k for k in range(20, 6, -1))  # the caps auto chooses among: 1M .. 128 tokens
# The first step's cap where the longest sequence is shorter: the smallest cap auto chooses among (measuring
# below it measures no setting auto could choose, and short RL responses would each be a micro-batch).
FIRST_CAP_FLOOR = CAPS[-1]


@dataclass(frozen=True)
class Setting:
    """One configuration a step runs in: a sync choice and, where auto chooses them, the LM head's path
    and the token cap (None: set by the config, not auto's to choose)."""

    choice: SyncChoice
    fused_head: bool | None = None
    cap: int | None = None  # tokens per micro-batch, stretched to the longest sequence of a step

    @property
    def label(self) -> str:
        parts = [self.choice.label]
        if self.fused_head is not None:
            parts.append("fused head" if self.fused_head else "logits materialised")
        if self.cap is not None:
            parts.append(f"{self.cap}-token cap" if self.cap > LONGEST
                         else f"longest-sequence cap (>= {FIRST_CAP_FLOOR} tokens)")
        return ", ".join(parts)


@dataclass(frozen=True)
class StepShape:
    """What auto knows of the step it decides for (agreed by every rank): the micro-batches each cap gives,
    the activation peak of a setting's largest micro-batch, and a setting's predicted seconds."""

    microbatches: dict[int | None, int]  # cap -> micro-batches of the step (None: the configured split)
    heads: tuple[bool | None, ...] = (None,)  # the head paths to choose among, fastest first
    activation_bytes: Callable[[int | None, bool | None], int] = lambda cap, fused: 0
    seconds: Callable[[Setting, int], float] | None = None  # (setting, micro-batches) -> predicted seconds
    basis: str = ""  # what the seconds come from, in words (the decision says it)
    timed: bool = False  # the seconds were timed here (sync.auto_timing): the caps are timed too

    @classmethod
    def fixed(cls, num_microbatches: int) -> StepShape:
        """Only the sync mode to choose: the split and the head are the config's."""
        return cls({None: num_microbatches})

    def with_measured(self, measured: Setting, num_microbatches: int, activations: int) -> StepShape:
        """This shape with the setting a step was measured in (the first step's longest-sequence cap, which
        is no cap auto chooses among), as that step split and with its measured activations."""
        own = self.activation_bytes

        def activation_bytes(cap: int | None, fused: bool | None) -> int:
            return activations if (cap, fused) == (measured.cap, measured.fused_head) else own(cap, fused)

        return replace(self, microbatches={**self.microbatches, measured.cap: num_microbatches},
                       activation_bytes=activation_bytes)


def step_shape(
    splits: dict[int, tuple[int, int]], fixed: tuple[int, int], heads: tuple[bool | None, ...],
    activations: Callable[[int, bool | None], int], comm_seconds: Callable[[SyncChoice, int], float] | None,
    head_seconds: float, basis: str = "", timed: bool = False,
) -> StepShape:
    """A step's shape from how it splits: ``splits`` cap -> (micro-batches, the largest one's positions) for
    every cap at or above the longest sequence (the larger caps kept only where they split into fewer);
    ``fixed``: the same for the configured split (used where there is no cap to choose); ``activations``:
    (positions, fused) -> bytes; ``comm_seconds``: a step's collectives in a sync choice over n micro-batches
    (None: unsharded, nothing to wait for); ``head_seconds``: what the fused head adds to a step; ``basis``,
    ``timed``: what those times come from (:class:`StepShape`)."""
    kept: list[tuple[int, int, int]] = []
    for cap, (n, largest) in sorted(splits.items()):
        if not kept or n < kept[-1][1]:
            kept.append((cap, max(n, 1), largest))
    counts: dict[int | None, int] = {cap: n for cap, n, _ in reversed(kept)} or {None: fixed[0]}
    largest_at: dict[int | None, int] = {cap: largest for cap, _, largest in kept} | {None: fixed[1]}

    def seconds(setting: Setting, n: int) -> float:
        comm = comm_seconds(setting.choice, n) if comm_seconds is not None else 0.0
        return comm + (head_seconds if setting.fused_head else 0.0)

    return StepShape(counts, heads, lambda cap, fused: activations(largest_at[cap], fused), seconds, basis, timed)


@dataclass
class AutoSync:
    estimator: ShardedModel
    syncs: list[SyncChoice]  # fastest first (syncwise.memory.costs.candidates)
    budget: int
    base_peak: int | None = None  # measured forward/backward peak without any setting's extra (params, ...)
    floor: int = 0  # the optimizer step's peak where it was above forward/backward's: no setting changes it
    root_in_base: bool = True  # the base has the root's gathered parameters (a measured peak does)
    ceiling: int = 0  # index into the candidates auto may not go above after stepping down
    mode: Setting = Setting(SyncChoice(SyncMode.PER_MICROBATCH))
    decisions: list[str] = field(default_factory=list)
    shape: StepShape | None = None
    candidates: list[Setting] = field(default_factory=list)  # ranked fastest first at the decision
    predicted_peak: int = 0  # of the chosen setting
    runner_up: Setting | None = None  # the next fastest that fits
    trials: list[Setting] = field(default_factory=list)  # caps still on trial after the decision
    timed: dict[Setting, float] = field(default_factory=dict)  # a step's seconds in each cap on trial
    said_over_budget: bool = False  # a step over the budget with nothing lower left has been reported
    unsharded_forward: bool = True  # sync.unsharded_forward: what a mode keeps gathered through its one micro-batch

    @property
    def decided(self) -> bool:
        return self.base_peak is not None

    def _held_extra(self, choice: SyncChoice, num_microbatches: int) -> int:
        """What a sync choice holds at its peak beside its micro-batch's activations, over a step of one
        micro-batch in ``per_microbatch``: with several, what the earlier micro-batches leave for the one that
        peaks -- its held extra (:meth:`ShardedModel.peak_extra_bytes`) and ``per_microbatch``'s gradient shards
        (none exist during a step's first micro-batch: a step of one peaks without them); with one, the
        parameters the mode keeps gathered from its forward through its backward."""
        if num_microbatches <= 1:
            return self.estimator.gathered_through_backward(choice, self.unsharded_forward)
        return (self.estimator.peak_extra_bytes(choice, num_microbatches, self.root_in_base)
                + self.estimator.retained_grad_bytes(SyncMode.PER_MICROBATCH, num_microbatches))

    def extra_bytes(self, setting: Setting) -> int:
        """What ``setting`` adds to the base: its sync mode's held bytes and its activations."""
        n = self.shape.microbatches[setting.cap]
        return self._held_extra(setting.choice, n) + self.shape.activation_bytes(setting.cap, setting.fused_head)

    def _set_base(
        self, peak: int, backward_peak: int | None, choice: SyncChoice, num_microbatches: int, activations: int,
        source: str, peak_in_first: bool = False,
    ) -> str:
        """The base from a measured step run in ``choice`` (its forward/backward peak less that choice's
        held extra -- nothing left by earlier micro-batches where its first micro-batch peaked -- and its largest
        micro-batch's activations); returns ``source``'s words for the decision."""
        backward_peak, source = self._phases(peak, backward_peak, source)
        held = 0 if peak_in_first else self._held_extra(choice, num_microbatches)
        self.base_peak = backward_peak - held - activations
        return source

    def decide(
        self, measured_peak: int, measured: Setting, shape: StepShape, measured_activations: int = 0,
        source: str = "measured", backward_peak: int | None = None, measured_microbatches: int | None = None,
        peak_in_first: bool = False,
    ) -> Setting:
        """Take a peak (of a step run in ``measured``, whose largest micro-batch's activations were
        ``measured_activations``, in ``measured_microbatches``; ``source`` says how the peak was obtained;
        ``backward_peak``: the part of it up to the end of the last backward, where it is known) and choose
        the setting of what follows for a step of ``shape``; ``peak_in_first``: the measured step peaked in its first
        micro-batch. The measured setting stays a candidate, the last: a setting that measured within the budget
        is never left for one predicted over it."""
        caps, heads = list(shape.microbatches), shape.heads
        ranked = [Setting(choice, head, cap) for choice in self.syncs for head in heads for cap in caps]
        if shape.seconds is not None and len(ranked) > len(self.syncs):  # head or cap to choose too
            order = {s: i for i, s in enumerate(ranked)}
            ranked.sort(key=lambda s: (round(shape.seconds(s, shape.microbatches[s.cap]), 9), order[s]))
        n = measured_microbatches or shape.microbatches.get(measured.cap, shape.microbatches[caps[0]])
        if measured not in ranked and (measured.choice in self.syncs):
            ranked.append(measured)
            shape = shape.with_measured(measured, n, measured_activations)
        self.shape = shape
        self.candidates, self.ceiling = ranked, 0
        source = self._set_base(measured_peak, backward_peak, measured.choice, n, measured_activations, source,
                                peak_in_first)
        chosen = self._choose(reason=f"{source} peak {format_bytes(measured_peak)} in {measured.label}")
        # What a micro-batch's size does to compute is the device's (on a CPU a larger one can be slower per
        # token: caches, memory bandwidth shared by the ranks): with sync.auto_timing the chosen cap and the
        # next smaller ones that fit are each timed for a step, and the fastest kept (time_trial).
        if not shape.timed:
            self.trials, self.timed = [], {}
            return chosen
        smaller = sorted((s for s in self.candidates if s.choice == chosen.choice and s.fused_head == chosen.fused_head
                          and s.cap is not None and chosen.cap is not None and LONGEST < s.cap < chosen.cap
                          and self.peak_of(s) <= self.budget), key=lambda s: -s.cap)
        self.trials, self.timed = ([chosen, *smaller[: TRIAL_CAPS - 1]] if smaller else []), {}
        return chosen

    def _phases(self, peak: int, backward_peak: int | None, source: str) -> tuple[int, str]:
        """(the forward/backward peak, the source's words) of a measured step; where its optimizer step
        peaked higher, that peak becomes the floor every setting's prediction keeps."""
        if backward_peak is None or backward_peak >= peak:
            return peak, source
        self.floor = peak
        return backward_peak, f"{source} (forward/backward {format_bytes(backward_peak)}, optimizer step)"

    def peak_of(self, setting: Setting) -> int:
        """The predicted peak of ``setting`` (from the base as it stands)."""
        return self.predicted_for(setting, self.shape.microbatches[setting.cap],
                                  self.shape.activation_bytes(setting.cap, setting.fused_head))

    def predicted_for(self, setting: Setting, num_microbatches: int, activations: int) -> int:
        """The predicted peak of a step run in ``setting`` that split into ``num_microbatches``, its largest
        micro-batch's activations ``activations`` (the model's, for the step as it came)."""
        return max(self.base_peak + self._held_extra(setting.choice, num_microbatches) + activations, self.floor)

    def time_trial(self, seconds: float) -> Setting:
        """After a step of ``seconds`` (the slowest rank's, not metered) in ``self.mode`` while caps are on
        trial: the next cap to time or, all timed, the fastest, kept from now on."""
        self.timed[self.mode] = seconds
        pending = [s for s in self.trials if s not in self.timed]
        if pending:
            self.mode = pending[0]
            return self.mode
        best = min(self.trials, key=lambda s: (self.timed[s], self.trials.index(s)))
        times = ", ".join(f"{s.cap}: {self.timed[s]:.3g} s" for s in self.trials)
        message = f"auto timed a step at each cap ({times}) => {best.label}"
        self.trials, self.mode, self.ceiling = [], best, self.candidates.index(best)
        self.predicted_peak = self.peak_of(best)
        self.decisions.append(message)
        log.info(message)
        return best

    def _choose(self, reason: str) -> Setting:
        free = self.budget - self.base_peak
        rejected: list[tuple[str, int]] = []
        chosen, found, self.runner_up = self.candidates[-1], None, None
        for index, setting in enumerate(self.candidates):
            if index < self.ceiling:
                continue
            extra = self.extra_bytes(setting)
            if self.base_peak + extra > self.budget:
                if found is None:
                    rejected.append((setting.label, extra))
            elif found is None:
                chosen, found, self.ceiling = setting, f"{setting.label} needs +{format_bytes(extra)} -> fits", index
            else:
                self.runner_up = setting
                break
        parts = _collapse(rejected, free)
        if found:
            parts.append(found)
        else:  # the lowest predicted peak of those left (stepping down: never back above the ceiling)
            left = self.candidates[self.ceiling :] or self.candidates[-1:]
            chosen = min(left, key=lambda s: (self.peak_of(s), left.index(s)))
            self.ceiling = self.candidates.index(chosen)
            parts.append(f"nothing fits: the lowest predicted peak, {chosen.label}, "
                         f"{format_bytes(self.peak_of(chosen) - self.budget)} over the budget")
        self.predicted_peak = self.peak_of(chosen)
        changed = chosen != self.mode or not self.decisions
        self.mode = chosen
        trainable, total = sum(self.estimator.unit_trainable_numels), self.estimator.num_params
        frozen = (f"; {trainable / 1e6:.3g}M of {total / 1e6:.4g}M parameters train (LoRA / frozen): deferring "
                  f"holds their gradients only, deferred_unsharded also every parameter" if trainable < total else "")
        n = self.shape.microbatches[chosen.cap]
        count = f"{n} micro-batch{'es' if n != 1 else ''}"
        # the split is the config's: said once; chosen with the cap: said beside the choice (not the measured step's)
        split, chosen_split = (f", {count}", "") if len(self.shape.microbatches) == 1 else ("", f", {count}")
        chosen_here = [name for name, options in (("LM head", self.shape.heads), ("token cap", self.shape.microbatches))
                       if len(options) > 1]
        what = "auto sync" if len(self.syncs) > 1 else (  # the sync mode set: the head and / or cap only
            f"auto {' and '.join(chosen_here) or 'sync'} with {self.syncs[0].label} as set")
        message = (f"{what} ({reason}; budget {format_bytes(self.budget)}{split}{frozen}): "
                   + "; ".join(parts) + f" => {chosen.label} ({chosen_split.lstrip(', ')}{', ' if chosen_split else ''}"
                   f"predicted peak {format_bytes(self.predicted_peak)}" + self._time_of(chosen) + ")")
        if self.runner_up is not None and len(self.candidates) > len(self.syncs):
            message += f"; runner-up {self.runner_up.label}{self._time_of(self.runner_up, ' ')}"
        if self.shape.basis and self._time_of(chosen):
            message += f"; times from {self.shape.basis}"
        if changed:
            self.decisions.append(message)
            log.info(message)
        return chosen

    def _time_of(self, setting: Setting, sep: str = ", ") -> str:
        if self.shape.seconds is None or len(self.candidates) == len(self.syncs):
            return ""
        seconds = self.shape.seconds(setting, self.shape.microbatches[setting.cap])
        text = f"predicted comm + head {seconds * 1e3:.0f} ms"
        return f" ({text})" if sep == " " else f"{sep}{text}"

    def observe(
        self, peak: int, num_microbatches: int, measured_activations: int = 0, backward_peak: int | None = None,
    ) -> Setting:
        """After a step of ``num_microbatches`` in ``self.mode`` (its largest micro-batch's activations
        ``measured_activations``; ``backward_peak`` as in :meth:`decide`): step down if its peak went over
        the budget. (Resumed from a checkpoint, without the first step's shape: only the sync mode steps
        down.)"""
        if peak <= self.budget:
            if backward_peak is not None and self.mode in self.candidates:  # a measured step: the base again,
                # from the setting that runs (the first step's peak may have come where no activation was, e.g.
                # a tied embedding's gradients summed at the end of backward; a larger setting's does not)
                self._set_base(peak, backward_peak, self.mode.choice, num_microbatches, measured_activations, "")
            return self.mode
        if self.shape is None or self.mode not in self.candidates:
            self.shape = StepShape({self.mode.cap: num_microbatches})
            self.candidates = [Setting(c, self.mode.fused_head, self.mode.cap) for c in self.syncs]
        n = self.shape.microbatches[self.mode.cap]
        source = self._set_base(peak, backward_peak, self.mode.choice, n, measured_activations, "peak")
        current = self.candidates.index(self.mode)
        self.ceiling = min(current + 1, len(self.candidates) - 1)
        self.trials = []  # over the budget: no more timing, the next that fits
        previous = self.mode
        chosen = self._choose(reason=f"{source} {format_bytes(peak)} over budget in {self.mode.label}, stepping down")
        if chosen == previous and not self.said_over_budget:  # nothing left to step down to: said once
            self.said_over_budget = True
            message = (f"auto: the step peaked at {format_bytes(peak)}, over the budget {format_bytes(self.budget)}, "
                       f"and no setting left is predicted lower than {chosen.label}; running on over the budget "
                       "(memory/over_budget_bytes says by how much each step)")
            self.decisions.append(message)
            log.info(message)
        return chosen


def _collapse(rejected: list[tuple[str, int]], free: int) -> list[str]:
    """"X needs +a, f free -> no" for each rejected candidate, a run of partial(K) in one part; beyond six,
    the count and the fastest."""
    if len(rejected) > 6:
        (first, most) = rejected[0]
        return [f"{len(rejected)} faster settings do not fit ({first} needs +{format_bytes(most)}, "
                f"{format_bytes(free)} free)"]
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
