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
from torch import nn

from ..runtime.distributed import local_tensor
from ..sync import fsdp_internals as fsdp
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

    def gathered_through_backward(self, mode: SyncMode | SyncChoice, unsharded_forward: bool = True) -> int:
        """In a step of one micro-batch: the parameter bytes ``mode`` keeps gathered from its forward through its
        backward (its last micro-batch's switches: ``deferred_unsharded`` with ``sync.unsharded_forward`` keeps
        every unit) beyond what ``per_microbatch`` has gathered at its peak: the root and two layers on several ranks
        (a layer's backward prefetching the next, :func:`syncwise.memory.plan.in_flight_bytes`), the root and one
        at one rank (FSDP2 prefetches no all-gather there: the CPU tracker's categories on qwen2-tiny, where
        counting two predicted 2% under the peak).
        """
        choice = as_choice(mode)
        numels = self._padded[0]
        kept = [u for u in range(1, len(numels))
                if choice.switches(0, 1, u, unsharded_forward).reshard_after_forward is False]
        if not kept:  # (FSDP2 gathers into buffers of its own at one rank too)
            return 0
        in_flight = 2 if self.shard_size > 1 else 1
        return max(0, sum(numels[u] for u in kept) - in_flight * max(numels[1:])) * DTYPE_BYTES[self.param_dtype]

    def peak_extra_bytes(self, mode: SyncMode | SyncChoice, num_microbatches: int, root_in_base: bool = True) -> int:
        """What ``mode`` adds to a ``per_microbatch`` peak: :meth:`extra_bytes` but, where that peak has them
        (``root_in_base``: a measured peak, or a plan's with FSDP2's bytes in flight), the root's gathered
        parameters -- FSDP keeps the root gathered from its forward to its backward in every mode (measured
        on a Llama and a GPT-2 directory with a 32000-token tied embedding, 2 ranks, 7 micro-batches:
        ``deferred_unsharded`` adds exactly this to ``per_microbatch``'s peak)."""
        root = self.root_gathered_bytes(mode, num_microbatches) if root_in_base else 0
        return self.extra_bytes(mode, num_microbatches) - root


def sharded_dim(shape: tuple[int, ...], ranks: int) -> int:
    """The dimension FSDP2 shards a parameter of ``shape`` on over ``ranks``: 0, but for a mixture of experts' fused
    experts ([experts, ...], 3-D) where the ranks outnumber the experts -- on dim 0 some would hold only padding --
    the next one (the engine's placement, :func:`syncwise.engine.wrap.expert_placement`)."""
    return 1 if len(shape) == 3 and shape[0] < ranks <= shape[1] else 0


def _padded_numel(shape: tuple[int, ...], shard_size: int) -> int:
    """Elements over every rank once FSDP2 pads the sharded dimension (:func:`sharded_dim`) to a multiple of them."""
    if not shape:
        return shard_size  # a scalar becomes one element per rank
    dim = sharded_dim(shape, shard_size)
    padded = math.ceil(shape[dim] / shard_size) * shard_size
    return padded * math.prod(tuple(shape[:dim]) + tuple(shape[dim + 1:]))


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
def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
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
    return storage_bytes([*reduced, *fsdp.unsynced_grads(module)])


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
    return (storage_bytes([*module.parameters(), *module.buffers(), *state])
            + pending_optimizer_state_bytes(optimizer))


def unsharded_param_bytes(module: nn.Module) -> int:
    """Bytes of FSDP2 all-gather outputs currently allocated (parameters held unsharded)."""
    return storage_bytes(fsdp.gathered_params(module))


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
