"""The one module that reads or writes FSDP's private state.

FSDP2 (``fully_shard``) has setters for its per-unit switches but no getters, keeps the gradients it
accumulates without syncing out of reach of ``optimizer.zero_grad()``, and resolves its root lazily; FSDP1
keeps an unsynced gradient on a flat parameter. Everything syncwise needs from those internals is here,
behind plain functions, checked against the torch versions it supports (:func:`require_supported_torch`).
No other module touches an FSDP attribute that starts with an underscore.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

# The oldest torch the whole test suite ran on (docs/design.md; `make test-torch-floor` runs it there). Where
# torch 2.11 differs, this module reads both: one parameter group per unit (``_fsdp_param_group``, not
# ``_fsdp_param_groups``) and no public ``reset_iter_state`` (:func:`_reset_iter_state_by_hand`).
MIN_TORCH = (2, 11)

# What this module reads or writes on FSDP2's state, its parameter groups and their parameters.
_GROUP_ATTRS = ("reduce_grads", "all_reduce_grads", "reshard_after_backward", "post_forward_mesh_info",
                "_partial_reduce_output", "fsdp_params")
_PARAM_ATTRS = ("unsharded_accumulated_grad", "all_gather_outputs")


class UnsupportedTorchError(RuntimeError):
    """The installed torch lacks FSDP2 internals syncwise relies on."""


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def require_supported_torch(unit: FSDPModule | None = None) -> None:
    """Raise a clear error below :data:`MIN_TORCH`, or when ``unit``'s FSDP2 state lacks what syncwise reads
    (a development build that moved it)."""
    found = torch.__version__
    wanted = ".".join(map(str, MIN_TORCH))
    if torch_version() < MIN_TORCH:
        raise UnsupportedTorchError(
            f"syncwise needs torch>={wanted} for FSDP2 (found {found}); install a newer torch"
        )
    if unit is None:
        return
    state = unit._get_fsdp_state()
    missing = [a for a in ("_is_root", "_auto_reshard_after_forward", "_lazy_init") if not hasattr(state, a)]
    if not hasattr(state, "_fsdp_param_groups") and not hasattr(state, "_fsdp_param_group"):
        missing.append("_fsdp_param_groups")
    for group in _groups(unit):
        missing += [f"group.{a}" for a in _GROUP_ATTRS if not hasattr(group, a)]
        for param in group.fsdp_params:
            missing += [f"param.{a}" for a in _PARAM_ATTRS if not hasattr(param, a)]
    if missing:
        raise UnsupportedTorchError(
            f"torch {found}: its FSDP2 lacks {', '.join(sorted(set(missing)))}, which syncwise reads; "
            f"use a released torch>={wanted}"
        )


# ------------------------------------------------------------------------------------------------
# Units
# ------------------------------------------------------------------------------------------------
def fsdp2_units(module: nn.Module) -> list[FSDPModule]:
    """Every ``fully_shard``-ed module under (and including) ``module``, outermost first."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _groups(unit: FSDPModule) -> list[Any]:
    """The unit's FSDP2 parameter groups (torch before 2.13 kept a single ``_fsdp_param_group``)."""
    return _groups_of_state(unit._get_fsdp_state())


def _groups_of_state(state: Any) -> list[Any]:
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def has_params(unit: FSDPModule) -> bool:
    """Whether the unit manages parameters of its own (not only nested units')."""
    return any(group.fsdp_params for group in _groups(unit))


def init_root(root: FSDPModule) -> None:
    """Resolve the root now rather than at the first forward: the sync modes save and restore reshard
    switches, and the root's own (kept unsharded after forward) is only set by this initialisation."""
    root._get_fsdp_state()._lazy_init()
    require_supported_torch(root)


def reshard_all(module: nn.Module) -> None:
    """Free every gathered parameter. After a forward-only pass FSDP2 keeps the root gathered (it expects
    the backward that would use it), which would hold the largest unit on every rank until the next step."""
    for unit in fsdp2_units(module):
        unit.reshard()


def _reset_root(module: nn.Module) -> None:
    for unit in fsdp2_units(module):
        state = unit._get_fsdp_state()
        if not state._is_root:
            continue
        if hasattr(unit, "reset_iter_state"):
            unit.reset_iter_state()
        else:
            _reset_iter_state_by_hand(state)


