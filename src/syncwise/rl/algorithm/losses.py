"""Policy, value and KL losses for RL post-training, as engine loss functions.

Each factory returns a ``loss_fn(outputs, micro_batch, normalizer) -> LossOutput`` whose loss is the
micro-batch's share of the full-batch loss (see :mod:`syncwise.losses`). Batch keys, per target token
([B, T-1], aligned with ``input_ids[:, 1:]``) unless said otherwise:

- ``loss_mask`` [B, T] (the response tokens), ``attention_mask`` [B, T]
- ``old_log_probs``: log-probs of the policy that sampled (missing: on-policy, the current ones detached)
- ``advantages``: [B] (one per sequence) or [B, T-1]
- ``ref_log_probs``: for the KL penalty
- ``rollout_log_probs``: the sampler's log-probs (the behaviour policy's), for the rollout importance correction
  (``rl.loss.rollout_is``) or the three-policy loss (``rl.loss.off_policy``): the ratio is then to the proximal
  policy (``old_log_probs``, the policy at the start of the update), each token weighted by proximal / behaviour
- value loss: ``returns`` and ``values`` (old values); the critic's ``outputs.logits[..., 0]`` are values
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...config import KL_ESTIMATORS, Config, PolicyLossConfig
from ...data.batching import BatchError
from ...losses import (
    BatchKey,
    LossFn,
    LossOutput,
    Normalizer,
    aggregate,
    fused_head_ready,
    per_position,
    reads,
    sequence_sums,
    target_mask,
    target_sequences,
    token_log_probs,
    token_log_probs_and_entropy,
)

__all__ = ["PolicyLossConfig", "ValueLossConfig", "kl_penalty", "make_policy_loss", "make_value_loss",
           "policy_token_losses", "rollout_is_weights", "behavior_log_ratio", "behavior_weights"]

# verl's bounds (core_algos): a log-ratio beyond ±20 is treated as ±20 before any exponential; GSPO's
# sequence log-ratio is capped at 10.
LOG_RATIO_BOUND = 20.0
GSPO_LOG_RATIO_MAX = 10.0


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str, clamp: float = 10.0
) -> torch.Tensor:
    """Per-token KL(π || π_ref) estimates, with d = log π - log π_ref: k1 = d, k2 = ½ d²,
    k3 = e^{-d} + d - 1 (the low-variance, always non-negative estimator).

    k3 exactly as verl's ``low_var_kl``: d is bounded to ±20 before the exponential, then the k3 *value* to
    [-``clamp``, ``clamp``] (default 10; 0: no value bound), so a far-off token contributes at most
    ``clamp`` and no gradient -- rather than e^{|d|}. k1 and k2 are not bounded (nor are they in verl)."""
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        k3 = torch.exp(-log_ratio) + log_ratio - 1.0
        return k3.clamp(-clamp, clamp) if clamp > 0 else k3
    raise ValueError(f"kl estimator {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


def behavior_log_ratio(
    proximal_log_probs: torch.Tensor, behavior_log_probs: torch.Tensor, mask: torch.Tensor, level: str,
    sequences: torch.Tensor | None = None,
) -> torch.Tensor:
    """log(proximal / behaviour) per token (``token``), or each sequence's sum on every token of it
    (``sequence``: the log of the product of its tokens' ratios); 0 outside ``mask``; detached."""
    log_ratio = (proximal_log_probs - behavior_log_probs).detach() * mask
    if level == "sequence":
        sums, _ = sequence_sums(log_ratio, mask, sequences)
        return per_position(sums, log_ratio, sequences)
    if level != "token":
        raise ValueError(f"level: {level!r} is not one of token, sequence")
    return log_ratio


def behavior_weights(log_ratio: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """The weight w = exp(``log_ratio``) of each token's policy loss, as ``mode`` bounds it: ``tis`` truncates it
    at ``cap`` (verl's truncated IS); ``mis`` zeroes it outside [1/cap, cap] (verl's masked IS); ``decoupled``
    zeroes it above ``cap`` (AReaL's decoupled PPO). The log-weight is bounded before the exponential, so
    nothing overflows."""
    log_cap = math.log(cap)
    weights = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, log_cap))
    if mode == "tis":
        return weights
    if mode == "decoupled":
        return torch.where(log_ratio > log_cap, torch.zeros_like(weights), weights)
    if mode == "mis":
        return torch.where(log_ratio.abs() > log_cap, torch.zeros_like(weights), weights)
    raise ValueError(f"off_policy: {mode!r} is not one of decoupled, tis, mis")


