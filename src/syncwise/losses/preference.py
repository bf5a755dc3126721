"""Preference losses as TRL defines them -- DPO's ``sigmoid``, ``ipo``, ``hinge`` and ``robust`` (``DPOTrainer``,
trl 1.16) and SimPO (``CPOTrainer``'s ``simpo``) -- from each pair's summed completion log-probs, and the losses that
train them through the engine.

A pair's loss is not linear in its sequences' log-probs. Where the engine keeps each pair in one micro-batch
(``batch['row_group']``), :func:`pair_loss` computes it in the update's own forward, as TRL does. Where a pair
cannot fit one micro-batch (a fixed ``engine.max_tokens_per_micro_batch`` below it), a step scores the pairs first
(:func:`pair_losses` on the log-probs of a forward-only pass), takes each sequence's gradient coefficient
``dL / d log p(sequence)`` by autograd (:func:`sequence_coefficients`), and trains :func:`coefficient_loss`: the
sum of coefficient x log-prob, linear per sequence -- its gradient is the loss's exactly, however the
micro-batches split the pairs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ..data.batching import ROW_GROUP
from .batch import BatchKey, LossFn, LossOutput, Normalizer, reads, target_mask
from .logprobs import fused_head_ready, token_log_probs


@dataclass(frozen=True)
class PreferenceSettings:
    """``dpo.loss_type`` (with its weights), ``dpo.beta``, ``dpo.label_smoothing``, ``dpo.simpo_gamma``."""

    losses: tuple[str, ...] = ("sigmoid",)
    weights: tuple[float, ...] = (1.0,)
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def reference_free(self) -> bool:
        """SimPO: no reference model's log-probs."""
        return self.losses == ("simpo",)


@dataclass
class PairScores:
    """Per pair: its loss (the weighted sum of the loss types), and TRL's logged quantities."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor  # as TRL logs them: summed (DPO), length-averaged (SimPO)
    rejected_logps: torch.Tensor


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                ref_rejected: torch.Tensor | None, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
                settings: PreferenceSettings) -> PairScores:
    """Each pair's loss from the policy's summed completion log-probs (``chosen``, ``rejected``: [P]), the
    reference's (None for SimPO) and the completions' token counts."""
    beta, smoothing = settings.beta, settings.label_smoothing
    if settings.losses == ("simpo",):  # CPOTrainer: length-averaged log-probs, no reference, a margin gamma
        chosen_avg, rejected_avg = chosen / chosen_tokens, rejected / rejected_tokens
        logits = chosen_avg - rejected_avg - settings.simpo_gamma / beta
        loss = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
        return PairScores(loss * settings.weights[0], beta * chosen_avg, beta * rejected_avg, chosen_avg,
                          rejected_avg)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    total = torch.zeros_like(delta)
    for name, weight in zip(settings.losses, settings.weights, strict=True):
        if name == "sigmoid":
            loss = -F.logsigmoid(beta * delta)
        elif name == "hinge":
            loss = torch.relu(1 - beta * delta)
        elif name == "ipo":  # TRL: the log-ratios averaged over each completion's tokens, then eq. 17
            ipo = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            loss = (ipo - 1 / (2 * beta)) ** 2
        elif name == "robust":
            clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
            flipped = -smoothing * F.logsigmoid(-beta * delta)
            loss = (clean - flipped) / (1 - 2 * smoothing)
        else:
            raise ValueError(f"dpo.loss_type: {name!r} is not a preference loss")
        total = total + weight * loss
    return PairScores(total, beta * chosen_ratio, beta * rejected_ratio, chosen, rejected)


def sequence_coefficients(chosen: torch.Tensor, rejected: torch.Tensor, score: Any, pairs: int) -> torch.Tensor:
    """Each sequence's ``dL / d log p`` for the step's loss L = (1 / ``pairs``) x the sum of these pairs' losses
    (``score(chosen, rejected)`` -> :class:`PairScores`): [2P], pair k's chosen at 2k, its rejected at 2k + 1."""
    chosen = chosen.detach().double().requires_grad_(True)
    rejected = rejected.detach().double().requires_grad_(True)
    (score(chosen, rejected).loss.sum() / pairs).backward()
    return torch.stack([chosen.grad, rejected.grad], dim=1).reshape(-1).float()


