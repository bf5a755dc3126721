"""Which of a rank's samples each optimizer step of an RL step trains on (``rl.epochs`` x ``rl.mini_batches``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...config import RLConfig


def mini_batches(batch: dict[str, torch.Tensor], rl: RLConfig, seed: int, step: int, rank: int
                 ) -> Iterator[dict[str, torch.Tensor]]:
    """Each epoch, the rank's samples in an order seeded by (seed, step, epoch, rank) -- a resumed run repeats
    it -- split into ``rl.mini_batches`` parts; with one mini-batch, the whole batch."""
    size = batch["input_ids"].shape[0]
    for epoch in range(rl.epochs):
        order = torch.arange(size)
        if rl.mini_batches > 1:
            seeded = ((seed * 1_000_003 + step) * 1009 + epoch) * 101 + rank
            order = torch.randperm(size, generator=torch.Generator().manual_seed(seeded))
        for part in order.tensor_split(rl.mini_batches):
            yield {key: value[part] for key, value in batch.items()}
