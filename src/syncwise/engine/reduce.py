"""The step's last collective: one all-reduce of its loss metrics and of what every rank must decide alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..losses import is_maximum
from ..runtime.distributed import agree
from ..runtime.signals import StopRequest


def reduce_step(
    local: dict[str, float], peak: int | None, budget: int, loads: Sequence[float], device: torch.device,
    timeout_s: float,
) -> tuple[dict[str, float], dict[str, Any]]:
    """One all-reduce for a step's loss metrics (summed) and what every rank must decide alike: the memory
    peak (the max over ranks) and auto's budget (the min), so auto chooses the same mode everywhere, and a
    stop signal received by any rank (see :mod:`syncwise.runtime.signals`); plus each rank's micro-batch
    workloads, for the cross-rank balance. Keys are sorted so every rank packs alike. Returns (metrics,
    agreed: peak, budget, stop, cross_rank_imbalance)."""
    summed = sorted(k for k in local if not is_maximum(k))
    maxima = sorted(k for k in local if is_maximum(k))
    own = [float(peak or 0), float(budget), float(StopRequest.received), *(local[k] for k in maxima), *loads]
    totals, per_rank = agree([local[k] for k in summed], own, "the metrics all-reduce (end of the step)", device,
                             timeout_s)
    metrics = dict(zip(summed, totals.tolist(), strict=True))
    metrics |= dict(zip(maxima, per_rank[:, 3 : 3 + len(maxima)].max(dim=0).values.tolist(), strict=True))
    work = per_rank[:, 3 + len(maxima) :]  # [rank, micro-batch]: all wait for the slowest at each collective
    mean = float(work.mean(dim=0).sum())
    return metrics, {
        "peak": int(per_rank[:, 0].max()) if peak is not None else None,
        "budget": int(per_rank[:, 1].min()),
        "stop": int(per_rank[:, 2].max()),
        "cross_rank_imbalance": float(work.max(dim=0).values.sum()) / mean if mean > 0 else 1.0,
    }
