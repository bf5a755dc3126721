"""How far a training step is from the machine's limit: the step's useful FLOPs
(:class:`syncwise.models.flops.UsefulFlops`) over its time, divided by the dense matmul rate measured in the
same run, on the same threads, at the model's own shapes (docs/perf_tuning.md, "How far from the machine's
limit").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...memory.calibrate import best_matmul_seconds

GEMM_ROWS = 512  # tokens of the timed matmuls: a micro-batch's worth


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
        best = best_matmul_seconds(a, b, repeats + 1)  # one more: the first warms up
        flops, seconds = flops + 2.0 * rows * inner * cols, seconds + best
    rate = torch.tensor([flops / seconds], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(rate)
        rate /= dist.get_world_size()
    return float(rate)


def fraction_of_peak(flops_all_ranks: float, step_s: float, rate_per_rank: float, world_size: int) -> float:
    """The step's useful FLOPs per second over what ``world_size`` ranks multiply at ``rate_per_rank``."""
    return flops_all_ranks / step_s / (rate_per_rank * world_size) if step_s > 0 and rate_per_rank > 0 else 0.0


def gemm_rate_worker(model_dir: str, dtype: str, out_file: str) -> None:
    """On every local rank of a launched job (:func:`syncwise.runtime.launcher.launch_local`): the GEMM rate
    at the shapes of the model in ``model_dir``, all ranks timing at once on their own threads as a job's
    ranks run; rank 0 writes it (FLOP/s per rank) to ``out_file``. For workloads that time whole jobs."""
    from pathlib import Path

    from transformers import AutoConfig

    from ...runtime.distributed import run_rank

    def body(info) -> None:
        rate = gemm_rate(AutoConfig.from_pretrained(model_dir), getattr(torch, dtype), info.device)
        if info.is_main:
            Path(out_file).write_text(str(rate))

    run_rank(body)
