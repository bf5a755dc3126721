"""The useful FLOPs of a training step: what any implementation must compute for the real tokens.

For a sequence of L tokens, every matmul weight of P elements costs 2·P·L in forward and, where it trains,
4·P·L in backward (the input's gradient and the weight's; a frozen weight -- LoRA's base -- only the input's,
2·P·L); causal attention costs 2·L²·D per layer forward (QKᵀ and AV over the L²/2 unmasked pairs, D = heads ×
head dim) and twice that backward. The LM head is a matmul like the others (tied or not); embeddings are
lookups. Padding, the fused head's second pass, recomputed checkpointed layers, the optimizer and the
framework are not useful work: a step's useful FLOPs over its time, against the machine's matmul rate, say
how much of it they take (``syncwise bench``'s roofline figure, docs/perf_tuning.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn


def matmul_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) elements of the weights ``model`` multiplies activations by: every ``nn.Linear``
    and transformers ``Conv1D`` (GPT-2), the LM head and a value head included; embeddings excluded. Sharded
    (DTensor) weights count their global size."""
    trainable = frozen = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or not (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"):
            continue
        if weight.requires_grad:
            trainable += weight.numel()
        else:
            frozen += weight.numel()
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
        trainable, frozen = matmul_params(model)
        layers, width = attention_width(hf_config)
        return cls(6 * trainable + 4 * frozen, 6 * layers * width)

    def step(self, tokens: float, pairs: float) -> float:
        """Of a step whose sequences hold ``tokens`` real tokens and ``pairs`` = Σ L² (the engine's
        ``perf/useful_flops``, over every rank: the roofline figure's numerator)."""
        return self.per_token * tokens + self.per_pair * pairs

    def of_lengths(self, lengths: Iterable[int]) -> float:
        lengths = [int(n) for n in lengths]
        return self.step(sum(lengths), sum(n * n for n in lengths))
