"""Split a batch (dict of tensors, one row per sample) into micro-batches, and put outputs back in order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Batch = dict[str, torch.Tensor]


class BatchError(ValueError):
    """The batch cannot be trained on; the message names the key and the problem."""


@dataclass
class MicroBatch:
    indices: torch.Tensor  # positions of its samples in the original batch
    data: Batch


def batch_size_of(batch: Batch) -> int:
    """Validate the batch layout and return its number of samples."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise BatchError(f"batch: needs key 'input_ids' (got {keys})")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise BatchError(f"batch['input_ids']: expected a 2-D tensor [batch, seq], got {_describe(input_ids)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise BatchError(f"batch['input_ids']: expected an integer dtype, got {input_ids.dtype}")
    size = input_ids.shape[0]
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise BatchError(f"batch[{key!r}]: expected a tensor, got {type(value).__name__}")
        if value.dim() == 0 or value.shape[0] != size:
            raise BatchError(
                f"batch[{key!r}]: first dimension {tuple(value.shape)[:1]} does not match "
                f"input_ids' batch size {size}"
            )
        if key in ("attention_mask", "loss_mask") and value.shape != input_ids.shape:
            raise BatchError(
                f"batch[{key!r}]: shape {tuple(value.shape)} does not match input_ids {tuple(input_ids.shape)}"
            )
    if size == 0:
        raise BatchError("batch: is empty (0 samples)")
    return size


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def num_microbatches(batch_size: int, micro_batch_size: int) -> int:
    return math.ceil(batch_size / micro_batch_size)


def split_fixed(batch: Batch, micro_batch_size: int) -> list[MicroBatch]:
    """Consecutive micro-batches of ``micro_batch_size`` samples (the last may be smaller)."""
    size = batch_size_of(batch)
    out = []
    for start in range(0, size, micro_batch_size):
        indices = torch.arange(start, min(start + micro_batch_size, size))
        out.append(MicroBatch(indices, {k: v[indices] for k, v in batch.items()}))
    return out


def restore_order(chunks: list[torch.Tensor], micro_batches: list[MicroBatch]) -> torch.Tensor:
    """Concatenate per-micro-batch outputs and undo the split's permutation.

    Trailing dimensions may differ between chunks (micro-batches trimmed to their own longest sequence):
    each is right-padded with zeros to the longest first.
    """
    if not chunks:
        raise ValueError("restore_order: no chunks")
    if chunks[0].dim() > 1:
        width = max(c.shape[1] for c in chunks)
        chunks = [F.pad(c, (0, 0) * (c.dim() - 2) + (0, width - c.shape[1])) for c in chunks]
    merged = torch.cat(chunks)
    order = torch.cat([mb.indices for mb in micro_batches])
    restored = torch.empty_like(merged)
    restored[order] = merged
    return restored
