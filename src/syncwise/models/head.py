"""The model side of the fused LM head (``engine.fused_lm_head``): a causal LM's output layer that, inside
:func:`hidden_states_out`, returns its input -- the final hidden states -- instead of the [B, T, V] logits,
and records the weight (and bias) it would have used.

The logits are then made a chunk of tokens at a time by the loss (:class:`syncwise.losses.LogitsFromHidden`).
The weight is the one the forward saw: under FSDP2 / FSDP1 the root unit, which holds the output layer,
stays gathered from its forward until its backward (neither reshards the root after forward), so the loss
may use it after the model's forward returns; the root's gradient reduction then includes what the loss
adds to it. Tied embeddings are the same parameter and keep working.

A model allows it when its output layer is a plain ``nn.Linear`` (not a LoRA-adapted one, not a value head)
and its forward passes that layer's output on as the logits unchanged (no soft-capping, scaling, upcast):
:func:`head_passes_through` checks the latter on a one-layer copy of the model, once per kind of model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from . import hf_config_of, one_small_layer, unwrapped_model


@dataclass
class HeadCall:
    """What the output layer's forward used, recorded inside :func:`hidden_states_out`."""

    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None


_CALL: ContextVar[HeadCall | None] = ContextVar("syncwise_fused_head_call", default=None)


def output_layer(model: nn.Module) -> nn.Module | None:
    """The causal LM's output layer (under DDP / FSDP1 wrappers and peft), or None if it has none."""
    get = getattr(unwrapped_model(model), "get_output_embeddings", None)
    return get() if callable(get) else None


class FusableLinear(nn.Linear):
    """An output layer :func:`install` made fusable: a plain linear layer, except inside
    :func:`hidden_states_out`. (A class, not a patched method: the model still copies and pickles.)"""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        call = _CALL.get()
        if call is None:
            return super().forward(hidden)
        call.weight, call.bias = self.weight, self.bias
        # a copy ([tokens, hidden]: small beside the logits it replaces): FSDP2 warns of a view returned by the
        # root's forward, whose in-place change would skip its pre-backward hook
        return hidden.clone()


def fused_head_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot run with the fused LM head, or None (then :func:`install` may be called)."""
    base, head, config = unwrapped_model(model), output_layer(model), hf_config_of(model)
    if head is None:
        return f"{type(base).__name__} has no output embeddings (a value head or a plain module)"
    if hasattr(head, "base_layer") and hasattr(head, "get_delta_weight"):  # peft's layer is also called Linear
        return "a LoRA adapter sits on the output layer (model.lora.target_modules names it)"
    if type(head) not in (nn.Linear, FusableLinear):
        return f"its output layer is a {type(head).__name__}, not a plain nn.Linear"
    if config is None:
        return f"{type(base).__name__} is not a Hugging Face model"
    return head_passes_through(type(base), config.to_json_string())


def install(model: nn.Module) -> None:
    """Make the output layer return its input inside :func:`hidden_states_out` (a plain linear layer
    elsewhere: generation, export, a user's own forward). Parameters and state-dict keys are unchanged."""
    output_layer(model).__class__ = FusableLinear


@contextmanager
def hidden_states_out() -> Iterator[HeadCall]:
    """Within the block, an installed output layer returns the final hidden states as the model's
    ``logits`` and records its weight and bias in the yielded :class:`HeadCall`."""
    call = HeadCall()
    reset = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(reset)


@cache
def head_passes_through(model_class: type, config_json: str) -> str | None:
    """Whether this kind of model gives its output layer's result as the logits unchanged: a one-layer copy
    of it must give logits equal to that layer applied to what it returns under :func:`hidden_states_out`.
    Returns why not, or None. Cached per model class and config."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(**one_small_layer(json.loads(config_json)))
        config._attn_implementation = "eager"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = model_class(config).eval()
            ids = torch.randint(1, min(config.vocab_size, 1000), (1, 5))
        head = output_layer(model)
        if type(head) is not nn.Linear:
            return f"its output layer is a {type(head).__name__}, not a plain nn.Linear"
        install(model)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            with hidden_states_out() as call:
                hidden = model(input_ids=ids, use_cache=False).logits
            made = torch.nn.functional.linear(hidden, call.weight, call.bias)
    except Exception as exc:  # a model that cannot run this check cannot be trusted with the fused head
        return f"{model_class.__name__} could not be checked ({type(exc).__name__}: {exc})"
    if call.weight is None or made.shape != logits.shape or not torch.allclose(made, logits, atol=1e-5, rtol=1e-5):
        return f"{model_class.__name__}'s forward changes its output layer's result (soft-capping, scaling)"
    return None