def rollout_is_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, level: str, cap: float,
    sequences: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token importance weights, per-token capped indicator) correcting for a sampler that differs from
    the trainer (verl's rollout correction, TRL's vLLM importance sampling): exp(old - sampler) per token
    (``token``) or exp(Σ_seq (old - sampler)) for every token of a sequence (``sequence``), truncated at
    ``cap``; detached."""
    log_ratio = behavior_log_ratio(old_log_probs, rollout_log_probs, mask, level, sequences)
    return behavior_weights(log_ratio, "tis", cap), (log_ratio > math.log(cap)).float()


def _per_token(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return value.float().unsqueeze(1).expand_as(like) if value.dim() == 1 else value.float()


def policy_token_losses(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    cfg: PolicyLossConfig, sequences: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token policy-gradient loss, per-token clipped indicator) for ``cfg.kind``. ``sequences``: which
    sequence each position belongs to in a packed row (GSPO's ratio is per sequence)."""
    low, high = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    # Bounded before exp as the reference does: one token far off the old policy cannot make the ratio inf.
    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if cfg.kind == "pg":
        return -advantages * log_probs, torch.zeros_like(log_probs)
    if cfg.kind == "cispo":
        # MiniMax-M1: the importance weight, detached, bounded from above only (the paper tunes only
        # ε_high); the gradient flows through the log-probability, so clipped tokens still learn.
        weight = torch.exp(log_ratio).detach()
        clipped_weight = weight.clamp(max=high)
        return -clipped_weight * advantages * log_probs, (clipped_weight != weight).float()
    if cfg.kind == "gspo":
        # Sequence-level ratio exp(mean log-ratio); its value per token, gradient through each token.
        sums, counts = sequence_sums(log_ratio, mask, sequences)
        seq_log_ratio = per_position(sums / counts.clamp(min=1), log_ratio, sequences)
        ratio = torch.exp((seq_log_ratio.detach() + log_probs - log_probs.detach()).clamp(max=GSPO_LOG_RATIO_MAX))
    else:
        ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = (clipped > unclipped).float()
    if cfg.dual_clip:
        capped = torch.minimum(loss, -advantages * cfg.dual_clip)
        is_clipped = torch.where((advantages < 0) & (capped < loss), torch.ones_like(is_clipped), is_clipped)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, is_clipped


