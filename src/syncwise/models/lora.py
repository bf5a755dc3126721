"""LoRA adapters (peft) on a Hugging Face causal LM.

``model.lora.rank > 0`` wraps the model in a peft ``PeftModelForCausalLM``: low-rank adapters A, B beside the
targeted linear layers, the base weights frozen. Everything else in syncwise sees an ordinary module whose
trainable parameters are the adapters' (FSDP reduce-scatters and holds only those; the optimizer and the
checkpoint see only those). This module holds what is specific to peft:

- :func:`apply_lora`: the adapters, initialised alike on every rank;
- :func:`peft_model_of`, :func:`base_model_of`: the peft model inside a wrapper, and the model it adapts;
- :func:`merged_state_dict`: a peft state dict as the plain model's, each adapted weight ``W + s·B·A``
  (the rollout copy and the export need no peft);
- :func:`adapters_disabled`: the base model alone, for the KL reference (no second model in memory).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..config import LoraConfig
from .names import unwrapped_name

ADAPTER = "default"  # peft's name for the one adapter syncwise builds
_PEFT_PREFIX = "base_model.model."  # peft's prefix on the adapted model's state-dict keys


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0) -> nn.Module:
    """``model`` with LoRA adapters (``cfg.rank`` > 0), or ``model`` itself (rank 0). The adapters' A is
    drawn from a generator seeded with ``seed`` (identical on every rank); B starts at zero, so the adapted
    model starts as the base model."""
    if not cfg.rank:
        return model
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError as exc:
        raise ImportError("model.lora.rank > 0 needs peft, which is not installed: "
                          "pip install 'syncwise[lora]'") from exc

    names = cfg.target_modules.strip()
    targets: str | list[str] = names if names == "all-linear" else [n.strip() for n in names.split(",") if n.strip()]
    peft_config = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return with_adapters(model, peft_config)
        except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
            raise ValueError(f"model.lora.target_modules={cfg.target_modules!r}: {str(exc).splitlines()[0]}") from exc


def with_adapters(model: nn.Module, peft_config) -> nn.Module:
    """peft's ``get_peft_model``, without its noise: peft asks transformers a deprecated question
    (``is_gradient_checkpointing``) on every wrap."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, peft_config)


def peft_model_of(module: nn.Module) -> nn.Module | None:
    """The peft model ``module`` is or wraps (DDP and FSDP1 hold it as ``.module``), else None."""
    for candidate in (module, getattr(module, "module", None)):
        if candidate is not None and hasattr(candidate, "peft_config") and hasattr(candidate, "disable_adapter"):
            return candidate
    return None


def base_model_of(model: nn.Module) -> nn.Module:
    """The model a peft model adapts (its own class is what packing and exports need), else ``model``."""
    peft = peft_model_of(model)
    return peft.get_base_model() if peft is not None else model


@contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Forward passes inside run the base model alone (the adapters skipped). Only for passes without
    gradients: peft re-marks the adapters trainable on exit."""
    peft = peft_model_of(module)
    if peft is None:
        raise ValueError(f"{type(module).__name__} has no LoRA adapters to disable")
    with peft.disable_adapter():
        yield


def adapter_scalings(model: nn.Module) -> dict[str, float]:
    """Each adapted layer's state-dict key prefix (peft's, checkpoint wrappers dropped) -> its scaling s
    (``lora_alpha / r``, as peft computed it)."""
    out: dict[str, float] = {}
    peft = peft_model_of(model)
    for name, module in (peft or model).named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER in scaling and hasattr(module, "base_layer"):
            out[unwrapped_name(name)] = float(scaling[ADAPTER])
    return out


def merged_state_dict(state: dict[str, torch.Tensor], scalings: dict[str, float]) -> dict[str, torch.Tensor]:
    """A full peft state dict as the base model's own: every adapted weight merged, ``W + s·B·A`` (in fp32,
    then the weight's dtype), adapter tensors dropped, peft's key prefixes removed. ``scalings`` from
    :func:`adapter_scalings`. A state dict without adapters comes back unchanged."""
    if not scalings:
        return state
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key or ".lora_dropout." in key:
            continue
        layer, _, leaf = key.rpartition(".base_layer.")
        if leaf and layer in scalings:
            if leaf == "weight":
                a = state[f"{layer}.lora_A.{ADAPTER}.weight"].float()
                b = state[f"{layer}.lora_B.{ADAPTER}.weight"].float()
                value = (value.float() + scalings[layer] * (b @ a)).to(value.dtype)
            key = f"{layer}.{leaf}"
        out[key.removeprefix(_PEFT_PREFIX)] = value
    return out
