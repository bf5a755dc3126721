"""Planning one batch: validate it, agree with the other ranks in one all-reduce, split it.

The all-reduce carries the loss-token and sequence counts (the global normaliser), an error flag (a rank
with bad input makes every rank raise instead of leaving the others waiting) and, in one slot per rank,
each rank's micro-batch count and longest loss span. Every rank then runs the largest count, so deferred
collectives line up even when ranks hold different amounts of data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batching import Batch, BatchError, MicroBatch, microbatches_needed, split_batch
from ..config import EngineConfig
from ..distributed import agree
from ..losses import Normalizer, target_mask


@dataclass
class BatchPlan:
    """This rank's micro-batches and the normaliser every rank shares."""

    micro_batches: list[MicroBatch]
    normalizer: Normalizer
    target_width: int  # columns of per-target outputs (log-probs) in the original batch


def check_token_ids(batch: Batch, vocab_size: int | None) -> None:
    """Token ids must index the embedding: an id out of range would fail inside one rank's forward,
    leaving the others in a collective."""
    if vocab_size is None:
        return
    ids = batch["input_ids"]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise BatchError(
            f"batch['input_ids']: ids must lie in [0, {vocab_size}) (the model's vocabulary), "
            f"got {int(ids.min())}..{int(ids.max())}"
        )


def plan_batch(
    batch: Batch,
    cfg: EngineConfig,
    *,
    dp_size: int,
    device: torch.device,
    timeout_s: float,
    require_tokens: bool,
    vocab_size: int | None = None,
) -> BatchPlan:
    """Validate ``batch``, agree with every rank (one all-reduce), and split it into micro-batches."""
    error: BatchError | None = None
    sums, own = [0.0, 0.0, 0.0], [0.0, 0.0]  # [tokens, sequences, bad ranks], [micro-batches, longest span]
    try:
        needed = microbatches_needed(batch, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
        check_token_ids(batch, vocab_size)
        per_sequence = target_mask(batch).sum(dim=1)
        sums[:2] = [float(per_sequence.sum()), float((per_sequence > 0).sum())]
        own = [float(needed), float(per_sequence.max())]
    except BatchError as exc:
        error = exc
        sums[2] = 1.0
    totals, per_rank = agree(sums, own, "the all-reduce of batch statistics (start of the step)", device, timeout_s)
    if error is not None:
        raise error
    if totals[2] > 0:
        raise BatchError(f"batch: invalid on {int(totals[2])} other rank(s); see the error raised there")
    if require_tokens and totals[0] == 0:
        raise BatchError("batch: loss_mask (or attention_mask) leaves no target token on any rank: nothing to train on")
    micro_batches = split_batch(
        batch, int(per_rank[:, 0].max()), balance=cfg.max_tokens_per_micro_batch > 0,
        linear_coef=cfg.workload_linear_coef,
    )
    norm = Normalizer(
        tokens=float(totals[0]), sequences=float(totals[1]), dp_size=dp_size,
        max_target_len=float(per_rank[:, 1].max()),
    )
    return BatchPlan(micro_batches, norm, target_width=batch["input_ids"].shape[1] - 1)
