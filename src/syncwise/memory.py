"""What each sync mode holds in memory: a byte estimator, measurements from the tensors, and the budget.

Deferring sync keeps each FSDP unit's gradient *unsharded* in the accumulation dtype (the reduce dtype,
fp32 by default: 4 bytes x every parameter, on every rank, whatever the world size) until the syncing
micro-batch; per-micro-batch sync holds only the 1/W shard. ``deferred_unsharded`` additionally keeps the
all-gathered parameters (param dtype) between micro-batches. ``replica_deferred`` (HSDP) reduce-scatters
every time and holds only a sharded partial sum.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from .sync import SyncMode, fsdp2_units

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------------------------------------
# Estimator
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardedModel:
    """What the estimator needs: per FSDP unit, its parameter shapes; dtypes; shard-group size."""

    unit_shapes: tuple[tuple[tuple[int, ...], ...], ...]  # unit -> parameter shapes
    shard_size: int  # ranks a parameter is sharded over (W, or W / replicas for HSDP)
    param_dtype: str = "float32"  # compute / all-gather dtype
    reduce_dtype: str = "float32"  # gradient reduction and accumulation dtype
    orig_dtype: str = "float32"  # sharded parameters and their gradients

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for unit in self.unit_shapes for s in unit)

    def unit_padded_numels(self) -> list[int]:
        """All-gathered elements per unit: FSDP2 pads each parameter's dim 0 to a multiple of the shard size."""
        return [sum(_padded(shape, self.shard_size) for shape in unit) for unit in self.unit_shapes]

    def padded_numel(self) -> int:
        return sum(self.unit_padded_numels())

    def retained_grad_bytes(self, mode: SyncMode, num_microbatches: int) -> int:
        """Most gradient bytes held after any micro-batch's backward within a step."""
        sharded = self.padded_numel() // self.shard_size * DTYPE_BYTES[self.orig_dtype]
        if num_microbatches <= 1 or mode is SyncMode.PER_MICROBATCH:
            return sharded
        if mode is SyncMode.REPLICA_DEFERRED:  # a sharded partial sum in the reduce dtype
            return max(sharded, self.padded_numel() // self.shard_size * DTYPE_BYTES[self.reduce_dtype])
        accumulate = DTYPE_BYTES[self.reduce_dtype]  # FSDP2 upcasts the held gradient to the reduce dtype
        return max(sharded, self.num_params * accumulate)

    def unsharded_param_bytes(self, mode: SyncMode, num_microbatches: int) -> int:
        """All-gathered parameter bytes still held after a non-final micro-batch's backward."""
        if mode is not SyncMode.DEFERRED_UNSHARDED or num_microbatches <= 1:
            return 0
        return self.padded_numel() * DTYPE_BYTES[self.param_dtype]

    def extra_bytes(self, mode: SyncMode, num_microbatches: int) -> int:
        """Bytes ``mode`` holds beyond ``per_microbatch`` (what it adds to the peak)."""
        base = self.retained_grad_bytes(SyncMode.PER_MICROBATCH, num_microbatches)
        return (
            self.retained_grad_bytes(mode, num_microbatches) - base
            + self.unsharded_param_bytes(mode, num_microbatches)
        )


def _padded(shape: tuple[int, ...], shard_size: int) -> int:
    if not shape:
        return shard_size  # a scalar becomes one element per rank
    rows = math.ceil(shape[0] / shard_size) * shard_size
    return rows * math.prod(shape[1:])


def sharded_model_of(
    units: Iterable[nn.Module], shard_size: int, param_dtype: str, reduce_dtype: str
) -> ShardedModel:
    """Estimator input from modules that are (or will be) FSDP units; each parameter counted once, in the
    innermost unit that holds it (as ``fully_shard`` assigns them)."""
    units = list(units)
    seen: set[int] = set()
    shapes: list[tuple[tuple[int, ...], ...]] = []
    for unit in reversed(units):  # inner units (layers) before the root
        own = []
        for param in unit.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                own.append(tuple(param.shape))  # a DTensor's shape is the global one
        shapes.append(tuple(own))
    return ShardedModel(tuple(reversed(shapes)), shard_size, param_dtype, reduce_dtype)


# ------------------------------------------------------------------------------------------------
# Measurement from the tensors themselves
# ------------------------------------------------------------------------------------------------
def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def fsdp2_accumulators(module: nn.Module) -> Iterator[torch.Tensor]:
    """Gradients FSDP2 accumulates outside any parameter's ``.grad``: HSDP's partial reduce outputs
    (reduce-scattered, not yet all-reduced) and the reduce-dtype accumulators of deferred units whose
    parameters compute in another dtype (``unsharded_accumulated_grad``)."""
    for unit in fsdp2_units(module):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            if group._partial_reduce_output is not None:
                yield group._partial_reduce_output
            for fsdp_param in group.fsdp_params:
                if fsdp_param.unsharded_accumulated_grad is not None:
                    yield fsdp_param.unsharded_accumulated_grad


def _unsynced_grads(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from fsdp2_accumulators(module)
    for unit in fsdp2_units(module):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None and unsharded.grad is not None:
                    yield unsharded.grad
    for owner in FSDP1.fsdp_modules(module):
        handle = owner._handle
        flat = handle.flat_param if handle is not None else None
        # Under no_sync FSDP1 keeps the unsharded gradient on the flat parameter itself.
        if flat is not None and flat.grad is not None and flat.grad.numel() != flat._sharded_size.numel():
            yield flat.grad


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views, e.g. FSDP1's per-parameter grads, once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = local_tensor(tensor).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def unsynced_grad_bytes(module: nn.Module) -> int:
    """Bytes of gradient accumulated locally and not yet fully reduced."""
    return _storage_bytes(_unsynced_grads(module))


def grad_bytes(module: nn.Module) -> int:
    """All gradient bytes this rank holds: reduced (sharded or replicated) ``.grad`` plus unsynced ones."""
    reduced = (p.grad for p in module.parameters() if p.grad is not None)
    return _storage_bytes([*reduced, *_unsynced_grads(module)])


def unsharded_param_bytes(module: nn.Module) -> int:
    """Bytes of FSDP2 all-gather outputs currently allocated (parameters held unsharded)."""
    outputs = (
        tensor
        for unit in fsdp2_units(module)
        for group in unit._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
        for tensor in fsdp_param.all_gather_outputs
    )
    return _storage_bytes(outputs)


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
        self.held_between_microbatches = 0  # most memory in use between two micro-batches (CPU tracker)

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
            self._tracker = FSDPMemTracker(self.model, self.optimizer)
        else:
            self._tracker = MemTracker()
            self._tracker.track_external(self.model, self.optimizer)
        self._tracker.__enter__()
        return self

    def before_microbatch(self) -> None:
        # FSDPMemTracker raises on a module's second forward unless its per-module stats are reset.
        if self._tracker is not None:
            self.held_between_microbatches = max(self.held_between_microbatches, self._held_now())
            self._tracker.reset_mod_stats()

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
        return held + _storage_bytes(fsdp2_accumulators(self.model))

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        self._tracker.__exit__(*exc)
        snapshot = self._tracker.get_tracker_snapshot("peak")
        self.peak = max((dev["Total"] for dev in snapshot.values()), default=0)
        self._tracker = None


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
