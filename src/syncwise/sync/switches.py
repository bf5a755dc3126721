"""Apply a sync mode's switches around one micro-batch, and restore what was there before.

The heart is :func:`gradient_sync`, which the engine wraps around the forward *and* backward of every
non-final micro-batch (wrapping only backward does nothing for DDP, which prepares its reducer in
forward). :func:`apply_switches` generalises it to every mode of :mod:`syncwise.sync.modes`: each FSDP2 unit
gets the switches the mode gives it for this micro-batch. On exit -- normal or by exception -- every
unit gets back exactly the flags it had on entry, not just ``True``, so nested use and callers that had
already changed them are not surprised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn.parallel import DistributedDataParallel as DDP

from . import fsdp_internals as fsdp
from .modes import SYNC, Switches, SyncChoice, spec

SwitchesFor = Callable[[FSDPModule], Switches]


def _outermost(module: nn.Module, kinds: tuple[type, ...]) -> list[nn.Module]:
    """Instances of ``kinds`` not nested inside another instance (the roots ``no_sync`` must be called on)."""
    if isinstance(module, kinds):
        return [module]
    found: list[nn.Module] = []
    for child in module.children():
        found.extend(_outermost(child, kinds))
    return found


@contextmanager
def apply_switches(module: nn.Module, switches_for: Switches | SwitchesFor) -> Iterator[None]:
    """Run the body with each FSDP2 unit under ``module`` switched as ``switches_for(unit)`` says (or all
    alike, given one :class:`~syncwise.sync.modes.Switches`); every unit's previous switches come back on exit.

    FSDP1 and DDP (which only know "sync or not") get ``no_sync()`` when the switches turn sync off.
    """
    units = fsdp.fsdp2_units(module)
    if isinstance(switches_for, Switches):
        uniform = switches_for
        plan = [(unit, uniform) for unit in units]
    else:
        plan = [(unit, switches_for(unit)) for unit in units]
        uniform = plan[0][1] if plan and all(s == plan[0][1] for _, s in plan) else None
    plan = [(unit, s) for unit, s in plan if s != SYNC]
    no_sync = uniform is not None and not uniform.sync_grads
    if not plan and not no_sync:
        yield
        return
    saved_sync = [(unit, fsdp.sync_flags(unit)) for unit, _ in plan]
    saved_reshard = [
        (unit, fsdp.reshard_flags(unit)) for unit, s in plan
        if s.reshard_after_backward is not None or s.reshard_after_forward is not None
    ]
    with ExitStack() as stack:
        if no_sync:
            for root in _outermost(module, (FSDP1, DDP)):
                stack.enter_context(root.no_sync())
        try:
            for unit, switches in plan:
                if not switches.sync_grads:
                    unit.set_requires_gradient_sync(False, recurse=False)
                elif not switches.all_reduce_grads:
                    unit.set_requires_all_reduce(False, recurse=False)
                if switches.reshard_after_backward is not None:
                    unit.set_reshard_after_backward(switches.reshard_after_backward, recurse=False)
                if switches.reshard_after_forward is not None:
                    unit.set_reshard_after_forward(switches.reshard_after_forward, recurse=False)
            yield
        finally:
            for unit, flags in saved_sync:
                fsdp.restore_sync_flags(unit, flags)
            for unit, flags in saved_reshard:
                fsdp.restore_reshard_flags(unit, flags)


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Run the body with gradient synchronisation ``enabled`` or skipped.

    - FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` on every FSDP unit found under
      ``module`` -- the root need not be an ``FSDPModule`` (PEFT or user wrappers) -- and each unit's
      previous flags restored on exit.
    - FSDP1 and DDP: their own ``no_sync()``, entered on the outermost wrapped instances.
    - Anything else, or ``enabled=True``: a no-op.
    """
    with apply_switches(module, SYNC if enabled else Switches(sync_grads=False, all_reduce_grads=False)):
        yield


def switches_of(choice: SyncChoice, units: list[nn.Module], unsharded_forward: bool):
    """(micro-batch index, count) -> the switches ``choice`` gives each unit of ``units`` (FSDP1 / DDP, which
    know only one set for the whole model: the same for all)."""
    index = {id(unit): k for k, unit in enumerate(units)}

    def switches(i: int, num_microbatches: int) -> Switches | SwitchesFor:
        if not spec(choice.mode).per_unit:
            return choice.switches(i, num_microbatches, 0, unsharded_forward)
        return lambda unit: choice.switches(i, num_microbatches, index.get(id(unit), -1), unsharded_forward)

    return switches
