"""Build Hugging Face causal LMs from a local directory or from a built-in config preset (never downloads)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedModel

from ..config import LoraConfig, ModelConfig
from .lora import apply_lora, base_model_of

# Tiny shapes for CPU jobs, tests and benchmarks; and two real ones for a GPU.
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.43M params: tests.
    "qwen2-test": dict(
        model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ),
    # ~2.9M params: the default job and the small benchmark.
    "qwen2-tiny": dict(
        model_type="qwen2", vocab_size=1024, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    ),
    # ~22M params: the larger CPU benchmark.
    "qwen2-20m": dict(
        model_type="qwen2", vocab_size=4096, hidden_size=512, intermediate_size=1408,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
    ),
    # qwen2-20m's layers, ten of them: ~30M params with the built-in 17-token vocabulary (bench --workload
    # grpo's larger model; 34M with this vocabulary).
    "qwen2-30m": dict(
        model_type="qwen2", vocab_size=4096, hidden_size=512, intermediate_size=1408,
        num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4,
    ),
    # ~0.3M params with the built-in 17-token vocabulary: the default GRPO job (vocab set by the tokenizer).
    # Llama rather than Qwen2: transformers' AutoTokenizer forces Qwen2's own tokenizer class on qwen2
    # exports, which would re-tokenize the built-in word-level vocabulary.
    "llama-grpo": dict(
        model_type="llama", vocab_size=17, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ),
    # ~3.6M params with the arith_chat task's 1024-token BPE vocabulary: the built-in SFT chat task.
    "llama-chat": dict(
        model_type="llama", vocab_size=1024, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    ),
    "llama-test": dict(
        model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ),
    # A mixture of experts (8 fused experts a layer, 2 a token): the memory plan's MoE check.
    "qwen3-moe-test": dict(
        model_type="qwen3_moe", vocab_size=512, hidden_size=128, intermediate_size=1024, moe_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, norm_topk_prob=True,
    ),
    # Real shapes, random weights (bench --workload gpu): Qwen2.5-0.5B and -1.5B as their configs have them.
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
}
_COMMON = dict(max_position_embeddings=512, tie_word_embeddings=False)


def preset_config(name: str, **overrides: Any):
    """A ``transformers`` config for a built-in preset."""
    if name not in PRESETS:
        raise ValueError(f"model.preset: {name!r} is not one of {', '.join(PRESETS)}")
    kwargs = {**_COMMON, **PRESETS[name], **overrides}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def build_model(cfg: ModelConfig, value_head: bool = False, deferred: bool = False,
                **config_overrides: Any) -> PreTrainedModel:
    """Instantiate the model in fp32 on CPU, with identical weights on every rank (seeded init), and its LoRA
    adapters when ``cfg.lora.rank`` > 0 (see :mod:`syncwise.models.lora`). ``config_overrides`` adjust a
    preset (e.g. ``vocab_size`` to match a tokenizer).

    ``deferred``: for an engine that wraps it (:class:`~syncwise.engine.Engine`), a model from ``cfg.path``'s
    safetensors, or a preset of :data:`DEFERRED_FROM_PARAMS` parameters or more, is built on the meta device and
    filled once wrapped, each rank reading or drawing only its own shards (:mod:`syncwise.models.loading`); a
    small preset (milliseconds on the CPU) and a checkpoint without safetensors are built whole as before.

    ``value_head``: PPO's critic -- the same architecture with a one-output linear head on the final hidden
    states instead of the LM head (transformers' ``...ForTokenClassification`` with ``num_labels=1``, as
    verl builds its critic; ``outputs.logits`` is then [B, T, 1], one value per position). The decoder comes
    from ``cfg.path`` (or the preset's seeded init: the policy's own initial weights); the head starts at
    zero (:func:`value_head_of`)."""
    from .checkpoint_files import checkpoint_layout, safetensors_of, untied_head
    from .loading import defer, placeholders

    off = cfg.dropout == "off"
    auto_class = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    head = {"num_labels": 1} if value_head else {}
    if cfg.path:
        hf_config = AutoConfig.from_pretrained(cfg.path, local_files_only=True, **head)
    else:
        hf_config = preset_config(cfg.preset, **config_overrides, **head)
    if off:
        for key, value in dropout_free(hf_config).items():
            setattr(hf_config, key, value)
    on_meta = deferred and (bool(safetensors_of(cfg.path)) if cfg.path else _preset_params(hf_config)
                            >= DEFERRED_FROM_PARAMS)
    layout = note = None
    if on_meta:
        hf_config._attn_implementation = cfg.attn_implementation
        model = _on_meta(auto_class, hf_config)
        if cfg.path:
            layout = checkpoint_layout(model, cfg.path)
            note = untied_head(model, layout) if layout is not None else None
            if note:  # from_pretrained keeps a head the file holds apart; so do training and the export (the
                # layout stands: a tied model's state dict names both keys already)
                hf_config.tie_word_embeddings = False
                model = _on_meta(auto_class, hf_config)
            on_meta = layout is not None  # else keys transformers converts: from_pretrained loads it whole
    if not on_meta and cfg.path:
        model = _from_pretrained(auto_class, cfg, hf_config, value_head)
    elif not on_meta:
        hf_config._attn_implementation = cfg.attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = auto_class.from_config(hf_config, dtype=torch.float32)
    if value_head:
        # Its [B, T, 1] output is a view of the head's matmul; FSDP2 warns that an in-place change of it would
        # skip its backward hook. Nothing changes the values in place (the value loss reads them).
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+ForTokenClassification\) "
                                r"returned a view tensor")
        # Zero: the first values are 0 everywhere, so the first advantages are the plain (whitened) returns
        # rather than returns minus a random head's noise (std ~0.3 for a 256-wide model), and the
        # decoder's first gradient is not pushed by a random projection.
        score = value_head_of(model)
        for name, param in list(score.named_parameters(recurse=False)):
            setattr(score, name, nn.Parameter(torch.zeros(param.shape), requires_grad=param.requires_grad))
    stand_ins = placeholders(model) if on_meta and cfg.lora.rank else set()  # peft builds its adapters on the CPU
    model = apply_lora(model, cfg.lora, cfg.seed, value_head=value_head_name(model) if value_head else None)
    if off:  # LoRA's dropout, and any dropout layer the config does not name
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    if on_meta:
        return defer(model, cfg.path, cfg.seed, float(getattr(hf_config, "initializer_range", 0.02)), stand_ins,
                     layout, note)
    return model


def _on_meta(auto_class, hf_config) -> PreTrainedModel:
    from .loading import parameters_on_meta

    with parameters_on_meta():
        model = auto_class.from_config(hf_config, dtype=torch.float32)
    model.tie_weights()
    return model


# A preset from this many parameters is built on the meta device and initialised on the job's device (seeded
# per tensor); below it, whole on the CPU with the global seed, as every earlier run had it.
DEFERRED_FROM_PARAMS = 100_000_000


def _preset_params(hf_config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def _from_pretrained(auto_class, cfg: ModelConfig, hf_config, value_head: bool) -> PreTrainedModel:
    """The model of ``cfg.path`` in full on the CPU, through transformers (a checkpoint without safetensors)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-tensor loading bar in every rank breaks into the job's lines
    verbosity = hf_logging.get_verbosity()
    if value_head:  # "score.weight newly initialized; lm_head.weight unused": both meant
        hf_logging.set_verbosity_error()
    try:
        model = auto_class.from_pretrained(cfg.path, local_files_only=True, dtype=torch.float32, config=hf_config,
                                           attn_implementation=cfg.attn_implementation)
    finally:
        hf_logging.set_verbosity(verbosity)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None and head.weight is not embedding.weight:
        model.config.tie_word_embeddings = False  # a file's own head kept apart: the export must keep it too
    return model


