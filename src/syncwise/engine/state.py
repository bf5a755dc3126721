"""The engine's state for a checkpoint: its model and optimizer for ``torch.distributed.checkpoint`` (sharded
DTensors under FSDP2, the adapters alone under LoRA, the frozen base only once training changed it:
``with_frozen``), and the rest a resumed run needs to continue exactly (:func:`resume_state`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..memory.units import unit_names
from ..sync.modes import SyncChoice, SyncMode

if TYPE_CHECKING:
    from . import Engine


def _options(lora: bool, with_frozen: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=lora and not with_frozen, strict=not lora)


def model_and_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, lora: bool,
                          with_frozen: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_options(lora, with_frozen))}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(lora, with_frozen))
    return {"model": model_sd, "optim": optim_sd}


def load_model_and_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any],
                               lora: bool, with_frozen: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(model, state["model"], options=_options(lora, with_frozen))
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(lora, with_frozen))


def resume_state(engine: Engine) -> dict[str, Any]:
    """The step count, the LR schedule's position, and auto's decision and measured base (a resumed run measures
    nothing again): JSON-serialisable."""
    return {
        "step": engine.step,
        "skipped_steps": engine.skipped_steps,
        "scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
        "active_mode": engine.active_mode.mode.value,
        "active_units": sorted(engine.active_mode.units),
        **engine.governor.state(),
    }


def load_resume_state(engine: Engine, state: dict[str, Any]) -> None:
    """:func:`resume_state`'s ``state`` put back. The configured sync.mode wins: auto's saved decision is restored
    only while the config still says auto, and only where this run can execute it (the strategy or the model may
    have changed since)."""
    engine.step = int(state["step"])
    engine.skipped_steps = int(state["skipped_steps"])
    if engine.scheduler is not None and state.get("scheduler") is not None:
        engine.scheduler.load_state_dict(state["scheduler"])
    saved = SyncChoice(SyncMode(state["active_mode"]), frozenset(state.get("active_units", ())))
    if engine.sync_mode is not SyncMode.AUTO:  # a head or cap auto chooses is chosen again, from a new peak
        engine.governor.base_peak = state.get("base_peak")  # measured without any mode's extra: still true
        return
    units = set(unit_names(engine.model, engine.wrapped.units))
    if saved.mode in engine.supported_modes and saved.units <= units:
        engine.governor.load_state(state)
        engine._use(engine.governor.setting)
        if state.get("auto", {}).get("trial_cut_short") and engine.info.is_main:
            print(f"syncwise: {engine.governor.auto.decisions[-1]}", flush=True)
    elif engine.info.is_main:
        print(f"syncwise: the checkpoint's sync mode {saved.label} cannot run here "
              f"(engine.strategy={engine.config.engine.strategy}); sync.mode=auto decides again", flush=True)