def _reset_iter_state_by_hand(root_state: Any) -> None:
    """What ``FSDPModule.reset_iter_state`` (torch 2.13) does, for a torch that lacks it (2.11): wait for the
    collectives in flight, clear the iteration's trackers and training states, reshard every group and drop its
    partial reduce output. The failed iteration's gradients are lost, as there."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    comm = root_state._comm_ctx
    stream = root_state._device_handle.current_stream()
    for name in ("all_gather_state", "reduce_scatter_state"):
        pending = getattr(comm, name, None)
        if pending is not None and pending.event is not None:
            stream.wait_event(pending.event)
        setattr(comm, name, None)
    comm.post_forward_order.clear()
    for state in root_state._state_ctx.all_states:
        state._modules_to_run_forward.clear()
        state._training_state = TrainingState.IDLE
        for group in _groups_of_state(state):
            group.finalize_backward()  # waits for its reduce-scatter / all-reduce and any stray all-gather
            if group._reshard_after_forward_event is not None:
                group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
                group._reshard_after_forward_event = None
            group._partial_reduce_output = None
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    root_state._state_ctx.iter_forward_root = None
    root_state._state_ctx.post_backward_final_callback_queued = False


def reset_after_error(module: nn.Module) -> None:
    """After an exception mid-step: FSDP2's per-iteration state reset on the root, and the gradients it
    accumulated without syncing dropped (``zero_grad`` cannot reach them; they would leak into the next
    step)."""
    _reset_root(module)
    discard_unsynced_grads(module)


def reset_after_forward_error(module: nn.Module) -> None:
    """After an exception in a forward-only pass: FSDP2's forward trackers reset and its parameters
    resharded, but every gradient accumulated so far kept -- a failed evaluation must not cost training
    anything. (``reset_iter_state`` also drops HSDP's partial reduce outputs: they are put back.)"""
    groups = [g for unit in fsdp2_units(module) for g in _groups(unit)]
    partial = [g._partial_reduce_output for g in groups]
    _reset_root(module)
    for group, output in zip(groups, partial, strict=True):
        group._partial_reduce_output = output


# ------------------------------------------------------------------------------------------------
# Switches: FSDP2 has setters for these, no getters
# ------------------------------------------------------------------------------------------------
def sync_flags(unit: FSDPModule) -> list[tuple[bool, bool]]:
    """(reduce_grads, all_reduce_grads) of each parameter group of an FSDP2 unit."""
    return [(g.reduce_grads, g.all_reduce_grads) for g in _groups(unit)]


def restore_sync_flags(unit: FSDPModule, flags: list[tuple[bool, bool]]) -> None:
    """Put back flags read by :func:`sync_flags`, through the public setters where possible."""
    if not flags:
        return
    if len(set(flags)) == 1:
        reduce_grads, all_reduce_grads = flags[0]
        unit.set_requires_gradient_sync(reduce_grads, recurse=False)
        if all_reduce_grads != reduce_grads:
            unit.set_requires_all_reduce(all_reduce_grads, recurse=False)
        return
    # Groups of one unit disagree (only possible through private edits): restore each as it was.
    for group, (reduce_grads, all_reduce_grads) in zip(_groups(unit), flags, strict=True):
        group.reduce_grads = reduce_grads
        group.all_reduce_grads = all_reduce_grads


def reshard_flags(unit: FSDPModule) -> dict[str, Any]:
    """Reshard switches of an FSDP2 unit: per group (after-backward flag, post-forward mesh) and the root
    heuristic flag. Restored verbatim: ``set_reshard_after_forward`` would also clear the heuristic."""
    state = unit._get_fsdp_state()
    return {
        "groups": [(g.reshard_after_backward, g.post_forward_mesh_info) for g in _groups(unit)],
        "auto": state._auto_reshard_after_forward,
    }


def restore_reshard_flags(unit: FSDPModule, flags: dict[str, Any]) -> None:
    state = unit._get_fsdp_state()
    for group, (after_backward, post_forward_mesh_info) in zip(_groups(unit), flags["groups"], strict=True):
        group.reshard_after_backward = after_backward
        group.post_forward_mesh_info = post_forward_mesh_info
    state._auto_reshard_after_forward = flags["auto"]


# ------------------------------------------------------------------------------------------------
# Gradients and parameters FSDP holds outside ``.grad``
# ------------------------------------------------------------------------------------------------
def accumulators(module: nn.Module) -> Iterator[torch.Tensor]:
    """Gradients FSDP2 accumulates outside any parameter's ``.grad``: HSDP's partial reduce outputs
    (reduce-scattered, not yet all-reduced) and the reduce-dtype accumulators of deferred units whose
    parameters compute in another dtype (``unsharded_accumulated_grad``)."""
    for unit in fsdp2_units(module):
        for group in _groups(unit):
            if group._partial_reduce_output is not None:
                yield group._partial_reduce_output
            for fsdp_param in group.fsdp_params:
                if fsdp_param.unsharded_accumulated_grad is not None:
                    yield fsdp_param.unsharded_accumulated_grad


def unsynced_grads(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every gradient accumulated locally and not yet fully reduced (FSDP2 and FSDP1)."""
    yield from accumulators(module)
    for unit in fsdp2_units(module):
        for group in _groups(unit):
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


def discard_unsynced_grads(module: nn.Module) -> None:
    """Drop gradients FSDP2 accumulated locally but never reduced (see :func:`reset_after_error`)."""
    for unit in fsdp2_units(module):
        for group in _groups(unit):
            group._partial_reduce_output = None
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


def gathered_params(module: nn.Module) -> Iterator[torch.Tensor]:
    """FSDP2's all-gather outputs: the parameters a unit currently holds unsharded."""
    for unit in fsdp2_units(module):
        for group in _groups(unit):
            for fsdp_param in group.fsdp_params:
                yield from fsdp_param.all_gather_outputs
