"""How far a training step is from the machine's limit: the step's useful FLOPs over its time, divided by the
dense matmul rate measured in the same run, on the same threads, at the model's own shapes.

Useful FLOPs count what any implementation must compute for the real tokens (docs/perf_tuning.md, "How far
from the machine's limit"): for a sequence of L tokens, every matmul weight of P elements costs 2·P·L in
forward and, where it trains, 4·P·L in backward (the input's gradient and the weight's; a frozen weight --
LoRA's base -- only the input's, 2·P·L); causal attention costs 2·L²·D per layer forward (QKᵀ and AV over
the L²/2 pairs, D = heads × head dim) and twice that backward. The LM head is a matmul like the others
(tied or not); embeddings are lookups. What a step spends beyond that -- padding, the fused head's second
pass, recomputed checkpointed layers, the optimizer, communication, the framework -- is what the figure
shows missing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

GEMM_ROWS = 512  # tokens of the timed matmuls: a micro-batch's worth


def matmul_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) elements of the weights ``model`` multiplies activations by: every ``nn.Linear``
    and transformers ``Conv1D`` (GPT-2), the LM head included; embeddings excluded. Sharded (DTensor)
    weights count their global size."""
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


def step_flops(model: nn.Module, hf_config, lengths: Iterable[int]) -> float:
    """Useful FLOPs of one forward and backward over sequences of ``lengths`` real tokens (module docstring)."""
    trainable, frozen = matmul_params(model)
    layers, width = attention_width(hf_config)
    lengths = [int(n) for n in lengths]
    tokens, pairs = sum(lengths), sum(n * n for n in lengths)
    return (6 * trainable + 4 * frozen) * tokens + 6 * layers * width * pairs


def gemm_rate(hf_config, dtype: torch.dtype, device: torch.device, repeats: int = 3) -> float:
    """FLOP/s of ``torch.mm`` at the model's own shapes -- [512, hidden] x [hidden, vocabulary] and
    [512, hidden] x [hidden, FFN] -- in ``dtype`` on this rank's threads, the best of ``repeats``; averaged
    over the ranks, which time at the same moment (collective where a process group exists)."""
    hidden = int(hf_config.hidden_size)
    ffn = int(getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None) or 4 * hidden)
    shapes = [(GEMM_ROWS, hidden, int(hf_config.vocab_size)), (GEMM_ROWS, hidden, ffn)]
    if dist.is_initialized():
        dist.barrier()
    flops = seconds = 0.0
    for rows, inner, cols in shapes:
        a = torch.randn(rows, inner, dtype=dtype, device=device)
        b = torch.randn(inner, cols, dtype=dtype, device=device)
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms up
            _sync(device)
            start = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            best = min(best, time.perf_counter() - start)
        flops, seconds = flops + 2.0 * rows * inner * cols, seconds + best
    rate = torch.tensor([flops / seconds], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(rate)
        rate /= dist.get_world_size()
    return float(rate)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fraction_of_peak(flops_all_ranks: float, step_s: float, rate_per_rank: float, world_size: int) -> float:
    """The step's useful FLOPs per second over what ``world_size`` ranks multiply at ``rate_per_rank``."""
    return flops_all_ranks / step_s / (rate_per_rank * world_size) if step_s > 0 and rate_per_rank > 0 else 0.0
