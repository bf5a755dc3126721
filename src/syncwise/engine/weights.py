"""The trained model's full weights, one wrapping unit at a time: what the rollout copy is refreshed from.

``get_model_state_dict(full_state_dict=True)`` gathers every parameter before it returns, so a refresh held
the whole model a second time on every rank. Here each unit's parameters are gathered (FSDP2: one
``full_tensor`` per parameter; FSDP1: the unit's flat parameter with ``summon_full_params(recurse=False)``),
handed over and dropped before the next unit's are: the extra memory is one unit's, as verl streams
per-tensor weights into its inference engine. DDP and plain models hand over their own tensors (no copy).
Collective under FSDP: every rank must consume the whole iterator.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from ..models import lora as lora_adapters
from ..models.names import unwrapped_name
from .wrap import WrappedModel


def params_by_unit(wrapped: WrappedModel) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Each unit with the parameters it holds itself (not those of a unit inside it), in the units' order;
    names as the model's ``named_parameters`` gives them."""
    units = wrapped.units
    prefixes = {id(module): name for name, module in wrapped.module.named_modules()}
    owned: dict[int, list[tuple[str, nn.Parameter]]] = {id(u): [] for u in units}
    unit_prefixes = sorted(((prefixes[id(u)], u) for u in units), key=lambda x: -len(x[0]))
    for name, param in wrapped.module.named_parameters():
        for prefix, unit in unit_prefixes:  # the innermost unit whose subtree holds the parameter
            if not prefix or name.startswith(prefix + "."):
                owned[id(unit)].append((name, param))
                break
    return [(u, owned[id(u)]) for u in units]


def full_weights_by_unit(
    wrapped: WrappedModel, lora_merge: lora_adapters.LoraMerge | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Per unit, its parameters unsharded and keyed as the plain model's (LoRA: merged by ``lora_merge``,
    keyed as the base model's; the adapters of a layer live in that layer's unit). Drop each dict before
    asking for the next: that is what keeps the peak at one unit."""
    for unit, params in params_by_unit(wrapped):
        # Not under torch.no_grad(): its generator wrapper keeps the last dict until the next one exists.
        if params:
            yield _gather_unit(wrapped.strategy, unit, params, lora_merge)


@torch.no_grad()
def _gather_unit(strategy: str, unit: nn.Module, params: list[tuple[str, nn.Parameter]],
                 lora_merge: lora_adapters.LoraMerge | None) -> dict[str, torch.Tensor]:
    ddp = strategy == "ddp"
    if strategy == "fsdp1":
        with FSDP1.summon_full_params(unit, recurse=False, writeback=False):
            local = {unwrapped_name(n, ddp): p.detach().clone() for n, p in params}
    else:
        local = {unwrapped_name(n, ddp): _full(p) for n, p in params}
    return lora_merge.merged(local) if lora_merge is not None else local


def _full(param: torch.Tensor) -> torch.Tensor:
    """An FSDP2 parameter's full value (one all-gather), or the tensor itself."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param.detach()


@torch.no_grad()
def load_by_unit(target: nn.Module, chunks: Iterator[dict[str, torch.Tensor]]) -> None:
    """Copy each chunk into ``target``'s parameters of the same names, and check that every parameter
    was written once."""
    own = dict(target.named_parameters())
    written: set[str] = set()
    for chunk in chunks:
        written |= _copy_into(own, chunk)
        del chunk  # before the next unit is gathered
    if missing := sorted(set(own) - written):
        raise KeyError(f"weight refresh: {len(missing)} parameter(s) of the copy were not refreshed: {missing[:3]}")


def _copy_into(own: dict[str, nn.Parameter], chunk: dict[str, torch.Tensor]) -> set[str]:
    for name, value in chunk.items():
        if name not in own:
            raise KeyError(f"weight refresh: the trained model's {name!r} has no counterpart in the copy")
        own[name].copy_(value)
    return set(chunk)


def load_plain_weights(model: nn.Module, source: dict[str, torch.Tensor], zero_adapters: bool = False) -> int:
    """Collective: ``model``'s weights set from ``source``, a whole model's unsharded weights keyed as the plain
    Hugging Face model's (:meth:`Engine.full_model_state`: LoRA merged): each of ``model``'s tensors whose plain
    name and shape ``source`` has -- a LoRA model's frozen base weights included. ``zero_adapters``: the LoRA
    adapters' output matrices (B) set to zero, so the adapted model computes ``source``'s function (a merged
    policy as the new base). Returns the number of tensors set from ``source``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    own = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    update = {}
    for key, value in own.items():
        name = lora_adapters.plain_key(key)
        if zero_adapters and lora_adapters.is_adapter_output(key):
            update[key] = torch.zeros_like(value)
        elif name in source and source[name].shape == value.shape:
            update[key] = source[name]
    copied = sum(1 for key in update if not lora_adapters.is_adapter_output(key))  # counted first: the call
    # below fills the dict in with the keys it lacks
    set_model_state_dict(model, update, options=StateDictOptions(full_state_dict=True, strict=False))
    return copied
