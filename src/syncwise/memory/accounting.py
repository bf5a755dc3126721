"""What each sync mode holds in memory: a byte estimator, measurements from the tensors, and the budget.

The estimator reads what a unit holds between micro-batches from the switches its mode gives it
(:mod:`syncwise.sync.modes`): a unit that does not sync keeps its *unsharded* gradient in the accumulation
dtype (the reduce dtype, fp32 by default: 4 bytes x every trainable parameter, on every rank, whatever
the world size); one that syncs holds only its 1/W shard; one that skips only the cross-replica all-reduce
(HSDP) holds a sharded partial sum in the reduce dtype; one not resharded after backward also keeps its
gathered parameters (param dtype). Frozen parameters have no gradient.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from ..runtime.distributed import local_tensor
from ..sync import fsdp_internals as fsdp
from ..sync.counting import FSDP2_REDUCE_SCATTER
from ..sync.modes import Switches, SyncChoice, SyncMode, as_choice

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------------------------------------
# Estimator
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardedModel:
    """What the estimator needs: per FSDP unit, its parameter shapes and which are trainable; dtypes;
    shard-group size."""

    unit_shapes: tuple[tuple[tuple[int, ...], ...], ...]  # unit -> parameter shapes
    shard_size: int  # ranks a parameter is sharded over (W, or W / replicas for HSDP)
    param_dtype: str = "float32"  # compute / all-gather dtype
    reduce_dtype: str = "float32"  # gradient reduction and accumulation dtype
    orig_dtype: str = "float32"  # sharded parameters and their gradients
    unit_trainable: tuple[tuple[bool, ...], ...] | None = None  # unit -> requires_grad per parameter; None: all

    @cached_property
    def _trainable(self) -> tuple[tuple[bool, ...], ...]:
        if self.unit_trainable is not None:
            return self.unit_trainable
        return tuple((True,) * len(shapes) for shapes in self.unit_shapes)

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for unit in self.unit_shapes for s in unit)

    @cached_property
    def _padded(self) -> tuple[list[int], list[int]]:
        """(all, trainable) padded elements per unit: FSDP2 pads each parameter's dim 0 to a multiple of the
        shard size."""
        every, trainable = [], []
        for shapes, train in zip(self.unit_shapes, self._trainable, strict=True):
            padded = [_padded_numel(shape, self.shard_size) for shape in shapes]
            every.append(sum(padded))
            trainable.append(sum(n for n, t in zip(padded, train, strict=True) if t))
        return every, trainable

    def unit_padded_numels(self, trainable_only: bool = False) -> list[int]:
        """All-gathered elements per unit (``trainable_only``: of its trainable parameters, the ones FSDP
        reduce-scatters)."""
        return list(self._padded[1 if trainable_only else 0])

    def padded_numel(self) -> int:
        return sum(self._padded[0])

    @cached_property
    def unit_trainable_numels(self) -> list[int]:
        return [
            sum(math.prod(shape) for shape, t in zip(shapes, train, strict=True) if t)
            for shapes, train in zip(self.unit_shapes, self._trainable, strict=True)
        ]

    def _held(self, switches: Switches, unit: int) -> tuple[int, int]:
        """(gradient bytes, gathered parameter bytes) one unit holds after a backward run with ``switches``."""
        sharded = self._padded[1][unit] // self.shard_size
        if not switches.sync_grads:  # FSDP2 upcasts the held gradient to the reduce dtype
            grads = self.unit_trainable_numels[unit] * DTYPE_BYTES[self.reduce_dtype]
        elif not switches.all_reduce_grads:  # a sharded partial sum in the reduce dtype
            grads = sharded * DTYPE_BYTES[self.reduce_dtype]
        else:
            grads = sharded * DTYPE_BYTES[self.orig_dtype]
        params = self._padded[0][unit] * DTYPE_BYTES[self.param_dtype]
        return grads, params if switches.reshard_after_backward is False else 0

    def _held_after(self, mode: SyncMode | SyncChoice, index: int, num_microbatches: int) -> tuple[int, int]:
        choice = as_choice(mode)
        held = [self._held(choice.switches(index, num_microbatches, u), u) for u in range(len(self.unit_shapes))]
        return sum(g for g, _ in held), sum(p for _, p in held)

    def unit_held_extra(self) -> list[int]:
        """Bytes each unit holds beyond its gradient shard while it defers (its unsharded gradient)."""
        defer, sync = Switches(sync_grads=False, all_reduce_grads=False), Switches()
        return [self._held(defer, u)[0] - self._held(sync, u)[0] for u in range(len(self.unit_shapes))]

    def retained_grad_bytes(self, mode: SyncMode | SyncChoice, num_microbatches: int) -> int:
        """Most gradient bytes held after any micro-batch's backward within a step."""
        synced = self._held_after(SyncMode.PER_MICROBATCH, 0, 1)[0]
        if num_microbatches <= 1:
            return synced
        return max(synced, self._held_after(mode, 0, num_microbatches)[0])

    def unsharded_param_bytes(self, mode: SyncMode | SyncChoice, num_microbatches: int) -> int:
        """All-gathered parameter bytes still held after a non-final micro-batch's backward."""
        if num_microbatches <= 1:
            return 0
        return self._held_after(mode, 0, num_microbatches)[1]

    def root_gathered_bytes(self, mode: SyncMode | SyncChoice, num_microbatches: int) -> int:
        """Of :meth:`unsharded_param_bytes`, the root unit's (unit 0)."""
        if num_microbatches <= 1 or not self.unit_shapes:
            return 0
        return self._held(as_choice(mode).switches(0, num_microbatches, 0), 0)[1]

    def extra_bytes(self, mode: SyncMode | SyncChoice, num_microbatches: int) -> int:
        """Bytes ``mode`` holds between micro-batches beyond ``per_microbatch``."""
        base = self.retained_grad_bytes(SyncMode.PER_MICROBATCH, num_microbatches)
        return (
            self.retained_grad_bytes(mode, num_microbatches) - base
            + self.unsharded_param_bytes(mode, num_microbatches)
        )

    def peak_extra_bytes(self, mode: SyncMode | SyncChoice, num_microbatches: int, root_in_base: bool = True) -> int:
        """What ``mode`` adds to a ``per_microbatch`` peak: :meth:`extra_bytes` but, where that peak has them
        (``root_in_base``: a measured peak, or a plan's with FSDP2's bytes in flight), the root's gathered
        parameters -- FSDP keeps the root gathered from its forward to its backward in every mode (measured
        on a Llama and a GPT-2 directory with a 32000-token tied embedding, 2 ranks, 7 micro-batches:
        ``deferred_unsharded`` adds exactly this to ``per_microbatch``'s peak)."""
        root = self.root_gathered_bytes(mode, num_microbatches) if root_in_base else 0
        return self.extra_bytes(mode, num_microbatches) - root