def _sampler_weights(
    proximal: torch.Tensor, micro_batch: dict[str, torch.Tensor], mask: torch.Tensor,
    sequences: torch.Tensor | None, cfg: PolicyLossConfig, norm: Normalizer, metrics: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Each token's weight against the sampler's log-probs (``rollout_log_probs``: the behaviour policy's),
    by ``rl.loss.rollout_is`` or ``rl.loss.off_policy``, with its metrics."""
    key = f"rl.loss.rollout_is={cfg.rollout_is}" if cfg.corrects_rollout else f"rl.loss.off_policy={cfg.off_policy}"
    sampler = micro_batch.get("rollout_log_probs")
    if sampler is None:
        raise BatchError(f"batch['rollout_log_probs']: {key} needs the sampler's per-target log-probs [B, T-1]")
    sampler = sampler.float()
    if cfg.corrects_rollout:
        weights, capped = rollout_is_weights(proximal, sampler, mask, cfg.rollout_is, cfg.rollout_is_cap, sequences)
        metrics["rollout/is_weight_mean"] = aggregate(weights, mask, "token-mean", norm)
        metrics["rollout/is_weight_max"] = (weights * mask).max() if mask.numel() else mask.new_zeros(())
        metrics["rollout/is_capped_fraction"] = aggregate(capped, mask, "token-mean", norm)
        return weights
    log_ratio = behavior_log_ratio(proximal, sampler, mask, cfg.behavior_level, sequences)
    weights = behavior_weights(log_ratio, cfg.off_policy, cfg.behavior_cap)
    out_of_band = (log_ratio.abs() > math.log(cfg.behavior_cap)).float()
    metrics["rollout/behavior_weight_mean"] = aggregate(weights, mask, "token-mean", norm)
    metrics["rollout/behavior_out_of_band"] = aggregate(out_of_band, mask, "token-mean", norm)
    # k3 of KL(behaviour || proximal) per token, on the tokens the behaviour policy drew
    metrics["rollout/mismatch_kl"] = aggregate(kl_penalty(sampler, proximal.detach(), "k3", 0.0), mask,
                                               "token-mean", norm)
    return weights


def make_policy_loss(cfg: PolicyLossConfig | None = None, temperature: float = 1.0) -> LossFn:
    """The actor's loss: policy gradient (``cfg.kind``), minus an entropy bonus, plus a KL penalty.

    Log-probs and entropy are those of softmax(logits / ``temperature``): the distribution the rollout
    sampled from (``rl.temperature``), as the old and reference log-probs are. With ``cfg.rollout_is``, each
    token's policy loss is weighted by :func:`rollout_is_weights` (batch key ``rollout_log_probs``); ``auto``
    is resolved by a job's :class:`~syncwise.config.Config` from its sampler, and is ``none`` here without one.

    Metrics: the importance ratio's mean and max, the clipped fraction, ``actor/approx_kl`` (k2: mean of
    ½ (new - old)² over response tokens), ``actor/ppo_kl`` (k1: mean of old - new, what verl reports under
    that name), and with the correction ``rollout/is_weight_mean``, ``_max``, ``rollout/is_capped_fraction``.

    With ``cfg.off_policy`` (samples drawn by an older policy) the loss is the three-policy one: the ratio to the
    proximal policy (``old_log_probs``; on-policy the update's own), each token weighted by
    :func:`behavior_weights` of proximal / behaviour (``rollout_log_probs``); metrics
    ``rollout/behavior_weight_mean``, ``rollout/behavior_out_of_band`` (the fraction of tokens whose ratio leaves
    [1/cap, cap]) and ``rollout/mismatch_kl`` (k3 of KL(behaviour || proximal))."""
    cfg = (cfg or PolicyLossConfig()).validate()

    def loss_fn(outputs: Any, micro_batch: dict[str, torch.Tensor], norm: Normalizer) -> LossOutput:
        mask = target_mask(micro_batch)
        ids = micro_batch["input_ids"]
        if cfg.entropy_coef:  # one pass, one gradient buffer for both
            log_probs, token_ent = token_log_probs_and_entropy(outputs.logits, ids, temperature)
        else:
            log_probs = token_log_probs(outputs.logits, ids, temperature)
        old = micro_batch.get("old_log_probs")
        old = log_probs.detach() if old is None else old.float()
        advantages = _per_token(micro_batch["advantages"], log_probs)
        sequences = target_sequences(micro_batch)
        token_loss, is_clipped = policy_token_losses(log_probs, old, advantages, mask, cfg, sequences)
        metrics: dict[str, torch.Tensor] = {}
        if cfg.corrects_rollout or cfg.corrects_behavior:
            token_loss = token_loss * _sampler_weights(old, micro_batch, mask, sequences, cfg, norm, metrics)
        def agg(values: torch.Tensor) -> torch.Tensor:
            return aggregate(values, mask, cfg.agg, norm, cfg.norm_constant, sequences)

        pg = agg(token_loss)
        total = pg
        metrics["actor/pg_loss"] = pg.detach()
        if cfg.entropy_coef:
            entropy = agg(token_ent)
            total = total - cfg.entropy_coef * entropy
            metrics["actor/entropy"] = entropy.detach()
        if cfg.kl_coef:
            kl = agg(kl_penalty(log_probs, micro_batch["ref_log_probs"].float(), cfg.kl_estimator, cfg.kl_clamp))
            total = total + cfg.kl_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        with torch.no_grad():
            log_ratio = log_probs - old
            ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)) * mask
            metrics["actor/clip_fraction"] = aggregate(is_clipped, mask, "token-mean", norm)
            metrics["actor/approx_kl"] = aggregate(0.5 * log_ratio**2, mask, "token-mean", norm)  # k2
            metrics["actor/ppo_kl"] = aggregate(-log_ratio, mask, "token-mean", norm)  # k1, verl's actor/ppo_kl
            metrics["actor/ratio_mean"] = aggregate(ratio, mask, "token-mean", norm)
            metrics["actor/ratio_max"] = ratio.max() if ratio.numel() else ratio.new_zeros(())  # a maximum
        metrics["loss"] = total.detach()
        return LossOutput(loss=total * norm.dp_size, metrics=metrics, outputs={"log_probs": log_probs.detach()})

    why = f"the policy loss (rl.loss.kind={cfg.kind})"
    keys = {"advantages": BatchKey(("sample", "target"), why=why),
            "old_log_probs": BatchKey(("target",), required=False)}
    if cfg.kl_coef:
        keys["ref_log_probs"] = BatchKey(("target",), why=f"the KL penalty (rl.loss.kl_coef={cfg.kl_coef})")
    if cfg.corrects_rollout:
        keys["rollout_log_probs"] = BatchKey(("target",), why=f"rl.loss.rollout_is={cfg.rollout_is}")
    elif cfg.corrects_behavior:
        keys["rollout_log_probs"] = BatchKey(("target",), why=f"rl.loss.off_policy={cfg.off_policy}")
    return fused_head_ready(reads(loss_fn, **keys))


@dataclass
class ValueLossConfig:
    clip: float = 0.2  # value clipping around the old values (0: off)
    agg: str = "token-mean"


def make_value_loss(cfg: ValueLossConfig | None = None) -> LossFn:
    """The critic's loss: ½ max((V - R)², (V_old + clip(V - V_old, ±c) - R)²), aggregated."""
    cfg = cfg or ValueLossConfig()

    def loss_fn(outputs: Any, micro_batch: dict[str, torch.Tensor], norm: Normalizer) -> LossOutput:
        mask = target_mask(micro_batch)
        values = outputs.logits[:, :-1, 0].float()
        returns = micro_batch["returns"].float()
        loss_unclipped = (values - returns) ** 2
        if cfg.clip:
            old = micro_batch["values"].float()
            clipped_values = old + (values - old).clamp(-cfg.clip, cfg.clip)
            loss_clipped = (clipped_values - returns) ** 2
            token_loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
            clipped = (loss_clipped > loss_unclipped).float()
        else:
            token_loss = 0.5 * loss_unclipped
            clipped = torch.zeros_like(token_loss)
        share = aggregate(token_loss, mask, cfg.agg, norm, sequences=target_sequences(micro_batch))
        metrics = {"loss": share.detach(), "critic/vf_loss": share.detach(),
                   "critic/vf_clipfrac": aggregate(clipped, mask, "token-mean", norm).detach()}
        return LossOutput(loss=share * norm.dp_size, metrics=metrics, outputs={"values": values.detach()})

    keys = {"returns": BatchKey(("target",), why="the value loss")}
    if cfg.clip:
        keys["values"] = BatchKey(("target",), why=f"the value loss's clipping (clip={cfg.clip})")
    return reads(loss_fn, **keys)


def describe_correction(config: Config) -> str:
    """What weighs the sampler's log-probs into the loss, for the first line (the autos resolved in the config,
    from the sampler, rl.off_policy_lag and rl.max_staleness)."""
    lag, loss, stale = config.rl.off_policy_lag, config.rl.loss, config.rl.max_staleness
    lagged = (f"off-policy: step t trains on samples drawn by the policy of step t - {lag} (rl.off_policy_lag), "
              if lag else "")
    if stale:
        lagged = (f"partial rollouts carried across steps, each group started at most {stale} version(s) before "
                  f"the step that trains it (rl.max_staleness), ")
    if loss.corrects_behavior:
        how = {"decoupled": f"masked above {loss.behavior_cap:g}", "tis": f"truncated at {loss.behavior_cap:g}",
               "mis": f"masked outside [1/{loss.behavior_cap:g}, {loss.behavior_cap:g}]"}[loss.off_policy]
        return (f"{lagged}rl.loss.off_policy={loss.off_policy}: the ratio to the proximal policy, each "
                f"{loss.behavior_level}'s loss weighted by proximal / behaviour, {how}")
    level = loss.rollout_is
    if level == "none":
        return lagged + ("rl.loss.rollout_is=none (the sampler computes the trainer's network)"
                         if not config.sampler_differs
                         else "rl.loss.rollout_is=none (no correction, though the sampler differs from the trainer)")
    return (f"{lagged}rl.loss.rollout_is={level}: each token's loss weighted by exp(old - sampler log-prob), "
            f"capped at {loss.rollout_is_cap:g}")
