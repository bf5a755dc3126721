"""What a loss function is given and gives back: the global normaliser (:class:`Normalizer`), its output
(:class:`LossOutput`), the batch keys it reads (:func:`reads`, checked before any micro-batch), and which
targets count (:func:`target_mask`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


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
    (without the ``dp_size`` factor) -- except those whose name ends in ``_max``, which are maxima over
    micro-batches and ranks (:func:`is_maximum`). ``outputs`` hold one row per sample of the micro-batch; the engine
    returns them for the whole batch in the original sample order.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


LossFn = Callable[[Any, dict[str, torch.Tensor], Normalizer], LossOutput]

LAYOUT_SHAPES = {"sample": "[B]", "token": "[B, T]", "target": "[B, T-1]"}


@dataclass(frozen=True)
class BatchKey:
    """A batch tensor a loss function reads: the layouts it may have (``sample`` [B], ``token`` [B, T],
    ``target`` [B, T-1]; see :func:`syncwise.data.packing.layout`) and whether the batch must have it."""

    layouts: tuple[str, ...]
    required: bool = True
    why: str = ""  # what needs it, for the error


def reads(loss_fn: LossFn, **keys: BatchKey) -> LossFn:
    """Declare the batch keys ``loss_fn`` reads, so the engine checks them with the rest of the batch on
    every rank, before any collective: a key missing on one rank is then a ``BatchError`` on all of them,
    not a ``KeyError`` on one and a hang (or a broken connection) on the others."""
    loss_fn.batch_keys = keys  # type: ignore[attr-defined]
    return loss_fn


def check_batch_keys(batch: dict[str, torch.Tensor], loss_fn: LossFn | None) -> None:
    """Raise ``BatchError`` naming the first key ``loss_fn`` declares that ``batch`` lacks or lays out wrong."""
    from ..data.batching import BatchError
    from ..data.packing import layout

    rows, width = batch["input_ids"].shape
    for key, spec in (getattr(loss_fn, "batch_keys", None) or {}).items():
        value = batch.get(key)
        shapes = " or ".join(LAYOUT_SHAPES[name] for name in spec.layouts)
        if value is None:
            if spec.required:
                raise BatchError(f"batch[{key!r}]: missing; {spec.why or 'the loss'} needs it ({shapes})")
            continue
        if layout(value, rows, width) not in spec.layouts:
            raise BatchError(f"batch[{key!r}]: shape {tuple(value.shape)} is not {shapes} "
                             f"(input_ids is {tuple(batch['input_ids'].shape)})")


def is_maximum(metric: str) -> bool:
    """Whether a loss metric is reduced by maximum (its name ends in ``_max``) rather than summed."""
    return metric.endswith("_max")


def target_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which next-token targets count, shape [B, T-1]: ``loss_mask`` (else ``attention_mask``) of the
    predicted token, where the predicting token is real too -- so a left-padded row never trains
    "padding -> first token" (the same targets a packed row keeps)."""
    attention = batch.get("attention_mask")
    mask = batch.get("loss_mask", attention)
    if mask is None:
        return torch.ones_like(batch["input_ids"][:, 1:], dtype=torch.float32)
    targets = mask[:, 1:].to(torch.float32)
    if attention is not None:
        targets = targets * (attention[:, :-1] * attention[:, 1:]).to(torch.float32)
    return targets