def sequence_log_probs(log_probs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probs, trained tokens) of each row's completion, from a forward pass's per-target
    ``log_probs`` [B, T-1]."""
    mask = target_mask(batch)
    return (log_probs.double() * mask).sum(dim=1), mask.sum(dim=1)


def _coefficient_loss(outputs: Any, micro_batch: dict[str, torch.Tensor], norm: Normalizer) -> LossOutput:
    mask = target_mask(micro_batch)
    log_probs = token_log_probs(outputs.logits, micro_batch["input_ids"])
    coefficient = micro_batch["sequence_coefficient"]
    coefficient = coefficient.unsqueeze(1) if coefficient.dim() == 1 else coefficient  # packed: per target already
    share = (coefficient * log_probs * mask).sum()
    return LossOutput(loss=share * norm.dp_size)


coefficient_loss: LossFn = fused_head_ready(reads(_coefficient_loss, sequence_coefficient=BatchKey(
    ("sample", "target"), why="the preference loss's per-sequence coefficients")))
coefficient_loss.__doc__ = ("The sum over sequences of (coefficient x its completion's log-prob), each "
                            "``sequence_coefficient`` already the step's dL / d log p: its gradient is the preference "
                            "loss's.")


PAIR_SIDE = "pair_side"  # [B]: 0 for a pair's chosen row, 1 for its rejected
REF_LOG_PROB = "ref_log_prob"  # [B]: the reference's summed completion log-prob of each row (not for SimPO)


def _pair_loss(outputs: Any, micro_batch: dict[str, torch.Tensor], norm: Normalizer,
               settings: PreferenceSettings) -> LossOutput:
    mask = target_mask(micro_batch)
    log_probs = token_log_probs(outputs.logits, micro_batch["input_ids"])

    def per_target(key: str) -> torch.Tensor:  # a per-sample key on the targets' layout (packed: already)
        value = micro_batch[key]
        return value.unsqueeze(1).expand_as(mask) if value.dim() == 1 else value

    # each target's sequence as (pair, side); packed rows carry both on every target of theirs
    sequence = (per_target(ROW_GROUP).long() * 2 + per_target(PAIR_SIDE).long()).reshape(-1)
    keys, slot = torch.unique(sequence, return_inverse=True)
    sums = torch.zeros(len(keys), dtype=torch.float64, device=mask.device)
    sums = sums.index_add(0, slot, (log_probs.double() * mask).reshape(-1))
    tokens = torch.zeros_like(sums).index_add(0, slot, mask.double().reshape(-1))
    chosen, rejected = keys % 2 == 0, keys % 2 == 1
    if not torch.equal(keys[chosen] // 2, keys[rejected] // 2):
        raise RuntimeError("pair_loss: a preference pair's rows are in different micro-batches (batch['row_group'] "
                           "keeps them together)")
    ref_c = ref_r = None
    if REF_LOG_PROB in micro_batch:
        ref = torch.zeros_like(sums).scatter(0, slot, per_target(REF_LOG_PROB).double().reshape(-1))
        ref_c, ref_r = ref[chosen], ref[rejected]
    scores = pair_losses(sums[chosen], sums[rejected], ref_c, ref_r, tokens[chosen], tokens[rejected], settings)
    pairs = norm.sequences / 2  # every pair's two rows have trained tokens (data/preference.py refuses the rest)
    return LossOutput(loss=(scores.loss.sum() / pairs * norm.dp_size).to(log_probs.dtype),
                      outputs={"log_probs": log_probs.detach()})


def pair_loss(settings: PreferenceSettings) -> LossFn:
    """The step's preference loss (1 / pairs x the sum of its pairs' losses) computed in the update's forward,
    each micro-batch's pairs whole in it (``batch['row_group']``: the pair's index, ``pair_side``, and
    ``ref_log_prob`` but for SimPO); the policy's per-target ``log_probs`` are its outputs, for the logged
    scores."""
    loss_fn = partial(_pair_loss, settings=settings)
    return fused_head_ready(reads(loss_fn, **{
        ROW_GROUP: BatchKey(("sample", "target"), why="the pair each row belongs to"),
        PAIR_SIDE: BatchKey(("sample", "target"), why="whether a row is its pair's chosen or rejected"),
        REF_LOG_PROB: BatchKey(("sample", "target"), required=not settings.reference_free,
                               why="the reference's log-probs"),
    }))
