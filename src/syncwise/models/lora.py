"""LoRA adapters (peft) on a Hugging Face causal LM.

``model.lora.rank > 0`` wraps the model in a peft ``PeftModelForCausalLM``: low-rank adapters A, B beside the
targeted linear layers, the base weights frozen. Everything else in syncwise sees an ordinary module whose
trainable parameters are the adapters' (FSDP reduce-scatters and holds only those; the optimizer and the
checkpoint see only those). This module holds what is specific to peft:

- :func:`apply_lora`: the adapters, initialised alike on every rank;
- :func:`peft_model_of`, :func:`base_model_of`: the peft model inside a wrapper, and the model it adapts;
- :class:`LoraMerge`: a peft state dict as the plain model's, each adapted weight plus its peft layer's own delta
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
PEFT_PREFIX = "base_model.model."  # peft's prefix on the adapted model's state-dict keys


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0, value_head: str | None = None) -> nn.Module:
    """``model`` with LoRA adapters (``cfg.rank`` > 0), or ``model`` itself (rank 0). The adapters' A is
    drawn from a generator seeded with ``seed`` (identical on every rank); B starts at zero, so the adapted
    model starts as the base model. ``value_head``: a critic's head module, which trains in full (peft's
    ``modules_to_save``: a new head has nothing to adapt)."""
    if not cfg.rank:
        return model
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError as exc:
        raise ImportError("model.lora.rank > 0 needs peft, which is not installed: "
                          "pip install 'syncwise[lora]'") from exc

    names = cfg.target_modules.strip()
    targets: str | list[str] = names if names == "all-linear" else [n.strip() for n in names.split(",") if n.strip()]
    if reason := _fused_experts_named(model, targets):
        raise ValueError(f"model.lora.target_modules={cfg.target_modules!r}: {reason}")
    peft_config = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
        task_type="TOKEN_CLS" if value_head else "CAUSAL_LM", modules_to_save=[value_head] if value_head else None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return with_adapters(model, peft_config)
        except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
            raise ValueError(f"model.lora.target_modules={cfg.target_modules!r}: {str(exc).splitlines()[0]}") from exc


def _fused_experts_named(model: nn.Module, targets: str | list[str]) -> str | None:
    """Why LoRA cannot adapt a named module, where it is a mixture of experts' fused experts (one module holding
    every expert's weights as 3-D parameters, which peft, adapting ``nn.Linear``-like layers, cannot): or None."""
    if isinstance(targets, str):
        return None
    for name, module in model.named_modules():
        fused = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if fused and name.rsplit(".", 1)[-1] in targets:
            return (f"{type(module).__name__} holds every expert's weights in one module, which LoRA cannot adapt; "
                    f"LoRA adapts the attention's linear layers (all-linear) and leaves the experts and routers frozen")
    return None


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


