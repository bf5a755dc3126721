"""The one description of a model, made once before it is wrapped (:func:`model_features`): what it supports
(packed rows and the attention kernel that runs them, the fused LM head, LoRA and how its adapters merge), its
decoder layer classes (the FSDP units, activation checkpointing) and its useful FLOPs. The Engine receives the
answer (:class:`ModelFeatures`) and passes it down; nothing asks the model again."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import SHARDED_STRATEGIES, Config
from ..data import attention
from ..models import decoder_layer_classes, hf_config_of
from ..models import head as output_head
from ..models import lora as lora_adapters
from ..models.flops import UsefulFlops
from .wrap import DTYPE_BY_NAME


@dataclass(frozen=True)
class ModelFeatures:
    hf_config: Any  # the model's Hugging Face config; None for a plain nn.Module
    packing: bool  # packed rows keep sequences apart (else padded micro-batches)
    attention_kernel: str  # packed rows' kernel (syncwise.data.attention); "none" without packing
    fused_head: bool  # log-probs from the hidden states a chunk at a time, no [tokens, vocab] logits
    lora_merge: lora_adapters.LoraMerge | None  # LoRA (peft): how the adapters merge; None without
    value_head: bool = False  # a value model (PPO's critic): one output per position, no log-probs
    share_prefixes: bool = False  # packed rows that begin alike compute their common start once
    layer_classes: tuple[type[nn.Module], ...] = ()  # its decoder layers' (none found: a plain module)
    flops: UsefulFlops = UsefulFlops(0, 0)  # as it trains (frozen weights: no weight gradient)

    @property
    def lora(self) -> bool:
        """Only the adapters train, and only they are checkpointed."""
        return self.lora_merge is not None

    @property
    def plain_hf_config(self) -> Any:
        """The config of the plain model the (merged) weights fit: the rollout copy's and the export's
        (untied where an adapter sits on a tied embedding)."""
        return self.lora_merge.plain_config(self.hf_config) if self.lora_merge else self.hf_config


def model_features(model: nn.Module, config: Config, device, say: bool) -> ModelFeatures:
    """Describe ``model`` and decide what it supports under ``config`` (installing the packed-attention kernel
    and the fused head's output layer where they apply); ``say``: this rank prints the one-line reasons. Its
    parameters' ``requires_grad`` as they will train (the FLOPs count frozen weights apart)."""
    base = lora_adapters.base_model_of(model)  # a peft model packs and shares as the model it adapts
    hf_config = hf_config_of(base)
    head = output_head.output_layer(model)
    try:
        classes = tuple(decoder_layer_classes(model))
    except ValueError:  # said where a strategy needs them (wrap_model)
        classes = ()
    split = config.dist.sequence_parallel != 1  # sequence parallelism splits packed rows: it packs every one
    packing = (config.engine.packing or split) and _packing_works(base, hf_config, say, split)
    kernel = "none"
    if packing:  # computed in FSDP's mixed-precision dtype, else in the parameters'
        sharded = config.engine.strategy in SHARDED_STRATEGIES
        compute_dtype = DTYPE_BY_NAME[config.model.param_dtype] if sharded else next(model.parameters()).dtype
        kernel, line = attention.choose_kernel(device, compute_dtype)
        if line and say:
            print(f"syncwise: {line}", flush=True)
    fused = config.engine.fused_lm_head and _fused_head_works(model, head, config, say)
    merge = lora_adapters.LoraMerge(model) if base is not model else None
    value_head = head is None and getattr(hf_config, "num_labels", 0) == 1
    share = packing and not split and _sharing_works(base, hf_config, config.engine.share_prefixes, kernel, say)
    if split and config.engine.share_prefixes is not False and say:
        print(f"syncwise: engine.share_prefixes: off (dist.sequence_parallel={config.dist.sequence_parallel} splits "
              f"each row by position; a group's prompt is computed in every row)", flush=True)
    return ModelFeatures(getattr(model, "config", None), packing, kernel, fused, merge, value_head, share, classes,
                         UsefulFlops.of(model, hf_config))


def _sharing_works(model: nn.Module, config, setting: bool | str, kernel: str, say: bool) -> bool:
    """Whether packed rows of ``model`` read a shared prefix from one row (:mod:`syncwise.data.prefixes`):
    ``engine.share_prefixes`` allows it (auto: where packed rows run the per-sequence loop, whose calls the
    prefix joins; a variable-length kernel would be given up for it), its attention is syncwise's packed
    sdpa, a one-layer copy computes a follower as it would the whole row, and nothing is dropped out at
    random (followers would share their leader's dropout masks). One line why not, where it is not."""
    from ..data.prefixes import shares_correctly

    if setting is False or (setting == "auto" and kernel != "loop"):
        if say and setting == "auto":
            print(f"syncwise: engine.share_prefixes: off (auto keeps the {kernel} kernel; true shares with the "
                  "per-sequence loop instead)", flush=True)
        return False
    dropout = max([m.p for m in model.modules() if isinstance(m, nn.Dropout)]
                  + [float(getattr(config, "attention_dropout", 0.0) or 0.0)])
    if config._attn_implementation != attention.NAME:
        reason = f"the attention is {config._attn_implementation}, not syncwise's packed sdpa"
    elif dropout > 0:
        reason = f"the model drops out at random (p={dropout:g}): the rows would share their prefix's dropout"
    else:
        reason = shares_correctly(type(model), config.to_json_string())
    if reason and say:
        print(f"syncwise: engine.share_prefixes: off ({reason})", flush=True)
    return reason is None


def _packing_works(model: nn.Module, config, say: bool, split: bool = False) -> bool:
    """Whether ``model`` keeps packed sequences apart (checked once per kind of model); if not, one message
    and the padded path. An sdpa model is switched to ``sdpa_varlen`` (:mod:`syncwise.data.attention`): a
    packed row's attention then costs what its sequences' would alone. ``split`` (sequence parallelism, whose
    head exchange lives in ``sdpa_varlen``): any attention is switched to it (on a GPU it runs the same
    variable-length kernels as flash-attention)."""
    from ..data.packing import packs_correctly

    if config is None:
        reason = f"{type(model).__name__} is not a Hugging Face model (packing needs position_ids support)"
    else:
        if config._attn_implementation == "sdpa" or (split and config._attn_implementation != attention.NAME):
            attention.register()
            model.set_attn_implementation(attention.NAME)
        reason = packs_correctly(type(model), config.to_json_string(), config._attn_implementation)
    if reason and say:
        warnings.warn(f"engine.packing: {reason}; using padded micro-batches", RuntimeWarning, stacklevel=4)
    return reason is None


def _fused_head_works(model: nn.Module, head: nn.Module | None, config: Config, say: bool) -> bool:
    """Whether ``model`` can run with the fused LM head (:mod:`syncwise.models.head`); if so its output layer
    is installed, if not one message (unless it has no output layer at all: a value head) and the logits are
    materialised."""
    reason = output_head.fused_head_unsupported(model)
    if reason is None and config.engine.strategy == "ddp" and config.engine.find_unused_parameters:
        # DDP looks for unused parameters in the forward's graph, which the output layer is not in
        reason = "with engine.find_unused_parameters=true DDP would take the output layer for unused"
    if reason is None:
        output_head.install(model)
    elif say and head is not None:
        warnings.warn(f"engine.fused_lm_head: {reason}; materialising the logits", RuntimeWarning, stacklevel=4)
    return reason is None
