"""Aggregating per-token losses over the global counts (token-mean and the sequence means), so that the
micro-batches' shares sum to the full batch's loss; and the SFT loss built on it."""

from __future__ import annotations

from typing import Any

import torch

from ..config import AGG_MODES
from .batch import LossFn, LossOutput, Normalizer, target_mask
from .logprobs import fused_head_ready, token_log_probs_and_predictions


def target_sequences(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Which sequence each target position belongs to, [R, T-1]: given by a packed micro-batch
    (``target_sequence``); None for the padded layout, where each row is one sequence."""
    return batch.get("target_sequence")


def sequence_sums(
    values: torch.Tensor, mask: torch.Tensor, sequences: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ masked values, Σ mask) of each sequence: per row, or grouped by ``sequences`` when packed."""
    masked = values * mask
    if sequences is None:
        return masked.sum(dim=1), mask.sum(dim=1)
    count = int(sequences.max()) + 1 if sequences.numel() else 0
    index = sequences.reshape(-1)
    sums = masked.new_zeros(count).index_add(0, index, masked.reshape(-1))
    counts = mask.new_zeros(count).index_add(0, index, mask.reshape(-1))
    return sums, counts


def per_position(per_sequence: torch.Tensor, like: torch.Tensor, sequences: torch.Tensor | None = None) -> torch.Tensor:
    """A per-sequence value at each target position of its sequence."""
    if sequences is None:
        return per_sequence.unsqueeze(1).expand_as(like)
    return per_sequence[sequences]


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, norm: Normalizer, norm_constant: float = 0.0,
    sequences: torch.Tensor | None = None,
):
    """This micro-batch's share of the full-batch aggregate of per-token ``values`` [B, T-1] (or [1, N-1]
    packed, with ``sequences`` from :func:`target_sequences`).

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
        sums, counts = sequence_sums(values, mask, sequences)
        return (sums / counts.clamp(min=1.0)).sum() / max(norm.sequences, 1.0)
    if mode == "seq-mean-token-sum-norm":
        constant = norm_constant if norm_constant > 0 else max(norm.max_target_len, 1.0)
        return masked.sum() / (max(norm.sequences, 1.0) * constant)
    raise ValueError(f"loss aggregation {mode!r} is not one of {', '.join(AGG_MODES)}")


def make_sft_loss(agg: str = "token-mean", norm_constant: float = 0.0) -> LossFn:
    """Cross-entropy on the loss-masked targets, aggregated with ``agg``."""
    if agg not in AGG_MODES:
        raise ValueError(f"loss aggregation {agg!r} is not one of {', '.join(AGG_MODES)}")

    def loss_fn(outputs: Any, micro_batch: dict[str, torch.Tensor], norm: Normalizer) -> LossOutput:
        mask = target_mask(micro_batch)
        log_probs, predictions = token_log_probs_and_predictions(outputs.logits, micro_batch["input_ids"])
        token_loss = -log_probs
        share = aggregate(token_loss, mask, agg, norm, norm_constant, target_sequences(micro_batch))
        with torch.no_grad():
            correct = (predictions == micro_batch["input_ids"][:, 1:]).float()
            accuracy = aggregate(correct, mask, "token-mean", norm)
        return LossOutput(
            loss=share * norm.dp_size,
            metrics={"loss": share.detach(), "token_accuracy": accuracy},
            outputs={"token_loss": token_loss.detach()},
        )

    return fused_head_ready(loss_fn)


sft_loss = make_sft_loss("token-mean")
sft_loss.__doc__ = "Token-mean cross-entropy: Σ masked token losses / global loss-token count."
