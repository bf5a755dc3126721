"""When gradients (and parameters) are communicated across the micro-batches of one optimizer step.

The heart is :func:`gradient_sync`, which the engine wraps around the forward *and* backward of every
non-final micro-batch (wrapping only backward does nothing for DDP, which prepares its reducer in
forward). :func:`microbatch_policy` generalises it to every :class:`SyncMode`: which FSDP2 switches a
micro-batch runs with. On exit -- normal or by exception -- every FSDP2 unit gets back exactly the flags it
had on entry, not just ``True``, so nested use and callers that had already changed them are not surprised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn.parallel import DistributedDataParallel as DDP


class SyncMode(str, Enum):
    """When gradients are communicated across the micro-batches of one optimizer step."""

    PER_MICROBATCH = "per_microbatch"  # reduce-scatter after every micro-batch: least memory
    DEFERRED = "deferred"  # accumulate unsharded locally, one reduce-scatter on the last micro-batch
    DEFERRED_UNSHARDED = "deferred_unsharded"  # also keep params unsharded between micro-batches
    REPLICA_DEFERRED = "replica_deferred"  # HSDP: reduce-scatter every time, all-reduce replicas once
    AUTO = "auto"  # the fastest of the above whose predicted peak memory fits the budget

    def syncs(self, microbatch_index: int, num_microbatches: int) -> bool:
        """Whether micro-batch ``microbatch_index`` (0-based) fully communicates its gradients."""
        if self in (SyncMode.PER_MICROBATCH, SyncMode.REPLICA_DEFERRED):
            return self is SyncMode.PER_MICROBATCH or microbatch_index == num_microbatches - 1
        return microbatch_index == num_microbatches - 1


# Fastest first: what `auto` tries, and the order it steps down in.
SPEED_ORDER = (SyncMode.DEFERRED_UNSHARDED, SyncMode.DEFERRED, SyncMode.REPLICA_DEFERRED, SyncMode.PER_MICROBATCH)


def supported_modes(strategy: str, hsdp: bool) -> tuple[SyncMode, ...]:
    """Concrete modes (not ``auto``) a wrapping strategy can run."""
    if strategy == "fsdp2":
        modes = [SyncMode.PER_MICROBATCH, SyncMode.DEFERRED, SyncMode.DEFERRED_UNSHARDED]
        return tuple(modes + [SyncMode.REPLICA_DEFERRED] if hsdp else modes)
    return (SyncMode.PER_MICROBATCH, SyncMode.DEFERRED)


def check_mode(mode: SyncMode, strategy: str, hsdp: bool) -> None:
    """Raise a clear error when ``strategy`` cannot run ``mode``."""
    if mode is SyncMode.AUTO:
        return
    allowed = supported_modes(strategy, hsdp)
    if mode not in allowed:
        why = {
            SyncMode.REPLICA_DEFERRED: "it defers only the cross-replica all-reduce, which needs FSDP2 with HSDP "
            "(engine.strategy=fsdp2, engine.hsdp_replicas > 1)",
            SyncMode.DEFERRED_UNSHARDED: "it needs FSDP2's set_reshard_after_backward (engine.strategy=fsdp2)",
        }.get(mode, "")
        raise ValueError(
            f"sync.mode={mode.value!r} is not available with engine.strategy={strategy!r}"
            f"{' and HSDP' if hsdp else ''}: {why}; choose one of {', '.join(m.value for m in allowed)} or auto"
        )


@dataclass(frozen=True)
class MicroBatchPolicy:
    """The FSDP switches one micro-batch runs with (None: leave as configured)."""

    sync_grads: bool = True  # reduce-scatter (and HSDP all-reduce) in this backward
    all_reduce_grads: bool = True  # HSDP cross-replica all-reduce in this backward
    reshard_after_backward: bool | None = None
    reshard_after_forward: bool | None = None


def microbatch_policy(
    mode: SyncMode, index: int, num_microbatches: int, unsharded_forward: bool = False
) -> MicroBatchPolicy:
    """The switches for micro-batch ``index`` of ``num_microbatches`` under a concrete ``mode``."""
    last = index == num_microbatches - 1
    if mode is SyncMode.PER_MICROBATCH or (last and mode is not SyncMode.DEFERRED_UNSHARDED):
        return MicroBatchPolicy()
    if mode is SyncMode.DEFERRED:
        return MicroBatchPolicy(sync_grads=False, all_reduce_grads=False)
    if mode is SyncMode.REPLICA_DEFERRED:
        return MicroBatchPolicy(all_reduce_grads=False)
    if mode is SyncMode.DEFERRED_UNSHARDED:
        # The last micro-batch syncs and reshards after backward, but still skips the gather that resharding
        # after its forward would force on its backward.
        keep_forward = False if unsharded_forward else None
        if last:
            return MicroBatchPolicy(reshard_after_forward=keep_forward)
        return MicroBatchPolicy(
            sync_grads=False, all_reduce_grads=False, reshard_after_backward=False,
            reshard_after_forward=keep_forward,
        )
    raise ValueError(f"no micro-batch policy for {mode!r}; resolve 'auto' first")


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


def fsdp2_reshard_flags(unit: FSDPModule) -> dict[str, Any]:
    """Reshard switches of an FSDP2 unit: per group (after-backward flag, post-forward mesh) and the
    root heuristic flag. Restored verbatim: ``set_reshard_after_forward`` would also clear the heuristic."""
    state = unit._get_fsdp_state()
    return {
        "groups": [(g.reshard_after_backward, g.post_forward_mesh_info) for g in state._fsdp_param_groups],
        "auto": state._auto_reshard_after_forward,
    }


def restore_fsdp2_reshard_flags(unit: FSDPModule, flags: dict[str, Any]) -> None:
    state = unit._get_fsdp_state()
    for group, (after_backward, post_forward_mesh_info) in zip(
        state._fsdp_param_groups, flags["groups"], strict=True
    ):
        group.reshard_after_backward = after_backward
        group.post_forward_mesh_info = post_forward_mesh_info
    state._auto_reshard_after_forward = flags["auto"]


def discard_unsynced_grads(module: nn.Module) -> None:
    """Drop gradients FSDP2 accumulated locally but never reduced.

    They live on FSDP2's unsharded parameters (``unsharded_param.grad``, or ``unsharded_accumulated_grad``
    when the reduce dtype differs) and, for HSDP replica deferral, in the groups' partial reduce outputs,
    out of reach of ``optimizer.zero_grad()`` and of ``reset_iter_state()``; after an aborted deferred
    step they would leak into the next one.
    """
    for unit in fsdp2_units(module):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            group._partial_reduce_output = None
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


@contextmanager
def apply_policy(module: nn.Module, policy: MicroBatchPolicy) -> Iterator[None]:
    """Run the body with ``policy``'s switches; every unit's previous switches are restored on exit.

    FSDP2 units get the setters; FSDP1 and DDP (which only know "sync or not") get ``no_sync()`` when
    ``policy.sync_grads`` is off.
    """
    if policy == MicroBatchPolicy():
        yield
        return
    units = fsdp2_units(module)
    saved_sync = [(unit, fsdp2_sync_flags(unit)) for unit in units]
    changes_reshard = policy.reshard_after_backward is not None or policy.reshard_after_forward is not None
    saved_reshard = [(unit, fsdp2_reshard_flags(unit)) for unit in units] if changes_reshard else []
    with ExitStack() as stack:
        if not policy.sync_grads:
            for root in _outermost(module, (FSDP1, DDP)):
                stack.enter_context(root.no_sync())
        try:
            for unit in units:
                if not policy.sync_grads:
                    unit.set_requires_gradient_sync(False, recurse=False)
                elif not policy.all_reduce_grads:
                    unit.set_requires_all_reduce(False, recurse=False)
                if policy.reshard_after_backward is not None:
                    unit.set_reshard_after_backward(policy.reshard_after_backward, recurse=False)
                if policy.reshard_after_forward is not None:
                    unit.set_reshard_after_forward(policy.reshard_after_forward, recurse=False)
            yield
        finally:
            for unit, flags in saved_sync:
                restore_fsdp2_sync_flags(unit, flags)
            for unit, flags in saved_reshard:
                restore_fsdp2_reshard_flags(unit, flags)


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Run the body with gradient synchronisation ``enabled`` or skipped.

    - FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` on every FSDP unit found under
      ``module`` -- the root need not be an ``FSDPModule`` (PEFT or user wrappers) -- and each unit's
      previous flags restored on exit.
    - FSDP1 and DDP: their own ``no_sync()``, entered on the outermost wrapped instances.
    - Anything else, or ``enabled=True``: a no-op.
    """
    policy = MicroBatchPolicy() if enabled else MicroBatchPolicy(sync_grads=False, all_reduce_grads=False)
    with apply_policy(module, policy):
        yield
