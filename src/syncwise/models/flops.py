"""The useful FLOPs of a training step: what any implementation must compute for the real tokens.

For a sequence of L tokens, every matmul weight of P elements costs 2·P·L in forward and, where it trains,
4·P·L in backward (the input's gradient and the weight's; a frozen weight -- LoRA's base -- only the input's,
2·P·L); causal attention costs 2·L²·D per layer forward (QKᵀ and AV over the L²/2 unmasked pairs, D = heads ×
head dim) and twice that backward. The LM head is a matmul like the others (tied or not); embeddings are
lookups. A mixture of experts' token uses k of each MoE layer's E experts (and its router), so the experts count
at k / E (:mod:`syncwise.models.moe`). Padding, the fused head's second pass, recomputed checkpointed layers, the
optimizer and the framework are not useful work: a step's useful FLOPs over its time, against the machine's
matmul rate, say how much of it they take (``syncwise bench``'s roofline figure, docs/perf_tuning.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from .moe import experts_per_token, is_fused_experts, is_router


def matmul_params(model: nn.Module, hf_config=None) -> tuple[int, int]:
    """(trainable, frozen) elements of the weights ``model`` multiplies each token by: every ``nn.Linear``
    and transformers ``Conv1D`` (GPT-2), the LM head and a value head included, a MoE router's weight, and a
    MoE layer's fused experts at the share a token uses (k of E, :mod:`syncwise.models.moe`; ``hf_config``,
    default the model's own, says k); embeddings excluded. Sharded (DTensor) weights count their global size."""
    routed = experts_per_token(hf_config if hf_config is not None else getattr(model, "config", None))
    trainable = frozen = 0
    for module in model.modules():
        if routed is not None and is_fused_experts(module):
            top_k, experts = routed
            weights = [(p.numel() // experts * top_k, p.requires_grad) for p in module.parameters(recurse=False)]
        elif isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D" or is_router(module):
            weights = [(module.weight.numel(), module.weight.requires_grad)] if module.weight is not None else []
        else:
            continue
        for count, trains in weights:
            if trains:
                trainable += count
            else:
                frozen += count
    return trainable, frozen


def attention_width(hf_config) -> tuple[int, int]:
    """(decoder layers, heads x head dim) of a Hugging Face config."""
    heads = int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads
    return int(hf_config.num_hidden_layers), heads * int(head_dim)


@dataclass(frozen=True)
class UsefulFlops:
    """A model's useful FLOPs per real token and per (token, token) pair of a sequence, forward and backward."""

    per_token: int
    per_pair: int

    @classmethod
    def of(cls, model: nn.Module, hf_config) -> UsefulFlops:
        """Of ``model`` as it trains (count before wrapping: FSDP1 flattens the weights); zero where
        ``hf_config`` is not a decoder's (a model that is not a Hugging Face one)."""
        if hf_config is None or not hasattr(hf_config, "num_attention_heads"):
            return cls(0, 0)
        trainable, frozen = matmul_params(model, hf_config)
        layers, width = attention_width(hf_config)
        return cls(6 * trainable + 4 * frozen, 6 * layers * width)

    def step(self, tokens: float, pairs: float) -> float:
        """Of a step whose sequences hold ``tokens`` real tokens and ``pairs`` = Σ L² (the engine's
        ``perf/useful_flops``, over every rank: the roofline figure's numerator)."""
        return self.per_token * tokens + self.per_pair * pairs

    def of_lengths(self, lengths: Iterable[int]) -> float:
        lengths = [int(n) for n in lengths]
        return self.step(sum(lengths), sum(n * n for n in lengths))
