"""The gradient-sync context: skip gradient communication for a micro-batch, and always put state back.

``gradient_sync(module, enabled=False)`` is what the engine wraps around the forward *and* backward of
every non-final micro-batch (wrapping only backward does nothing for DDP, which prepares its reducer in
forward). On exit -- normal or by exception -- every FSDP2 unit gets back the flags it had on entry, not
just ``True``, so nested use and callers that had already turned sync off are not surprised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from enum import Enum

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn.parallel import DistributedDataParallel as DDP


class SyncMode(str, Enum):
    """When gradients are communicated across the micro-batches of one optimizer step."""

    PER_MICROBATCH = "per_microbatch"  # reduce-scatter after every micro-batch: least memory
    DEFERRED = "deferred"  # accumulate locally, one reduce-scatter on the last micro-batch

    def syncs(self, microbatch_index: int, num_microbatches: int) -> bool:
        """Whether micro-batch ``microbatch_index`` (0-based) communicates its gradients."""
        if self is SyncMode.PER_MICROBATCH:
            return True
        return microbatch_index == num_microbatches - 1


def fsdp2_units(module: nn.Module) -> list[FSDPModule]:
    """Every ``fully_shard``-ed module under (and including) ``module``."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _outermost(module: nn.Module, kinds: tuple[type, ...]) -> list[nn.Module]:
    """Instances of ``kinds`` not nested inside another instance (the roots ``no_sync`` must be called on)."""
    if isinstance(module, kinds):
        return [module]
    found: list[nn.Module] = []
    for child in module.children():
        found.extend(_outermost(child, kinds))
    return found


def fsdp2_sync_flags(unit: FSDPModule) -> list[tuple[bool, bool]]:
    """(reduce_grads, all_reduce_grads) of each parameter group of an FSDP2 unit.

    FSDP2 has setters but no getters for these; restoring the *previous* value needs them.
    """
    state = unit._get_fsdp_state()
    return [(g.reduce_grads, g.all_reduce_grads) for g in state._fsdp_param_groups]


def restore_fsdp2_sync_flags(unit: FSDPModule, flags: list[tuple[bool, bool]]) -> None:
    """Put back flags read by :func:`fsdp2_sync_flags`, through the public setters where possible."""
    if not flags:
        return
    if len(set(flags)) == 1:
        reduce_grads, all_reduce_grads = flags[0]
        unit.set_requires_gradient_sync(reduce_grads, recurse=False)
        if all_reduce_grads != reduce_grads:
            unit.set_requires_all_reduce(all_reduce_grads, recurse=False)
        return
    # Groups of one unit disagree (only possible through private edits): restore each as it was.
    for group, (reduce_grads, all_reduce_grads) in zip(unit._get_fsdp_state()._fsdp_param_groups, flags, strict=True):
        group.reduce_grads = reduce_grads
        group.all_reduce_grads = all_reduce_grads


def discard_unsynced_grads(module: nn.Module) -> None:
    """Drop gradients FSDP2 accumulated locally under ``no sync`` but never reduced.

    They live on FSDP2's unsharded parameters (``unsharded_param.grad``, or ``unsharded_accumulated_grad``
    when the reduce dtype differs), out of reach of ``optimizer.zero_grad()`` and of
    ``reset_iter_state()``; after an aborted deferred step they would leak into the next one.
    """
    for unit in fsdp2_units(module):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Run the body with gradient synchronisation ``enabled`` or skipped.

    - FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` on every FSDP unit found under
      ``module`` -- the root need not be an ``FSDPModule`` (PEFT or user wrappers) -- and each unit's
      previous flags restored on exit.
    - FSDP1 and DDP: their own ``no_sync()``, entered on the outermost wrapped instances.
    - Anything else, or ``enabled=True``: a no-op.
    """
    if enabled:
        yield
        return
    no_sync_roots = _outermost(module, (FSDP1, DDP))
    units = fsdp2_units(module)
    saved = [(unit, fsdp2_sync_flags(unit)) for unit in units]
    with ExitStack() as stack:
        for root in no_sync_roots:
            stack.enter_context(root.no_sync())
        try:
            for unit in units:
                unit.set_requires_gradient_sync(False, recurse=False)
            yield
        finally:
            for unit, flags in saved:
                restore_fsdp2_sync_flags(unit, flags)
