"""The memory governor: meters each step's memory peak and, under ``sync.mode=auto``, chooses the mode.

On CUDA the allocator's peak is free, so every step is measured. On CPU the tensor tracker sees every op
(slow), so the first step and every ``sync.peak_every``-th are measured and the steps between estimated:
the last measured base plus the sync bytes measured from the tensors. The peak and the budget are agreed
over ranks (max of the peaks, min of the budgets) in the step's metrics all-reduce, so every rank decides
alike: ranks that chose different modes would issue different collectives and hang.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..config import SyncConfig
from ..memory.accounting import (
    ShardedModel,
    format_bytes,
    pending_optimizer_state_bytes,
    resolve_budget,
)
from ..memory.activations import LayerActivationMeter
from ..memory.autosync import AutoSync, Setting, StepShape
from ..memory.costs import Links, candidates
from ..memory.meter import PeakMeter
from ..models import decoder_layers
from ..runtime.distributed import agree
from ..sync.modes import SyncChoice, SyncMode
from .step import ForwardBackwardResult
from .tuning import Tuning

LARGEST = "batch/largest_microbatch_tokens_max"  # the positions of the step's largest micro-batch
BACKWARD_PEAK = "memory/backward_peak_bytes_max"  # the peak up to the end of the step's last backward
PEAK_AFTER_FIRST = "memory/peak_after_first_microbatch_max"  # a rank's deciding step peaked after its first micro-batch


class CalibratingMeter(PeakMeter):
    """The first step's peak meter, which also measures what one decoder layer keeps for backward
    (:class:`~syncwise.memory.activations.LayerActivationMeter`): auto's activation model is scaled to it."""

    def __init__(self, model: nn.Module, optimizer, device: torch.device, layer: nn.Module):
        super().__init__(model, optimizer, device)
        self.layer = LayerActivationMeter(layer)

    def __enter__(self) -> CalibratingMeter:
        super().__enter__()
        self.layer.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.layer.__exit__(*exc)
        super().__exit__(*exc)