def value_config(hf_config):
    """A copy of ``hf_config`` for the model with a one-output value head (``num_labels=1``)."""
    import copy

    out = copy.deepcopy(hf_config)
    out.num_labels = 1
    return out


VALUE_HEAD_NAMES = ("score", "classifier")  # Llama / Qwen2 / Mistral (generic), GPT-2


def value_head_name(model: nn.Module) -> str:
    for name in VALUE_HEAD_NAMES:
        if isinstance(getattr(model, name, None), nn.Linear):
            return name
    raise ValueError(f"{type(model).__name__}: no value head ({' or '.join(VALUE_HEAD_NAMES)}) found")


def value_head_of(model: nn.Module) -> nn.Linear:
    """The one-output head of a value model built by :func:`build_model` (``value_head=True``)."""
    return getattr(model, value_head_name(model))


def dropout_free(hf_config) -> dict[str, float]:
    """The config's dropout probabilities (``*dropout*``, GPT-2's ``*_pdrop``) set to 0: the overrides that
    build the model without dropout, as TRL's ``disable_dropout`` does for RL."""
    return {key: 0.0 for key, value in hf_config.to_dict().items()
            if isinstance(value, float) and value > 0 and ("dropout" in key or key.endswith("pdrop"))}


def uninitialised_model(
    hf_config, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", value_head: bool = False,
) -> nn.Module:
    """The model ``hf_config`` describes with its parameters allocated but not initialised (no random init to
    overwrite: a 0.5B model in 0.03 s instead of 6.5-10 s), for weights loaded right after (the rollout copy,
    the export). Buffers computed at construction (rotary frequencies) are real; tied weights are tied."""
    from transformers.initialization import no_init_weights

    auto_class = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    with no_init_weights():
        model = auto_class.from_config(hf_config, dtype=dtype)
    model.tie_weights()
    return model.to(device)


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """Classes named in ``_no_split_modules`` that occur in the model: the per-layer FSDP units (also once
    wrapped: FSDP2 gives each unit a subclass of its own, ``FSDPLlamaDecoderLayer``)."""
    names = set(getattr(unwrapped_model(model), "_no_split_modules", None) or [])  # DDP's / FSDP1's .module too
    classes = {type(m) for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)}
    if not classes:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules ({sorted(names)}); "
            "cannot wrap it per layer"
        )
    return classes


