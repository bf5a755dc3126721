"""Measuring a step's memory peak: the CUDA allocator's, or on CPU a tensor tracker's (:class:`PeakMeter`), the
step's whole peak and each micro-batch's own."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from ..sync import fsdp_internals as fsdp
from ..sync.counting import FSDP2_REDUCE_SCATTER
from .accounting import grad_bytes, storage_bytes


class PeakMeter:
    """Peak memory of this rank over a block: the CUDA allocator's peak, or on CPU a tensor-tracking
    dispatch mode (``FSDPMemTracker`` for FSDP2, ``MemTracker`` otherwise) that counts every storage,
    including parameters and optimizer state that existed before the block. The CPU tracker slows the
    block (it sees every op), so the engine uses it for one step at a time."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        if not self.supported(model, device):
            raise ValueError("no peak-memory meter for FSDP1 on CPU (its flat-parameter views defeat the tracker)")
        self.model, self.optimizer, self.device = model, optimizer, device
        self._tracker = None
        self.peak = 0
        self.backward_peak: int | None = None  # the peak up to the end of the last backward (mark_backward_end)
        self.held_between_microbatches = 0  # most memory in use between two micro-batches (CPU tracker)
        # each micro-batch's (positions, its own peak over what was in use when it began): what its activations
        # and the bytes in flight beside them really took, as the allocator or the tracker counts them
        self.microbatches: list[tuple[int, int]] = []
        # the micro-batch under way: (positions, in use at its start, gradient bytes at its start)
        self._open: tuple[int, int, int] | None = None
        self._earlier_peak = 0  # the block's peak before the micro-batch under way
        self._peaks: list[int] = []  # each micro-batch's own peak (absolute)

    @staticmethod
    def supported(model: nn.Module, device: torch.device) -> bool:
        return device.type == "cuda" or not FSDP1.fsdp_modules(model)

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            self._tracker = _without_propagation(FSDPMemTracker)(self.model, self.optimizer)
        else:
            self._tracker = _without_propagation(MemTracker)()
            _skip_frozen(self._tracker, self.model)
            self._tracker.track_external(self.model, self.optimizer)
        self._tracker.__enter__()
        self._reduce_scatter = getattr(dist, FSDP2_REDUCE_SCATTER)
        setattr(dist, FSDP2_REDUCE_SCATTER, _on_released_copy(self._reduce_scatter))
        return self

    def before_microbatch(self, positions: int = 0) -> None:
        """A micro-batch of ``positions`` tokens begins: its own peak is measured from here."""
        self._close_microbatch()
        # FSDPMemTracker raises on a module's second forward unless its per-module stats are reset.
        if self._tracker is not None:
            self.held_between_microbatches = max(self.held_between_microbatches, self._held_now())
            self._tracker.reset_mod_stats()
        self._earlier_peak = self._peak_so_far()
        self._restart_peak()
        self._open = (positions, self._in_use(), grad_bytes(self.model))

    def mark_backward_end(self) -> None:
        """The forward/backward peak so far: what the step's setting (sync mode, head, micro-batch size)
        changes, apart from the optimizer step's peak after it, which none of them does."""
        self._close_microbatch()
        self.backward_peak = self._peak_so_far()

    def largest_microbatch(self) -> tuple[int, int] | None:
        """(positions, its peak over what was in use at its start, less the gradients it left) of the micro-batch
        with the most positions (of those alike, the last), None if none was measured."""
        return max(reversed(self.microbatches), key=lambda m: m[0], default=None)

    @property
    def peak_in_first(self) -> bool:
        """Whether the step's first micro-batch peaked highest (nothing was left by earlier ones at its peak)."""
        return bool(self._peaks) and self._peaks.index(max(self._peaks)) == 0

    def _close_microbatch(self) -> None:
        """The micro-batch's own peak, less the gradients it created that stay (the step's first micro-batch
        allocates them, or a deferred one its accumulators): those are the sync mode's bytes, not activations --
        counted as activations, a small model's tiny batch measured 1.8x the activation model."""
        if self._open is not None:
            positions, start, grads = self._open
            left = max(grad_bytes(self.model) - grads, 0)
            peak = self._current_peak()
            self.microbatches.append((positions, max(peak - start - left, 0)))
            self._peaks.append(peak)
            self._open = None

    def _peak_so_far(self) -> int:
        return max(self._earlier_peak, self._current_peak())

    def _current_peak(self) -> int:
        """The peak since the last restart (the block's start, or the micro-batch's). The allocator counts on the
        host as it allocates: no synchronisation needed."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        snapshot = self._tracker.get_tracker_snapshot("peak")
        return max((dev["Total"] for dev in snapshot.values()), default=0)

    def _restart_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:  # the tracker's running maximum starts again from what is in use now
            self._tracker._peak_mem.clear()
            self._tracker._peak_mem_snap = self._tracker.get_tracker_snapshot("current")

    def _in_use(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return max((dev["Total"] for dev in self._tracker.get_tracker_snapshot("current").values()), default=0)

    def _held_now(self) -> int:
        """Memory the step holds right now, without in-flight communication buffers.

        The tracker files a collective's buffers under TEMP. The last reduce-scatter input of a backward
        is released by gloo's worker thread a moment after the collective completes, so whether it is
        still counted at the next micro-batch is a race (measured: 524,800 B, the root's fp32 gradient,
        present in some runs and not others). TEMP is therefore left out, and the TEMP a mode holds on
        purpose -- the gradient accumulators FSDP2 keeps outside ``.grad`` -- is counted from the tensors.
        """
        current = self._tracker.get_tracker_snapshot("current")
        held = 0
        for categories in current.values():
            temp = sum(v for k, v in categories.items() if str(k).endswith("TEMP"))
            held = max(held, categories["Total"] - temp)
        return held + storage_bytes(fsdp.accumulators(self.model))

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = self._peak_so_far()
            return
        setattr(dist, FSDP2_REDUCE_SCATTER, self._reduce_scatter)
        self._tracker.__exit__(*exc)
        self.peak = self._peak_so_far()
        self._tracker = None


def _without_propagation(tracker: type) -> type:
    """``tracker`` counting no tensor that DTensor's sharding propagation makes under a fake mode of its own (shapes,
    not memory). torch 2.13's trackers skip them; 2.11's counted them -- the first time each operation met a DTensor,
    so the first optimizer step of an FSDP2 model measured a peak its later steps never reach (qwen2-test, 2 ranks:
    10.3 MB against 6.8 MB, and auto's floor from it 1.5x the next step's peak)."""
    from torch._guards import active_fake_mode

    class Tracker(tracker):
        def __enter__(self):
            self._entry_fake_mode = active_fake_mode()
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if active_fake_mode() is not self._entry_fake_mode and not _has_dtensor(types):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Tracker


def _has_dtensor(types) -> bool:
    from torch.distributed.tensor import DTensor

    return any(t is DTensor for t in types)


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen(tracker, model: nn.Module) -> None:
    """torch's ``MemTracker`` registers a gradient hook on every parameter, which raises on a frozen one
    (LoRA's base weights): mark those as hooked already. They never get a gradient to count."""
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())


def _on_released_copy(reduce_scatter):
    """FSDP2's reduce-scatter (``reduce_scatter_single``; ``_tensor`` before torch 2.13) handing gloo a copy of
    its input, freed the moment the collective returns.

    gloo's worker thread keeps its own reference to a collective's input and drops it a moment after the
    collective completes, so whether FSDP2's reduce-scatter input (a unit's unsharded gradient) was still
    counted by the following operations -- and so at the peak -- was a race: measured peaks of the same step
    differed by up to one unit's gradient. gloo now holds only the copy, whose storage is emptied as soon as
    the collective has completed, and FSDP2's own buffer lives exactly as long as FSDP2 keeps it. Costs one
    memcpy per reduce-scatter, on metered steps only.
    """

    def wrapper(output, input, *args, **kwargs):  # noqa: A002 - torch's own argument name
        copy = input.clone()
        try:
            return reduce_scatter(output, copy, *args, **kwargs)
        finally:
            copy.untyped_storage().resize_(0)

    return wrapper
