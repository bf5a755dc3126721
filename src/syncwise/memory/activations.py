"""Activation memory of one micro-batch, from a model's shapes: what ``syncwise plan`` adds to each rank's
peak when told the sequence length (``--seq-len``, ``--micro-batch-size``, ``--activation-checkpointing``).

Per decoder layer and token, what autograd keeps for backward (in the compute dtype): the two norms'
inputs and outputs (4·h), the rotated queries and the attention output (2·heads·d), the rotated keys and
the values (2·kv_heads·d) -- sdpa and flash-attention keep no score matrix -- and the MLP's gate, its
activation, the up projection and their product (4·i). With activation checkpointing a layer keeps only
its input (h). Also kept: the final norm (2·h) and the logits (V per token). The peak comes in one of two
phases of backward: the loss's (the logits' gradient, and the log-probs' fp32 work on one chunk of tokens:
none for fp32 logits, whose chunk gradient is computed in place in the logits' gradient; for bf16 / fp16
logits the fp32 copy of the chunk and its gradient) or a layer's (about its activations once more: their
gradients in flight (the MLP's three intermediates and the layer's input and output), or, checkpointed,
its recomputation, freed as the gradients form).

With the fused LM head (``engine.fused_lm_head``) the logits are never kept: the loss keeps a copy of the
final hidden states (h per token) and, in its backward, has one chunk of logits in flight (made again from
the hidden states, their fp32 copy worked into the gradient in place, and for bf16 / fp16 its cast back),
the hidden states' gradient, and the output layer's gradient (V·h), summed over the chunks from the start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..data.ulysses import kv_repeats
from ..models.moe import mlp_width, routing_width
from .accounting import DTYPE_BYTES


@dataclass(frozen=True)
class ActivationEstimate:
    tokens: int  # per micro-batch
    per_layer_bytes: int  # kept by one layer (its input only, with checkpointing)
    saved_bytes: int  # everything kept from forward for backward
    loss_phase_bytes: int  # on top, while the loss's backward runs: logits' gradient, log-prob chunk work
    layer_phase_bytes: int  # on top, while a layer's backward runs (with checkpointing: its recomputation)
    peak_bytes: int


def _shape(config, name: str, default: int = 0) -> int:
    value = getattr(config, name, None)
    return int(value) if value is not None else default


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a Hugging Face config."""
    heads = _shape(config, "num_attention_heads")
    kv_heads = _shape(config, "num_key_value_heads", heads)
    return heads, kv_heads, _shape(config, "head_dim", _shape(config, "hidden_size") // max(heads, 1))


def kv_cache_bytes(config, tokens: int, dtype: str) -> int:
    """Keys and values of every layer for ``tokens`` cached tokens (all sequences together)."""
    _, kv_heads, head_dim = attention_shape(config)
    return 2 * _shape(config, "num_hidden_layers") * kv_heads * head_dim * tokens * DTYPE_BYTES[dtype]


def shared_read_cost(config) -> tuple[float, float]:
    """What a packed row reading a shared start (:mod:`syncwise.data.prefixes`) keeps in a decoder layer beyond
    its computed tokens, in computed tokens of the packed-loop layer below: per token of its start and its own
    part (its copied keys and values, and its queries' copy with the start's empty ones in front), and per token
    of its start (those queries' outputs). (0, 0) for a model without a Hugging Face config."""
    if config is None:
        return 0.0, 0.0
    hidden = _shape(config, "hidden_size")
    heads, kv_heads, head_dim = attention_shape(config)
    inter = mlp_width(config, 4 * hidden)  # a mixture of experts: its k experts'
    width = 4 * hidden + 3 * heads * head_dim + 2 * kv_heads * head_dim + 4 * inter  # a packed-loop token
    return (2 * kv_heads * head_dim + heads * head_dim) / width, heads * head_dim / width


def estimate_activations(
    config, seq_len: int, micro_batch_size: int = 1, checkpointing: bool = False, dtype: str = "bfloat16",
    logprob_chunk: int = 1024, fused_head: bool = False, head_trains: bool = True, value_head: bool = False,
    packed_loop: bool = False, layer_scale: float = 1.0, sequence_parallel: int = 1,
) -> ActivationEstimate:
    """The activation peak of one micro-batch of ``micro_batch_size`` sequences of ``seq_len`` tokens
    (``head_trains``: the output layer has a gradient -- not under LoRA; ``value_head``: PPO's critic, whose
    head gives one value per token: no vocabulary-wide logits; ``packed_loop``: packed rows whose attention runs
    one sdpa call per sequence, :mod:`syncwise.data.attention`; ``layer_scale``: what a decoder layer really
    keeps over what the formula above says, measured (:class:`LayerActivationMeter`) -- 1 for Llama-shaped
    layers, about 2 for GPT-2's, whose tanh-GELU, LayerNorms and dropout keep more). ``sequence_parallel`` N
    (:mod:`syncwise.data.ulysses`): one rank's share -- 1/N of the tokens, their attention over the whole row
    for 1/N of the heads (the same bytes per rank, key / value heads repeated where fewer than N), and one
    layer's exchange in flight (what it sends and receives)."""
    hidden = _shape(config, "hidden_size")
    heads, kv_heads, head_dim = attention_shape(config)
    inter = mlp_width(config, 4 * hidden)  # a mixture of experts: its k experts'
    layers = _shape(config, "num_hidden_layers")
    vocab = _shape(config, "vocab_size")
    if sequence_parallel > 1:
        seq_len = -(-seq_len // sequence_parallel)
        kv_heads *= kv_repeats(kv_heads, sequence_parallel)
    tokens = seq_len * micro_batch_size
    size = DTYPE_BYTES[dtype]
    exchange = 2 * tokens * (heads + 2 * kv_heads) * head_dim * size if sequence_parallel > 1 else 0
    full_layer = tokens * (4 * hidden + 2 * heads * head_dim + 2 * kv_heads * head_dim + 4 * inter
                           + routing_width(config)) * size
    if packed_loop:  # each sequence's attention output, kept by its sdpa call beside the row's concatenated copy
        full_layer += tokens * heads * head_dim * size
    full_layer = int(full_layer * layer_scale)
    kept = tokens * hidden * size if checkpointing else full_layer
    chunk = min(tokens, logprob_chunk) if logprob_chunk > 0 else tokens
    low_precision = size < 4
    if value_head:  # the values, their fp32 copy and the loss's few per-token tensors
        kept_for_loss = tokens * size
        loss_phase = tokens * hidden * size + 8 * tokens * 4  # the hidden states' gradient, the loss's temporaries
    elif fused_head:
        kept_for_loss = tokens * hidden * size  # the loss's copy of the hidden states
        chunk_work = chunk * vocab * (size + (4 + size if low_precision else 0))
        # + the hidden states' gradient, + the output layer's gradient, summed over the chunks from the start
        loss_phase = chunk_work + tokens * hidden * size + (vocab * hidden * size if head_trains else 0)
    else:
        kept_for_loss = tokens * vocab * size  # the logits
        chunk_work = 2 * chunk * vocab * 4 if low_precision else 0  # fp32 copy of the chunk, its gradient
        loss_phase = kept_for_loss + chunk_work  # + the logits' gradient
    saved = layers * kept + 2 * tokens * hidden * size + kept_for_loss  # + the final norm
    # A layer's backward: checkpointed, its recomputed activations once more (freed as the gradients form);
    # otherwise the gradients in flight while its saved activations are freed one by one -- the MLP's
    # (gate, up and their product: 3·i) and the layer's input and output (2·h). Measured against the
    # engine's peaks: tests/test_plan.py.
    layer_phase = (full_layer if checkpointing else tokens * (2 * hidden + 3 * inter) * size) + exchange
    peak = saved + max(loss_phase, layer_phase)
    return ActivationEstimate(tokens, kept, saved, loss_phase, layer_phase, peak)


def working_bytes(act: ActivationEstimate, in_loss: int, in_layer: int) -> int:
    """A micro-batch's activations at their peak with what FSDP2 holds in flight beside them in each phase
    (``in_loss``, ``in_layer``: :func:`syncwise.memory.plan.in_flight_bytes`): the larger of the two phases."""
    return act.saved_bytes + max(act.loss_phase_bytes + in_loss, act.layer_phase_bytes + in_layer)


class LayerActivationMeter:
    """What autograd saves for backward inside one decoder layer's forward -- the real layer, with its own
    activation function, norms, attention kernel and dropout -- on the micro-batch with the most tokens of a
    metered step: ``sample`` = (bytes, tokens). Parameters (gathered or not) are not counted; each storage once
    per call. The activation formula is Llama-shaped; this is what corrects it for other blocks (GPT-2)."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.sample: tuple[int, int] | None = None
        self._inside, self._seen, self._params, self._tokens = False, {}, set(), 0
        self._handles: list = []
        self._saved = None

    def __enter__(self) -> LayerActivationMeter:
        self._handles = [self.layer.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.layer.register_forward_hook(self._post)]
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not torch.is_grad_enabled() or not isinstance(hidden, torch.Tensor):
            return  # a forward-only pass, or a layer called in a way this does not follow
        self._inside, self._seen, self._tokens = True, {}, hidden.shape[:-1].numel()
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def _post(self, module: nn.Module, args: tuple, output) -> None:
        if self._inside and (self.sample is None or self._tokens > self.sample[1]):
            self.sample = (sum(self._seen.values()), self._tokens)
        self._inside = False

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._inside and not isinstance(tensor, nn.Parameter):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._params:
                self._seen[storage.data_ptr()] = storage.nbytes()
        return tensor
