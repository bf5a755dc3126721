"""PPO with a learned critic (``rl.algorithm=ppo``): the value model, token-level rewards, GAE with
advantages whitened over every rank's response tokens, and the critic's metrics.

One PPO step adds to GRPO's (see :mod:`syncwise.rl.trainer`)::

    critic.values(batch)                     forward-only critic pass: V(prefix) at every target position
    token_rewards                            the sequence reward on its last response token, minus
                                             rl.kl_in_reward x KL(old || reference) on every response token
    gae_advantages, whiten_across_ranks      GAE (rl.gamma, rl.lam) per sequence; advantages whitened over
                                             the whole batch's response tokens (two small all-reduces)
    critic.update(parts)                     the clipped value loss over the actor's mini-batches and epochs
    actor update                             the policy loss on the token-level advantages
                                             (after critic.warmup_steps)

The critic is the policy's architecture with a one-output head (:func:`syncwise.models.build_model` with
``value_head=True``), trained by its own :class:`~syncwise.engine.Engine`, so every sync mode, auto's memory
decision and the collective audit apply to it as to the actor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ...config import Config
from ...engine import Engine
from ...losses import LossOutput, Normalizer, reads, target_mask
from ...models import build_model
from ...models.moe import ROUTES
from ...runtime.distributed import DistInfo, agree
from .advantages import gae_advantages
from .losses import ValueLossConfig, make_value_loss

WHITEN_EPS = 1e-8  # verl's masked_whiten


def token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """[B, T-1] rewards per target position: each sequence's reward on its last counted target (its last
    response token), minus ``kl_coef`` x ``kl`` on every counted target (verl's ``apply_kl_penalty``).
    A row without counted targets gets nothing."""
    mask = mask.float()
    out = torch.zeros_like(mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards.float().to(mask.device)[rows]
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.float() * mask
    return out


def masked_sums(values: torch.Tensor, mask: torch.Tensor, info: DistInfo, timeout_s: float,
                what: str) -> tuple[float, float]:
    """(sum of ``values`` over ``mask``, count) over every rank, in float64 (one all-reduce)."""
    mask = mask.double()
    totals, _ = agree([float((values.double() * mask).sum()), float(mask.sum())], [], what, info.device, timeout_s)
    return float(totals[0]), float(totals[1])


def whiten_across_ranks(values: torch.Tensor, mask: torch.Tensor, info: DistInfo, timeout_s: float) -> torch.Tensor:
    """verl's ``masked_whiten`` over the response tokens of every rank's rows: (x - mean) / sqrt(var + 1e-8),
    with the unbiased variance, zero where ``mask`` is 0. Two passes (sum, then squared deviations) in
    float64: the same numbers whichever way the rows are split over ranks."""
    total, count = masked_sums(values, mask, info, timeout_s, "the advantage whitening (mean)")
    if count < 2:
        raise ValueError(f"whitening the advantages needs at least 2 response tokens over all ranks, got {count:g}")
    mean = total / count
    squares, _ = masked_sums((values.double() - mean) ** 2, mask, info, timeout_s, "the advantage whitening (var)")
    var = squares / (count - 1)
    return ((values.double() - mean) / (var + WHITEN_EPS) ** 0.5 * mask.double()).to(values.dtype)


def ppo_advantages(
    batch: dict[str, torch.Tensor], config: Config, info: DistInfo, kl: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages [B, T-1] whitened over every rank's response tokens, returns [B, T-1], the critic's
    metrics) from ``batch``'s sequence ``rewards`` [B] and the critic's ``values`` [B, T-1]."""
    rl, timeout_s = config.rl, config.dist.timeout_s
    mask = target_mask(batch)
    values = batch["values"].float() * mask
    rewards = token_rewards(batch["rewards"], mask, kl, rl.kl_in_reward)
    raw, returns = gae_advantages(rewards, values, mask, rl.gamma, rl.lam, whiten=False)
    advantages = whiten_across_ranks(raw, mask, info, timeout_s)
    metrics = value_metrics(values, returns, advantages, mask, info, timeout_s)
    if kl is not None and rl.kl_in_reward:  # verl's names
        total, count = masked_sums(kl, mask, info, timeout_s, "the reward's KL penalty")
        metrics["actor/reward_kl_penalty"] = total / max(count, 1.0)
        metrics["actor/reward_kl_penalty_coeff"] = rl.kl_in_reward
    return advantages, returns, metrics


def value_metrics(values: torch.Tensor, returns: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  info: DistInfo, timeout_s: float) -> dict[str, float]:
    """Over every rank's response tokens (one all-reduce): the means of the values, returns and (whitened)
    advantages, and ``critic/vf_explained_var`` = 1 - Var(returns - values) / Var(returns) (verl's, with its
    1e-5 in the denominator): 1 for a critic that predicts the returns exactly, 0 for one no better than
    their mean."""
    m = mask.double()
    v, r, a = values.double() * m, returns.double() * m, advantages.double() * m
    sums = [m.sum(), v.sum(), r.sum(), a.sum(), (r * r).sum(), (r - v).sum(), ((r - v) ** 2).sum()]
    totals, _ = agree([float(x) for x in sums], [], "the critic's metrics", info.device, timeout_s)
    count, v_sum, r_sum, a_sum, r_sq, d_sum, d_sq = totals.tolist()
    count = max(count, 1.0)
    unbiased = count / max(count - 1.0, 1.0)
    var_returns = (r_sq / count - (r_sum / count) ** 2) * unbiased
    var_diff = (d_sq / count - (d_sum / count) ** 2) * unbiased
    return {
        "critic/values_mean": v_sum / count,
        "critic/returns_mean": r_sum / count,
        "critic/advantages_mean": a_sum / count,
        "critic/vf_explained_var": 1.0 - var_diff / (var_returns + 1e-5),
    }


def _value_outputs(outputs: Any, micro_batch: dict[str, torch.Tensor], norm: Normalizer) -> LossOutput:
    """A forward-only pass's per-target values [B, T-1] (the value at position t is V(tokens <= t), the
    baseline of target t + 1)."""
    values = outputs.logits[:, :-1, 0].float()
    return LossOutput(loss=values.new_zeros(()), outputs={"values": values})


value_outputs = reads(_value_outputs)


class Critic:
    """PPO's value model and its engine (its own optimizer, sync mode and memory decision: ``critic.*`` over
    the actor's keys, :meth:`~syncwise.config.Config.critic_config`)."""

    def __init__(self, config: Config, info: DistInfo, total_steps: int, **config_overrides: Any):
        self.config = config.critic_config()
        model_cfg = self.config.model  # the policy's path, preset and seed unless critic.model.* says otherwise
        # dropout as the actor's: the values of the forward-only pass are those the value loss clips around
        model_cfg = replace(model_cfg, dropout="keep" if model_cfg.dropout == "keep" else "off")
        self.model_path = model_cfg.path
        model = build_model(model_cfg, value_head=True, deferred=True, **config_overrides)
        self.engine = Engine(self.config, model, info, total_steps=total_steps)
        self.engine.governor.name = "critic"  # its auto decisions are printed as the critic's
        self.loss_fn = make_value_loss(ValueLossConfig(clip=config.critic.cliprange_value))

    def describe(self) -> str:
        """One phrase for the job's first line: where the critic comes from and how it trains."""
        model = self.config.model
        source = model.path or f"preset {model.preset}"
        lora = f", LoRA rank {model.lora.rank}" if model.lora.rank else ""
        return (f"critic: {source} with a zero-initialised value head{lora}, lr {self.config.optim.lr:g}, "
                f"sync.mode={self.config.sync.mode}")

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T-1] values of ``batch`` (forward only)."""
        return self.engine.forward_batch(_own_routes(batch), value_outputs).outputs["values"]

    def update(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One optimizer step per mini-batch; the critic's metrics of the last (its losses averaged)."""
        updates = [self.engine.train_batch(_own_routes(part), self.loss_fn) for part in parts]
        row: dict[str, Any] = {}
        for key, value in updates[-1].items():
            if key.startswith("critic/"):
                row[key] = sum(u[key] for u in updates) / len(updates)
            elif key != "loss":  # the engine's own metrics, under the critic's name
                row[f"critic/{key}"] = value
        row["critic/stop/signal"] = max(u["stop/signal"] for u in updates)  # a stop requested in any
        row["critic/train/skipped"] = sum(u["train/skipped"] for u in updates)
        row["critic/train/optimizer_steps"] = len(updates)
        return row


def _own_routes(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch without the policy sampler's routes: a mixture-of-experts critic routes by its own routers (router
    replay is the policy's: its ratios compare the sampler's network with the trainer's)."""
    return {key: value for key, value in batch.items() if key != ROUTES}
