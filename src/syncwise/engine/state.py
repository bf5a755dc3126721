"""The engine's model and optimizer state for ``torch.distributed.checkpoint``: sharded DTensors under FSDP2,
the adapters alone under LoRA (the frozen base only once training changed it: ``with_frozen``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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
