"""Advantage estimators: GRPO (and Dr.GRPO), RLOO, GAE."""

from __future__ import annotations

import torch


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards: expected a 1-D tensor whose length ({rewards.numel()}) is a multiple of the group "
            f"size ({group_size})"
        )
    return rewards.float().view(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantages for consecutive groups of ``group_size`` samples of one prompt each:
    ``(r - mean_group) / (std_group + eps)`` (GRPO), or without the std division (Dr.GRPO)."""
    groups = _groups(rewards, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std and group_size > 1:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j``."""
    if group_size < 2:
        raise ValueError("rloo_advantages: needs group_size >= 2")
    groups = _groups(rewards, group_size)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).reshape(-1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mask = mask.float()
    count = mask.sum().clamp(min=1.0)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / (count - 1).clamp(min=1.0)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over token positions [B, T] (rewards usually on the last token).

    Masked-out positions are skipped: the recursion carries across them. Returns (advantages, returns),
    advantages whitened over the masked tokens when ``whiten``.
    """
    mask = mask.float()
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * mask[:, t] + next_value * (1 - mask[:, t])
        last = candidate * mask[:, t] + last * (1 - mask[:, t])
        advantages[:, t] = last
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages * mask, returns * mask