class LoraMerge:
    """How the adapted model's weights become the plain model's, for the rollout copy and the export.

    Each peft layer is asked for its own delta (``get_delta_weight``, run on the gathered adapter tensors), so
    every layer kind merges as peft merges it: ``nn.Linear``, GPT-2's ``Conv1D`` (``fan_in_fan_out``: its
    weight is [in, out]) and embeddings (``lora_embedding_A/B``). Tied embeddings are one tensor: merging an
    adapter on ``lm_head`` into it would change the input embeddings too, so a model whose tied weight is
    adapted is merged *untied* (:attr:`unties`; :meth:`plain_config` says so to the copy and the export).
    Built once from the peft model before it is wrapped (the layer objects stay the same under FSDP/DDP).
    """

    def __init__(self, model: nn.Module):
        peft = peft_model_of(model)
        if peft is None:
            raise ValueError(f"{type(model).__name__} has no LoRA adapters to merge")
        self._layers: dict[str, tuple[nn.Module, tuple[str, ...]]] = {}  # prefix -> (peft layer, adapter keys)
        for name, module in peft.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") \
                    and ADAPTER in getattr(module, "scaling", {}):
                keys = tuple(k for k, _ in module.named_parameters() if not k.startswith("base_layer."))
                self._layers[unwrapped_name(name)] = (module, keys)
        by_tensor: dict[int, list[str]] = {}
        for name, param in peft.named_parameters(remove_duplicate=False):
            by_tensor.setdefault(id(param), []).append(unwrapped_name(name))
        # a tied tensor's other names -> the one named_parameters (and so a unit's gather) keeps
        self._aliases = {alias: names[0] for names in by_tensor.values() for alias in names[1:]}
        tied = set(self._aliases) | set(self._aliases.values())
        self.unties = any(f"{layer}.base_layer.weight" in tied for layer in self._layers)

    @property
    def scalings(self) -> dict[str, float]:
        """Each adapted layer's state-dict prefix -> its scaling (``lora_alpha / r``, as peft computed it)."""
        return {name: float(module.scaling[ADAPTER]) for name, (module, _) in self._layers.items()}

    def plain_config(self, hf_config):
        """The Hugging Face config of the model the merged weights fit: untied where :attr:`unties`."""
        if not self.unties or hf_config is None:
            return hf_config
        import copy

        plain = copy.deepcopy(hf_config)
        plain.tie_word_embeddings = False
        return plain

    def merged(self, state: dict[str, torch.Tensor], deltas: bool = True) -> dict[str, torch.Tensor]:
        """``state`` (peft's keys; the whole model or one unit's share) as the plain model's: each adapted
        weight plus its layer's delta (in fp32, then the weight's dtype; ``deltas=False``: the base weights),
        adapter tensors dropped, peft's prefix removed; where the merge unties, each tied name gets its own."""
        out: dict[str, torch.Tensor] = {}
        names = list(state)
        if self.unties:  # a gathered unit names a tied tensor once: its other names too
            names += [alias for alias, kept in self._aliases.items() if kept in state and alias not in state]
        for key in names:
            value = state[key] if key in state else state[self._aliases[key]]
            if _ORIGINAL in key or _TRAINED in key:  # a module peft trains whole (a critic's value head)
                if (_ORIGINAL in key) == deltas:  # merged: the trained copy; the base: the original
                    continue
                key = key.replace(_ORIGINAL, ".").replace(_TRAINED, ".")
            layer, leaf = self._layer_of(key)
            if layer is not None:
                if not leaf.startswith("base_layer."):
                    continue  # the adapter's own tensors
                leaf = leaf.removeprefix("base_layer.")
                if leaf == "weight" and deltas:
                    value = (value.float() + self._delta(layer, state).float()).to(value.dtype)
                key = f"{layer}.{leaf}"
            out[key.removeprefix(PEFT_PREFIX)] = value
        return out

    def _layer_of(self, key: str) -> tuple[str | None, str]:
        """The adapted layer whose tensor ``key`` is, and the rest of the key (else None, key)."""
        prefix = key
        while "." in prefix:
            prefix = prefix.rpartition(".")[0]
            if prefix in self._layers:
                return prefix, key[len(prefix) + 1 :]
        return None, key

    def _delta(self, layer: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
        module, keys = self._layers[layer]
        missing = [f"{layer}.{k}" for k in keys if f"{layer}.{k}" not in state]
        if missing:
            raise KeyError(f"LoRA merge: {layer}'s adapter tensors {missing} are not beside its weight")
        with torch.no_grad(), _swapped(module, {k: state[f"{layer}.{k}"] for k in keys}):
            return module.get_delta_weight(ADAPTER)


def plain_key(key: str) -> str:
    """A peft model's state-dict key as the plain model's (its prefix and ``base_layer`` dropped; a key of a
    model without adapters stays as it is)."""
    return key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def is_adapter_output(key: str) -> bool:
    """Whether a peft state-dict key is an adapter's output matrix (B, zero at the start: the delta is B @ A)."""
    return ".lora_B." in key or ".lora_embedding_B." in key


# peft's modules_to_save: the original module and the copy that trains, side by side
_ORIGINAL = ".original_module."
_TRAINED = f".modules_to_save.{ADAPTER}."


@contextmanager
def _swapped(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s tensors of these (relative) names replaced for the duration -- the gathered adapter
    tensors in place of FSDP's shards -- so peft's own code computes the delta. No forward runs (forward hooks,
    e.g. a memory tracker's, stay out of it); FSDP1 keeps its views as plain attributes, hence either store."""
    saved = []
    try:
        for name, value in tensors.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            store = owner._parameters if leaf in owner._parameters else owner.__dict__
            saved.append((store, leaf, store.get(leaf)))
            store[leaf] = value
        yield
    finally:
        for store, leaf, original in reversed(saved):
            if original is None:
                store.pop(leaf, None)
            else:
                store[leaf] = original
