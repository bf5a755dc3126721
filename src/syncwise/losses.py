"""Loss functions and the global normaliser that makes accumulated gradients equal the full-batch gradient.

A loss function is called once per micro-batch as ``loss_fn(model_outputs, micro_batch, normalizer)`` and
returns a :class:`LossOutput`. Its ``loss`` must be the micro-batch's share of the *full-batch* loss: a sum
over the micro-batch divided by a *global* count (all micro-batches, all DP ranks), multiplied by
``normalizer.dp_size`` because data-parallel gradient reduction averages over ranks. Summed over every
micro-batch and rank, the shares then give exactly the full-batch loss and gradient, however the batch is
split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

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
    from .data.batching import BatchError
    from .data.packing import layout

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


# Tokens whose vocabulary-wide fp32 log-softmax exists at once (engine.logprob_chunk_size; 0: all).
_CHUNK_TOKENS: ContextVar[int] = ContextVar("syncwise_logprob_chunk_tokens", default=1024)


@contextmanager
def logprob_chunking(tokens: int) -> Iterator[None]:
    """Within the block, :func:`token_log_probs` and :func:`token_entropy` work ``tokens`` at a time."""
    reset = _CHUNK_TOKENS.set(tokens)
    try:
        yield
    finally:
        _CHUNK_TOKENS.reset(reset)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 / fp16 logits are upcast; fp64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunks(positions: int, rows: int) -> list[slice]:
    tokens = _CHUNK_TOKENS.get()
    step = positions if tokens <= 0 else max(1, tokens // max(rows, 1))
    return [slice(start, min(start + step, positions)) for start in range(0, positions, step)]


class _TokenStats(torch.autograd.Function):
    """For j < T - 1: log softmax(logits[:, j] / T)[input_ids[:, j + 1]] and, when asked, the entropy of
    softmax(logits[:, j] / T) -- a chunk of positions at a time.

    Nothing vocabulary-wide is kept between chunks, nor between forward and backward: forward keeps each
    position's log-sum-exp ([B, T-1]); backward recomputes a chunk's softmax straight into the logits'
    gradient (one preallocated tensor) and finishes it there in place -- times -g, plus g at the target,
    (and the entropy term), divided by T -- so memory beyond the logits and their gradient stays at one chunk
    (none for fp32 logits without entropy) whatever the length and vocabulary, with fewer passes over the
    [tokens, vocabulary] data than autograd's log_softmax + gather (``syncwise bench --workload loss``)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, with_entropy: bool):
        rows, width, _ = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        log_probs = logits.new_empty((rows, width - 1), dtype=dtype)
        lse = logits.new_empty((rows, width - 1), dtype=dtype)
        entropy = logits.new_empty((rows, width - 1) if with_entropy else (0,), dtype=dtype)
        parts = _chunks(width - 1, rows)
        for part in parts:
            scaled = _scaled(logits[:, part], temperature)
            lse[:, part] = torch.logsumexp(scaled, dim=-1)
            log_probs[:, part] = scaled.gather(-1, input_ids[:, 1:][:, part, None]).squeeze(-1) - lse[:, part]
            if with_entropy:  # H = -Σ p log p = lse - Σ p x, the sum as a batched dot product (no temporary)
                probs = torch.sub(scaled, lse[:, part, None]).exp_()
                dots = torch.bmm(probs.reshape(-1, 1, probs.shape[-1]), scaled.reshape(-1, probs.shape[-1], 1))
                entropy[:, part] = lse[:, part] - dots.view(lse[:, part].shape)
        ctx.save_for_backward(logits, input_ids, lse, entropy)
        ctx.temperature, ctx.parts, ctx.with_entropy = temperature, parts, with_entropy
        ctx.mark_non_differentiable(input_ids)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, input_ids, lse, entropy = ctx.saved_tensors
        targets = input_ids[:, 1:]
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        grad[:, -1] = 0  # the last position predicts nothing
        in_place = logits.dtype == lse.dtype  # fp32 logits: the chunk is computed in the gradient itself
        entropy_grad = ctx.with_entropy and grad_entropy is not None
        for part in ctx.parts:
            scaled = _scaled(logits[:, part], temperature)
            shift = lse[:, part, None]
            chunk = grad[:, part] if in_place else None
            log_p = torch.sub(scaled, shift, out=chunk) if chunk is not None else scaled - shift
            g = grad_log_probs[:, part, None].to(log_p.dtype) if grad_log_probs is not None else None
            if entropy_grad:  # dH/dx = -p (log p + H); d log p_y / dx = onehot(y) - p
                factor = (log_p + entropy[:, part, None]) * grad_entropy[:, part, None]
                if g is not None:
                    factor += g
                log_p.exp_().mul_(factor).neg_()
            else:
                log_p.exp_().mul_(-g if g is not None else 0.0)
            if g is not None:
                log_p.scatter_add_(-1, targets[:, part, None], g)
            if temperature != 1.0:
                log_p.div_(temperature)
            if chunk is None:
                grad[:, part] = log_p
        return grad, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in at least fp32 (a view, no copy, for fp32 logits at temperature 1)."""
    logits = _fp32(logits)
    return logits if temperature == 1.0 else logits / temperature


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token under softmax(logits / temperature), shape [B, T-1], in fp32,
    a chunk of positions at a time (see :func:`logprob_chunking`)."""
    return _TokenStats.apply(logits, input_ids, float(temperature), False)[0]


def token_log_probs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_log_probs` and the entropy of each next-token distribution, [B, T-1] each, from one pass
    (one gradient buffer: asking for them separately would hold two logits-sized gradients)."""
    return _TokenStats.apply(logits, input_ids, float(temperature), True)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution softmax(logits / temperature) at each target position,
    [B, T-1], in fp32, a chunk of positions at a time."""
    ids = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    return _TokenStats.apply(logits, ids, float(temperature), True)[1]


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
        token_loss = -token_log_probs(outputs.logits, micro_batch["input_ids"])
        share = aggregate(token_loss, mask, agg, norm, norm_constant, target_sequences(micro_batch))
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