def decoder_layers(model: nn.Module, classes: tuple[type[nn.Module], ...] = ()) -> list[nn.Module]:
    """The decoder layers (of ``classes``, found where not given), or the activation-checkpoint wrappers around
    them where they are wrapped (the module FSDP must shard, so that recomputation finds its parameters
    gathered)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    classes = tuple(classes) or tuple(decoder_layer_classes(model))
    wrapped = [
        m for m in model.modules()
        if isinstance(m, CheckpointWrapper) and any(isinstance(child, classes) for child in m.children())
    ]
    return wrapped or [m for m in model.modules() if isinstance(m, classes)]


def meta_model_units(
    hf_config, lora: LoraConfig | None = None, value_head: bool = False,
) -> tuple[nn.Module, list[nn.Module]]:
    """The model ``hf_config`` describes (with ``lora``'s adapters, if its rank is > 0; ``value_head``: as PPO's
    critic), built on the meta device (no weights, no memory), and its FSDP units as the engine wraps them: the
    root first, then one per decoder layer."""
    with torch.device("meta"):
        if value_head:
            model = AutoModelForTokenClassification.from_config(value_config(hf_config))
            model = apply_lora(model, lora or LoraConfig(), value_head=value_head_name(model))
        else:
            model = apply_lora(AutoModelForCausalLM.from_config(hf_config), lora or LoraConfig())
    return model, [model, *decoder_layers(model)]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def one_small_layer(config: dict) -> dict:
    """A model config (as a dict) with one narrow layer, under the names of Llama-style and GPT-2-style configs
    alike: what the start-up checks of a kind of model build (the vocabulary is kept: special token ids must
    stay valid; a sliding window too, shrunk below the checks' sequences so that it is exercised)."""
    small = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "layer_types": None,
             "n_layer": 1, "n_embd": 64, "n_inner": 128, "n_head": 4}
    if config.get("sliding_window"):
        small["sliding_window"] = 4
    config.update({key: value for key, value in small.items() if key in config})
    config.pop("architectures", None)
    return config


def unwrapped_model(model: nn.Module) -> nn.Module:
    """The model under DDP / FSDP1's ``.module`` and peft's wrapper (FSDP2 wraps in place)."""
    return base_model_of(getattr(model, "module", model))


def hf_config_for(cfg: ModelConfig) -> Any:
    """The Hugging Face config of the model ``cfg`` describes (``cfg.path``'s, or the preset's): no weights."""
    if cfg.path:
        return AutoConfig.from_pretrained(cfg.path, local_files_only=True)
    return preset_config(cfg.preset)


def hf_config_of(model: nn.Module) -> Any | None:
    """The Hugging Face config of ``model`` (under its wrappers), or None for a model that is not one."""
    config = getattr(unwrapped_model(model), "config", None)
    return config if hasattr(config, "to_json_string") else None
