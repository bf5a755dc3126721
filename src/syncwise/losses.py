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

from .config import AGG_MODES


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
    batch, width = input_ids.shape
    # Cross-entropy over contiguous [tokens, vocab] rows: markedly faster than over a transposed
    # [B, vocab, T] view for large vocabularies.
    flat = logits[:, :-1].float().reshape(batch * (width - 1), -1)
    return -F.cross_entropy(flat, input_ids[:, 1:].reshape(-1), reduction="none").view(batch, width - 1)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, norm: Normalizer, norm_constant: float = 0.0):
    """This micro-batch's share of the full-batch aggregate of per-token ``values`` [B, T-1].

    - ``token-mean``: Σ masked values / global loss tokens
    - ``seq-mean-token-sum``: Σ_seq (Σ its values) / global sequences
    - ``seq-mean-token-mean``: Σ_seq (mean of its values) / global sequences
    - ``seq-mean-token-sum-norm``: Σ masked values / (global sequences × ``norm_constant``; default the
      longest loss span in the global batch)

    Summed over every micro-batch and DP rank this is exactly the full-batch value (no ``dp_size``
    factor here; see :class:`LossOutput`).
    """
    masked = values * mask
    if mode == "token-mean":
        return masked.sum() / max(norm.tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(norm.sequences, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(norm.sequences, 1.0)
    if mode == "seq-mean-token-sum-norm":
        constant = norm_constant if norm_constant > 0 else max(norm.max_target_len, 1.0)
        return masked.sum() / (max(norm.sequences, 1.0) * constant)
    raise ValueError(f"loss aggregation {mode!r} is not one of {', '.join(AGG_MODES)}")


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each target position, [B, T-1], in fp32."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def make_sft_loss(agg: str = "token-mean", norm_constant: float = 0.0) -> LossFn:
    """Cross-entropy on the loss-masked targets, aggregated with ``agg``."""
    if agg not in AGG_MODES:
        raise ValueError(f"loss aggregation {agg!r} is not one of {', '.join(AGG_MODES)}")

    def loss_fn(outputs: Any, micro_batch: dict[str, torch.Tensor], norm: Normalizer) -> LossOutput:
        mask = target_mask(micro_batch)
        token_loss = -token_log_probs(outputs.logits, micro_batch["input_ids"])
        share = aggregate(token_loss, mask, agg, norm, norm_constant)
        with torch.no_grad():
            correct = (outputs.logits[:, :-1].argmax(-1) == micro_batch["input_ids"][:, 1:]).float()
            accuracy = aggregate(correct, mask, "token-mean", norm)
        return LossOutput(
            loss=share * norm.dp_size,
            metrics={"loss": share.detach(), "token_accuracy": accuracy},
            outputs={"token_loss": token_loss.detach()},
        )

    return loss_fn


sft_loss = make_sft_loss("token-mean")
sft_loss.__doc__ = "Token-mean cross-entropy: Σ masked token losses / global loss-token count."