class MemoryGovernor:
    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device,
        estimator: ShardedModel, cfg: SyncConfig, modes: tuple[SyncMode, ...], configured: SyncChoice,
        tuning: Tuning | None = None, layer_classes: tuple[type[nn.Module], ...] = (),
    ):
        self.model, self.optimizer, self.device, self.estimator, self.cfg = model, optimizer, device, estimator, cfg
        self.layer_classes = layer_classes  # the model's decoder layers' (ModelFeatures): the calibrated one's
        self.measurable = PeakMeter.supported(model, device)
        self.base_peak: int | None = None  # measured peak minus the mode's held extra (per_microbatch's)
        self._state_to_come = 0  # optimizer state not yet allocated when the metered step began
        self._measure_next = False  # a true peak of the first step in a newly chosen setting
        self._layer_sample: tuple[int, int] | None = None  # (bytes, tokens) one decoder layer saved, first step
        # (positions, bytes) the largest micro-batch of the step auto decides from took over what was in use before it
        self._microbatch_sample: tuple[int, int] | None = None
        self.auto: AutoSync | None = None
        self.tuning = tuning  # the LM head's path and the token cap, where auto chooses them too
        self.own_budget = 0  # this rank's budget; auto uses the minimum over ranks
        self.name = ""  # which model's decisions these are, where a job trains two (PPO: "critic")
        sync_auto = SyncMode(cfg.mode) is SyncMode.AUTO
        if sync_auto and not self.measurable:
            raise ValueError(
                "sync.mode=auto decides from a measured memory peak, which is not available for "
                "engine.strategy=fsdp1 on CPU; choose sync.mode=deferred or per_microbatch"
            )
        if sync_auto or tuning is not None:
            self.own_budget = resolve_budget(cfg.memory_budget, device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            head, cap = tuning.first() if tuning is not None else (None, None)
            first = Setting(SyncChoice(SyncMode.PER_MICROBATCH) if sync_auto else configured, head, cap)
            syncs = candidates(modes, estimator, Links()) if sync_auto else [configured]
            self.auto = AutoSync(estimator, syncs, self.own_budget, mode=first, unsharded_forward=cfg.unsharded_forward)

    def hold_outside(self, nbytes: int) -> None:
        """Memory this process keeps outside the engine for the whole job (GRPO's rollout copy). CUDA's
        allocator peak already counts it; the CPU tensor tracker sees only the engine's tensors, so there it
        comes off auto's budget."""
        if self.auto is not None and self.device.type != "cuda":
            if self.own_budget - nbytes <= 0:
                raise ValueError(self._budget_error(self.own_budget, nbytes,
                                                    "the rollout engine and the other models kept beside it"))
            self.own_budget -= nbytes
            self.auto.budget = self.own_budget

    def _budget_error(self, budget: int, held: int, what: str) -> str:
        value = self.cfg.memory_budget
        shown = int(value) if value > 1 else f"{value:g}"
        return (f"sync.memory_budget={shown} ({format_bytes(budget)} per rank) is below what the job holds before "
                f"any micro-batch: {format_bytes(held)} ({what}); raise it, or 0 for 90% of the device's share")

    @property
    def setting(self) -> Setting | None:
        """The setting auto runs the next step in (its first: per_microbatch, the fused head, the longest
        sequence as cap); None without auto."""
        return self.auto.mode if self.auto is not None else None

    def meter_for_step(self, step: int) -> PeakMeter | None:
        """A peak meter when a true peak is due: every step on CUDA; on CPU the first and then every
        ``sync.peak_every`` steps."""
        if not self.measurable:
            return None
        every = self.cfg.peak_every
        due = self.base_peak is None or self._measure_next or (every > 0 and step % every == 0)
        if self.device.type == "cuda" or due:
            self._measure_next = False
            # Measured before the optimizer's state exists (the first step), the peak lacks it: add it.
            self._state_to_come = pending_optimizer_state_bytes(self.optimizer)
            if self.auto is not None and not self.auto.decided and self.tuning is not None \
                    and self.tuning.calibrates:
                first = decoder_layers(self.model, self.layer_classes)[0]
                return CalibratingMeter(self.model, self.optimizer, self.device, first)
            return PeakMeter(self.model, self.optimizer, self.device)
        return None

    def local_peak(
        self, result: ForwardBackwardResult, meter: PeakMeter | None, mode: SyncChoice
    ) -> tuple[int | None, int]:
        """This rank's peak for the step (run in ``mode``) and whether it was measured (1) or estimated (0):
        between measured steps on CPU, the last measured base plus the sync bytes measured from the tensors
        (but the root's gathered parameters, which the base has). (None for FSDP1 on CPU, where the tracker
        cannot follow its flat-parameter views.)"""
        result.metrics[LARGEST] = float(result.largest_tokens)  # (maxima over ranks, in the step's all-reduce)
        if not self.measurable:
            return None, 0
        if isinstance(meter, CalibratingMeter):
            self._layer_sample = meter.layer.sample
        if meter is not None and self.auto is not None and not self.auto.decided:
            self._microbatch_sample = meter.largest_microbatch()
            result.metrics[PEAK_AFTER_FIRST] = float(not meter.peak_in_first)  # (any rank's: the max over ranks)
        if meter is not None:
            # the optimizer state the first step creates in its optimizer step: absent from its forward/backward
            # peak (added), present in the optimizer step's own (as measured; adding it there counted it twice:
            # torch 2.11's AdamW peaked in its first step and auto's floor came out 1.7x the next step's peak)
            if meter.backward_peak is None:
                peak = backward = meter.peak + self._state_to_come
            else:
                backward = meter.backward_peak + self._state_to_come
                peak = max(backward, meter.peak)
            result.metrics[BACKWARD_PEAK] = float(backward)
            return peak, 1
        n = result.num_microbatches
        baseline = self.estimator.retained_grad_bytes(SyncMode.PER_MICROBATCH, n)
        gathered = max(0, result.unsharded_param_bytes - self.estimator.root_gathered_bytes(mode, n))
        return self.base_peak + max(0, result.retained_grad_bytes - baseline) + gathered, 0

    def after_step(
        self, result: ForwardBackwardResult, reduced: dict[str, float], peak: int | None, budget: int,
        measured: int, mode: SyncChoice, is_main: bool, batch: Any = None, seconds: float = 0.0,
    ) -> tuple[dict[str, Any], Setting | None]:
        """Memory metrics of the step (``peak`` and ``budget`` agreed over ranks; ``reduced``: the step's
        metrics over ranks, whose maxima :meth:`local_peak` filed are taken out) and, under auto, the setting
        of the next step (None: keep it). ``batch``: this rank's (auto's first decision sizes the step from
        it); ``seconds``: this rank's time of the step (caps on trial are timed by the slowest rank's)."""
        largest_tokens = int(reduced.pop(LARGEST, 0))
        backward_peak = reduced.pop(BACKWARD_PEAK, None)  # metered steps only (alike on every rank)
        peak_in_first = reduced.pop(PEAK_AFTER_FIRST, 1.0) == 0.0  # every rank's first micro-batch peaked
        backward_peak = int(backward_peak) if backward_peak is not None else None
        metrics: dict[str, Any] = {
            "memory/retained_grad_bytes": result.retained_grad_bytes,
            "memory/unsharded_param_bytes": result.unsharded_param_bytes,
            "batch/largest_microbatch_tokens": largest_tokens,
        }
        if peak is None:
            return metrics, None
        n = result.num_microbatches
        if measured:
            self.base_peak = peak - self.estimator.peak_extra_bytes(mode, n)
        metrics.update({"memory/peak_bytes": peak, "memory/peak_measured": measured})
        if self.auto is None:
            return metrics, None
        self.auto.budget = budget
        metrics["memory/budget_bytes"] = budget
        metrics["memory/over_budget_bytes"] = max(0, peak - budget)
        decisions, current = len(self.auto.decisions), self.auto.mode
        shape = None
        if not self.auto.decided:  # sized from this step (and its decoder layer's measured activations)
            shape = (self.tuning.shape(batch, n, largest_tokens, self._layer_sample, self._microbatch_sample,
                                       current.fused_head) if self.tuning else StepShape.fixed(n))
        activations = self.tuning.activation_bytes(largest_tokens, current.fused_head) if self.tuning else 0
        trial = False
        if self.auto.decided:
            # what auto predicts for this step's own split (its micro-batches and largest micro-batch: a later
            # batch splits unlike the first one the choice was made on), beside the peak
            metrics["memory/predicted_peak_bytes"] = self.auto.predicted_for(current, n, activations)
            next_mode = self.auto.observe(peak, n, activations, backward_peak)
            if next_mode == current and self.auto.trials and not measured:  # a metered step is no timing
                seconds = float(agree([], [seconds], "auto's cap trial", self.device, self.tuning.timeout_s)[1].max())
                next_mode, trial = self.auto.time_trial(seconds), True
        else:
            held = peak - activations  # what the measured step held besides its micro-batch's activations
            if held > budget:
                raise ValueError(self._budget_error(budget, held, "parameters, gradients, optimizer state, buffers"))
            ratio = self.tuning.activations.measured_ratio if self.tuning and self.tuning.activations else 0.0
            source = f"measured (activations {ratio:.2f}x the model's)" if ratio else "measured"
            next_mode = self.auto.decide(peak, current, shape, activations, source=source,
                                         backward_peak=backward_peak, measured_microbatches=n,
                                         peak_in_first=peak_in_first)
        if next_mode != current:  # the base of the estimated steps, until a step measures it
            self.base_peak = self.auto.peak_of(next_mode) - self.estimator.peak_extra_bytes(
                next_mode.choice, self.auto.shape.microbatches[next_mode.cap])
            self._measure_next = not trial  # a new choice is measured; a cap on trial fits below the measured one
        decided = len(self.auto.decisions) > decisions
        if decided and is_main:
            print(f"syncwise: {self.name + ': ' if self.name else ''}{self.auto.decisions[-1]}", flush=True)
        metrics["sync/decision"] = self.auto.decisions[-1] if decided else ""
        metrics["sync/next_mode"] = next_mode.choice.label
        return metrics, next_mode

    @property
    def settled(self) -> bool:
        """Auto has decided, timed its caps and measured its choice (or there is no auto)."""
        return self.auto is None or (self.auto.decided and not self.auto.trials and not self._measure_next)

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"base_peak": self.base_peak}
        if self.auto is not None:
            # caps still on trial: the checkpoint records auto's predicted choice (the first on trial), which the
            # resumed run keeps without timing more -- not whichever cap the trial was timing at the moment
            mode = self.auto.trials[0] if self.auto.trials else self.auto.mode
            state["auto"] = {
                "base_peak": self.auto.base_peak, "ceiling": self.auto.ceiling,
                "mode": mode.choice.mode.value, "units": sorted(mode.choice.units),
                "fused_head": mode.fused_head, "cap": mode.cap, "decisions": self.auto.decisions,
                "floor": self.auto.floor, "trial_cut_short": bool(self.auto.trials),
            }
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.base_peak = state.get("base_peak")
        # a checkpoint from before auto chose the head and cap too: decided again from a measured step
        if self.auto is not None and state.get("auto") and (self.tuning is None or "cap" in state["auto"]):
            auto = state["auto"]
            self.auto.base_peak, self.auto.ceiling = auto["base_peak"], int(auto["ceiling"])
            self.auto.floor = int(auto.get("floor", 0))
            choice = SyncChoice(SyncMode(auto["mode"]), frozenset(auto.get("units", ())))
            self.auto.mode = Setting(choice, auto.get("fused_head"), auto.get("cap"))
            self.auto.decisions = list(auto["decisions"])
            if auto.get("trial_cut_short"):
                self.auto.decisions.append(f"auto: the checkpoint was taken while caps were on trial; resumed in "
                                           f"its predicted choice, {self.auto.mode.label}, without timing more")
