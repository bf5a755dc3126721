"""The optimizer step: global gradient norm (one all-reduce), clipping, a skipped step on a non-finite
norm, and the LR schedule."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..config import OptimConfig
from ..runtime.distributed import collective_timeout, local_tensor

FUSED_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW kernel


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW is torch's fused kernel where every parameter's device has one (one pass over each parameter
    instead of a dozen elementwise ops: 4x faster on CPU for 7.5M parameters, as torchtitan defaults to on
    GPU); SGD is torch's."""
    params = [p for p in params if p.requires_grad]
    if cfg.name == "adamw":
        fused = bool(params) and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.name: {cfg.name!r} is not one of adamw, sgd")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int | None
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over ``warmup_steps``, then constant or cosine decay to 10% at ``total_steps``."""
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "cosine" and total_steps:
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def global_grad_norm(
    model: nn.Module, group: dist.ProcessGroup | None, sharded: bool, device: torch.device, timeout_s: float
) -> torch.Tensor:
    """Global L2 norm of the gradients, correct for sharded (FSDP1/FSDP2) and replicated ones.

    Each rank sums the squares of its local gradient shards; for sharded gradients one all-reduce over the
    shard group adds them up (HSDP replicas hold the same shards, so they are not added again). The sum
    travels on ``device``: with CPU offload the gradients live in host memory, but NCCL takes only CUDA
    tensors.
    """
    grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum().to(device)
    if sharded:
        with collective_timeout("the gradient-norm all-reduce", timeout_s):
            dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_and_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
    norm: float, clip: float,
) -> bool:
    """Clip to ``clip`` (0: off), step, zero the gradients. A non-finite ``norm`` skips the update (the
    gradients are still zeroed). Returns whether the optimizer stepped."""
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return False
    if clip > 0 and norm > clip:
        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, clip / (norm + 1e-6))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return True