def _padded_numel(shape: tuple[int, ...], shard_size: int) -> int:
    if not shape:
        return shard_size  # a scalar becomes one element per rank
    rows = math.ceil(shape[0] / shard_size) * shard_size
    return rows * math.prod(shape[1:])


def sharded_model_of(
    units: Iterable[nn.Module], shard_size: int, param_dtype: str, reduce_dtype: str, flat_units: bool = False
) -> ShardedModel:
    """Estimator input from modules that are (or will be) FSDP units; each parameter counted once, in the
    innermost unit that holds it (as ``fully_shard`` assigns them). ``flat_units`` (FSDP1): a unit with any
    trainable parameter reduces and holds gradients for all of them (one flat parameter)."""
    units = list(units)
    seen: set[int] = set()
    shapes: list[tuple[tuple[int, ...], ...]] = []
    trainable: list[tuple[bool, ...]] = []
    for unit in reversed(units):  # inner units (layers) before the root
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        shapes.append(tuple(tuple(p.shape) for p in own))  # a DTensor's shape is the global one
        flags = tuple(p.requires_grad for p in own)
        trainable.append((any(flags),) * len(flags) if flat_units else flags)
    return ShardedModel(
        tuple(reversed(shapes)), shard_size, param_dtype, reduce_dtype, unit_trainable=tuple(reversed(trainable))
    )


# ------------------------------------------------------------------------------------------------
# Measurement from the tensors themselves
# ------------------------------------------------------------------------------------------------
def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views, e.g. FSDP1's per-parameter grads, once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = local_tensor(tensor).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def grad_bytes(module: nn.Module) -> int:
    """All gradient bytes this rank holds: reduced (sharded or replicated) ``.grad`` plus unsynced ones."""
    reduced = (p.grad for p in module.parameters() if p.grad is not None)
    return _storage_bytes([*reduced, *fsdp.unsynced_grads(module)])


def pending_optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes the optimizer's state will take once created (its first ``step()``), while none exists yet:
    AdamW keeps two moments per element, SGD with momentum one (in each parameter's dtype, on its local
    shard). A step measured before the state exists peaks without it; later steps carry it."""
    if optimizer is None or optimizer.state:
        return 0
    moments = 2 if isinstance(optimizer, torch.optim.AdamW) else (
        1 if isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("momentum") else 0
    )
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return moments * sum(local_tensor(p).numel() * p.element_size() for p in params)


def resident_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """What a model keeps on this rank between its steps: its (local shards of) parameters and buffers and its
    optimizer's state (as it is, or as it will be after the first step)."""
    state = [t for s in (optimizer.state.values() if optimizer is not None else ()) for t in s.values()
             if isinstance(t, torch.Tensor)]
    return (_storage_bytes([*module.parameters(), *module.buffers(), *state])
            + pending_optimizer_state_bytes(optimizer))


def unsharded_param_bytes(module: nn.Module) -> int:
    """Bytes of FSDP2 all-gather outputs currently allocated (parameters held unsharded)."""
    return _storage_bytes(fsdp.gathered_params(module))


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

    def _close_microbatch(self) -> None:
        """The micro-batch's own peak, less the gradients it created that stay (the step's first micro-batch
        allocates them, or a deferred one its accumulators): those are the sync mode's bytes, not activations --
        counted as activations, a small model's tiny batch measured 1.8x the activation model."""
        if self._open is not None:
            positions, start, grads = self._open
            left = max(grad_bytes(self.model) - grads, 0)
            self.microbatches.append((positions, max(self._current_peak() - start - left, 0)))
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
        return held + _storage_bytes(fsdp.accumulators(self.model))

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


# ------------------------------------------------------------------------------------------------
# Budget
# ------------------------------------------------------------------------------------------------
def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_memory_bytes(device: torch.device, local_world_size: int) -> int:
    """This rank's share of the device: the GPU's total memory, or available RAM split over local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    available = _meminfo_bytes("MemAvailable")
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available // max(local_world_size, 1)


def resolve_budget(value: float, device: torch.device, local_world_size: int) -> int:
    """``sync.memory_budget`` in bytes: 0 = 90% of this rank's share of the device, (0, 1] = that fraction
    of it, > 1 = bytes."""
    if value < 0:
        raise ValueError(f"sync.memory_budget: must be >= 0, got {value}")
    if value > 1:
        return int(value)
    share = device_memory_bytes(device, local_world_size)
    return int(share * (value if value > 0 else 0.9))


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
