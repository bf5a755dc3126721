"""Loss functions and the global normaliser that makes accumulated gradients equal the full-batch gradient.

A loss function is called once per micro-batch as ``loss_fn(model_outputs, micro_batch, normalizer)`` and
returns a :class:`LossOutput`. Its ``loss`` must be the micro-batch's share of the *full-batch* loss: a sum
over the micro-batch divided by a *global* count (all micro-batches, all DP ranks), multiplied by
``normalizer.dp_size`` because data-parallel gradient reduction averages over ranks. Summed over every
micro-batch and rank, the shares then give exactly the full-batch loss and gradient, however the batch is
split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Normalizer:
    """Global counts over all micro-batches and DP ranks of one optimizer step (one all-reduce)."""

    tokens: float  # loss tokens (target positions with loss_mask set)
    sequences: float  # sequences with at least one loss token
    dp_size: int
    max_target_len: float = 0.0  # longest loss span of any sequence (seq-mean-token-sum-norm's default)


@dataclass
class LossOutput:
    """A micro-batch's loss share, its metrics, and optional per-sample outputs.

    ``metrics`` are *summed* over micro-batches and ranks, so report global shares the way ``loss`` is
    (without the ``dp_size`` factor). ``outputs`` hold one row per sample of the micro-batch; the engine
    returns them for the whole batch in the original sample order.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


LossFn = Callable[[Any, dict[str, torch.Tensor], Normalizer], LossOutput]


def target_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which next-token targets count, shape [B, T-1]: ``loss_mask`` (else ``attention_mask``) shifted."""
    mask = batch.get("loss_mask")
    if mask is None:
        mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(batch["input_ids"])
    return mask[:, 1:].to(torch.float32)


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token, shape [B, T-1], computed in fp32."""
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    return -F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def sft_loss(outputs: Any, micro_batch: dict[str, torch.Tensor], norm: Normalizer) -> LossOutput:
    """Token-mean cross-entropy: Σ masked token losses / global loss-token count."""
    mask = target_mask(micro_batch)
    token_loss = -token_log_probs(outputs.logits, micro_batch["input_ids"])
    loss_sum = (token_loss * mask).sum()
    share = loss_sum / max(norm.tokens, 1.0)
    with torch.no_grad():
        correct = (outputs.logits[:, :-1].argmax(-1) == micro_batch["input_ids"][:, 1:]).float()
        accuracy = (correct * mask).sum() / max(norm.tokens, 1.0)
    return LossOutput(
        loss=share * norm.dp_size,
        metrics={"loss": share.detach(), "token_accuracy": accuracy},
        outputs={"token_loss": token_loss.detach()},
    )
