"""Bytes of gradient held by a wrapped model: what deferral costs, measured from the tensors themselves.

With sync deferred, FSDP2 keeps each unit's gradient *unsharded* in the reduce dtype (fp32 by default:
4 bytes x every parameter, on every rank, whatever the world size) until the syncing micro-batch; with
per-micro-batch sync only the sharded gradient (4/W bytes per parameter) is held.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from .sync import fsdp2_units


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _unsynced_grads(module: nn.Module) -> Iterator[torch.Tensor]:
    for unit in fsdp2_units(module):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                if fsdp_param.unsharded_accumulated_grad is not None:
                    yield fsdp_param.unsharded_accumulated_grad
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None and unsharded.grad is not None:
                    yield unsharded.grad
    for owner in FSDP1.fsdp_modules(module):
        handle = owner._handle
        flat = handle.flat_param if handle is not None else None
        # Under no_sync FSDP1 keeps the unsharded gradient on the flat parameter itself.
        if flat is not None and flat.grad is not None and flat.grad.numel() != flat._sharded_size.numel():
            yield flat.grad


def _storage_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views, e.g. FSDP1's per-parameter grads, once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def unsynced_grad_bytes(module: nn.Module) -> int:
    """Bytes of gradient accumulated locally and not yet reduced (FSDP2 unsharded grads, FSDP1 no_sync)."""
    return _storage_bytes(_unsynced_grads(module))


def grad_bytes(module: nn.Module) -> int:
    """All gradient bytes this rank holds: reduced (sharded or replicated) ``.grad`` plus unsynced ones."""
    reduced = (p.grad for p in module.parameters() if p.grad is not None)
    return _storage_bytes(iter([*reduced, *_unsynced_grads(module)]))
