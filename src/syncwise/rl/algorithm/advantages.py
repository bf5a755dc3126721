"""Advantage estimators: GRPO (and Dr.GRPO), RLOO, GAE."""

from __future__ import annotations

import torch


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rewards as [groups, group_size] in float64: group statistics of fp32 rewards are then exact sums."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards: expected a 1-D tensor whose length ({rewards.numel()}) is a multiple of the group "
            f"size ({group_size})"
        )
    return rewards.double().view(-1, group_size)


def uniform_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: the groups (``group_size`` consecutive samples) whose rewards are all equal -- their
    group-relative advantages are exactly zero, so the policy-gradient term learns nothing from them. The one
    place this is decided: the advantages zero them, ``rl.skip_uniform_groups`` leaves them out."""
    grouped = rewards.reshape(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


def _centred(groups: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
    """``groups - baseline``, exactly 0 in a group whose rewards are all equal: rounding in the mean
    (fp32 0.7 x 8 has mean 0.69999993) must not turn a group without signal into a systematic push."""
    uniform = uniform_groups(groups, groups.shape[1])[:, None]
    return torch.where(uniform, torch.zeros_like(groups), groups - baseline)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantages (fp32) for consecutive groups of ``group_size`` samples of one prompt each:
    ``(r - mean_group) / (std_group + eps)`` (GRPO), or without the std division (Dr.GRPO).

    Statistics in float64, and a group whose rewards are all equal gets exactly 0 (the reference engine
    gives 0.056 for eight rewards of 0.7). A group of one is its own mean: advantage 0, nothing to learn
    (``syncwise train`` refuses ``rl.samples_per_prompt=1``)."""
    groups = _groups(rewards, group_size)
    centered = _centred(groups, groups.mean(dim=1, keepdim=True))
    if norm_by_std and group_size > 1:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1).float()


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j`` (float64 statistics; 0 for a uniform group)."""
    if group_size < 2:
        raise ValueError("rloo_advantages: needs group_size >= 2")
    groups = _groups(rewards, group_size)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return _centred(groups, others).reshape(-1).float()


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
