"""Log-probs and entropy of the targets, a chunk of tokens at a time: from the logits (their vocabulary-wide fp32
log-softmax never exists for more than ``engine.logprob_chunk_size`` tokens at once), or -- under the fused LM
head -- straight from the final hidden states, so the [tokens, vocabulary] logits and their gradient never
exist at all."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data.ulysses import ShardedLogits
from .batch import LossFn

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


def _chunk_stats(
    scaled: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-sum-exp, log-prob of ``targets``, entropy or None) of one chunk of scaled fp32 logits [..., V]."""
    lse = torch.logsumexp(scaled, dim=-1)
    log_probs = scaled.gather(-1, targets[..., None]).squeeze(-1) - lse
    if not with_entropy:
        return lse, log_probs, None
    # H = -sum p log p = lse - sum p x, the sum as a batched dot product (no second temporary)
    probs = torch.sub(scaled, lse[..., None]).exp_()
    dots = torch.bmm(probs.reshape(-1, 1, probs.shape[-1]), scaled.reshape(-1, probs.shape[-1], 1))
    return lse, log_probs, lse - dots.view(lse.shape)


def _chunk_logit_grad(
    scaled: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None, targets: torch.Tensor,
    grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, temperature: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient with respect to one chunk's (unscaled) logits, in fp32, computed in ``out`` when given
    (it may be ``scaled`` itself): d log p_y / dx = onehot(y) - p, dH / dx = -p (log p + H), both / T."""
    log_p = torch.sub(scaled, lse[..., None], out=out) if out is not None else scaled - lse[..., None]
    g = grad_log_probs[..., None].to(log_p.dtype) if grad_log_probs is not None else None
    if entropy is not None and grad_entropy is not None:
        factor = (log_p + entropy[..., None]) * grad_entropy[..., None]
        if g is not None:
            factor += g
        log_p.exp_().mul_(factor).neg_()
    else:
        log_p.exp_().mul_(-g if g is not None else 0.0)
    if g is not None:
        log_p.scatter_add_(-1, targets[..., None], g)
    if temperature != 1.0:
        log_p.div_(temperature)
    return log_p


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
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
        rows, width = targets.shape  # the first `width` positions predict (all but the last, or a shard's all)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        log_probs = logits.new_empty((rows, width), dtype=dtype)
        lse = logits.new_empty((rows, width), dtype=dtype)
        entropy = logits.new_empty((rows, width) if with_entropy else (0,), dtype=dtype)
        parts = _chunks(width, rows)
        for part in parts:
            stats = _chunk_stats(_scaled(logits[:, part], temperature), targets[:, part], with_entropy)
            lse[:, part], log_probs[:, part] = stats[0], stats[1]
            if with_entropy:
                entropy[:, part] = stats[2]
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.parts, ctx.with_entropy = temperature, parts, with_entropy
        ctx.mark_non_differentiable(targets)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, targets, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        grad[:, targets.shape[1]:] = 0  # the last position predicts nothing
        in_place = logits.dtype == lse.dtype  # fp32 logits: the chunk is computed in the gradient itself
        for part in ctx.parts:
            chunk = _chunk_logit_grad(
                _scaled(logits[:, part], ctx.temperature), lse[:, part],
                entropy[:, part] if ctx.with_entropy else None, targets[:, part],
                None if grad_log_probs is None else grad_log_probs[:, part],
                grad_entropy[:, part] if ctx.with_entropy and grad_entropy is not None else None, ctx.temperature,
                out=grad[:, part] if in_place else None,
            )
            if not in_place:
                grad[:, part] = chunk
        return grad, None, None, None


@dataclass
class LogitsFromHidden:
    """What stands for a micro-batch's logits under the fused LM head (``engine.fused_lm_head``): the final
    hidden states [B, T, H] and the output layer's weight [V, H] (and bias) as the model's forward used
    them. :func:`token_log_probs` and its siblings compute logits from them one chunk of tokens at a time,
    so neither the [B, T, V] logits nor their gradient ever exist at once."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """The shape the logits would have."""
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))


class _HeadTokenStats(torch.autograd.Function):
    """:class:`_TokenStats` from the hidden states: each chunk's logits are ``hidden @ weight.T (+ bias)``,
    made in forward for its statistics, dropped, and made again in backward, where their gradient turns at
    once into the chunk's hidden-state gradient and is added into the weight's (and bias's). Kept between
    forward and backward: the log-sum-exp (and entropy) per position; in flight: one chunk's logits and
    their gradient -- whatever the length and vocabulary.

    A frozen output layer (LoRA, a reference model's pass under autograd) needs only the hidden states'
    gradient, which is linear in the incoming one: forward then also keeps E_p[W] = p @ W per position (and
    E_p[log p · W] with entropy), [tokens, hidden] each, and backward makes no logits at all -- as many
    matrix multiplies as materialised logits cost (one more in forward with entropy)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                temperature: float, with_entropy: bool, with_predictions: bool):
        rows, width = targets.shape  # the first `width` positions predict
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        log_probs = hidden.new_empty((rows, width), dtype=dtype)
        lse = hidden.new_empty((rows, width), dtype=dtype)
        entropy = hidden.new_empty((rows, width) if with_entropy else (0,), dtype=dtype)
        predictions = targets.new_empty((rows, width) if with_predictions else (0,))
        parts = _chunks(width, rows)
        # the hidden states need a gradient, the layer's parameters none: keep E_p[W] (and E_p[log p W])
        frozen = ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3])
        expected = hidden.new_zeros((2 if with_entropy else 1, *hidden.shape), dtype=dtype) if frozen else None
        for part in parts:
            logits = F.linear(hidden[:, part], weight, bias)
            if with_predictions:
                predictions[:, part] = logits.argmax(-1)
            scaled = _scaled(logits, temperature)
            stats = _chunk_stats(scaled, targets[:, part], with_entropy)
            lse[:, part], log_probs[:, part] = stats[0], stats[1]
            if with_entropy:
                entropy[:, part] = stats[2]
            if expected is not None:
                log_p = torch.sub(scaled, stats[0][..., None])
                probs = log_p.exp()  # in the weight's dtype for the multiply, as autograd's gradient would be
                expected[0, :, part] = probs.to(weight.dtype) @ weight
                if with_entropy:
                    expected[1, :, part] = probs.mul_(log_p).to(weight.dtype) @ weight
                del log_p, probs
            del logits, scaled, stats
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, expected)
        ctx.temperature, ctx.parts, ctx.with_entropy = temperature, parts, with_entropy
        ctx.mark_non_differentiable(predictions)
        return log_probs, entropy, predictions

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, _grad_predictions):
        hidden, weight, bias, targets, lse, entropy, expected = ctx.saved_tensors
        if expected is not None:
            return (_frozen_head_hidden_grad(hidden, weight, targets, entropy if ctx.with_entropy else None,
                                             expected, grad_log_probs, grad_entropy, ctx.temperature),
                    None, None, None, None, None, None)
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        if grad_hidden is not None:
            grad_hidden[:, targets.shape[1]:] = 0  # the last position predicts nothing
        # Summed over the chunks in the weight's own dtype, as Liger's fused linear cross-entropy does: an fp32
        # sum of a bf16 head would hold V x H x 4 bytes more, more than the bf16 logits it replaces.
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.promote_types(bias.dtype, torch.float32)) if want_bias else None
        for part in ctx.parts:
            h = hidden[:, part]
            scaled = _scaled(F.linear(h, weight, bias), ctx.temperature)  # a fresh tensor: worked on in place
            chunk = _chunk_logit_grad(
                scaled, lse[:, part], entropy[:, part] if ctx.with_entropy else None, targets[:, part],
                None if grad_log_probs is None else grad_log_probs[:, part],
                grad_entropy[:, part] if ctx.with_entropy and grad_entropy is not None else None,
                ctx.temperature, out=scaled,
            ).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[:, part] = chunk @ weight
            flat = chunk.reshape(-1, chunk.shape[-1])
            if grad_weight is not None:
                grad_weight.addmm_(flat.T, h.reshape(-1, h.shape[-1]))
            if grad_bias is not None:
                grad_bias += flat.sum(0, dtype=grad_bias.dtype)
            del scaled, chunk, flat
        return (
            grad_hidden,
            grad_weight,
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None,
        )


def _frozen_head_hidden_grad(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor | None,
    expected: torch.Tensor, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, temperature: float,
) -> torch.Tensor:
    """The hidden states' gradient through a frozen output layer, from forward's expectations:
    d log p_y / dh = (W_y - E_p[W]) / T and dH / dh = -(E_p[log p W] + H E_p[W]) / T."""
    grad = torch.zeros_like(expected[0])
    width = targets.shape[1]  # the positions that predict
    if grad_log_probs is not None:
        grad[:, :width] += grad_log_probs[..., None] * (F.embedding(targets, weight).to(grad.dtype)
                                                        - expected[0, :, :width])
    if entropy is not None and grad_entropy is not None:
        grad[:, :width] -= grad_entropy[..., None] * (expected[1, :, :width]
                                                      + entropy[..., None] * expected[0, :, :width])
    if temperature != 1.0:
        grad /= temperature
    return grad.to(hidden.dtype)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in at least fp32 (a view, no copy, for fp32 logits at temperature 1)."""
    logits = _fp32(logits)
    return logits if temperature == 1.0 else logits / temperature


Logits = torch.Tensor | LogitsFromHidden | ShardedLogits


def _stats(logits: Logits, input_ids: torch.Tensor, temperature: float, with_entropy: bool,
           with_predictions: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropy, predictions) from logits or, under the fused LM head, the hidden states; under
    sequence parallelism (:class:`ShardedLogits`) this rank's positions' values, gathered from the group."""
    if isinstance(logits, ShardedLogits):
        return _sharded_stats(logits, input_ids, temperature, with_entropy, with_predictions)
    return _local_stats(logits, input_ids[:, 1:], temperature, with_entropy, with_predictions)


def _local_stats(logits: torch.Tensor | LogitsFromHidden, targets: torch.Tensor, temperature: float,
                 with_entropy: bool, with_predictions: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`_stats` of the positions that predict ``targets`` [B, P] (the first P)."""
    if isinstance(logits, LogitsFromHidden):
        return _HeadTokenStats.apply(logits.hidden, logits.weight, logits.bias, targets, float(temperature),
                                     with_entropy, with_predictions)
    log_probs, entropy = _TokenStats.apply(logits, targets, float(temperature), with_entropy)
    predictions = None
    if with_predictions:
        with torch.no_grad():
            predictions = logits[:, :targets.shape[1]].argmax(-1)
    return log_probs, entropy, predictions


def _sharded_stats(logits: ShardedLogits, input_ids: torch.Tensor, temperature: float, with_entropy: bool,
                   with_predictions: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The whole row's statistics from this rank's positions: its targets taken from the whole row (shifted before
    the split), its values computed locally, then exchanged in one all-to-all (predictions, exact in fp32 for
    any vocabulary under 2^24, travel with them)."""
    log_probs, entropy, predictions = _local_stats(logits.local, logits.local_targets(input_ids), temperature,
                                                   with_entropy, with_predictions)
    parts = [log_probs] + ([entropy] if with_entropy else []) + ([predictions.to(log_probs.dtype)]
                                                                  if with_predictions else [])
    whole = logits.whole_row(torch.stack(parts, dim=-1)).unbind(-1)
    entropy_out = whole[1] if with_entropy else entropy
    predicted = whole[-1].detach().round().long() if with_predictions else None
    return whole[0], entropy_out, predicted


def token_log_probs(logits: Logits, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token under softmax(logits / temperature), shape [B, T-1], in fp32,
    a chunk of positions at a time (see :func:`logprob_chunking`). ``logits`` may be a
    :class:`LogitsFromHidden` (the fused LM head)."""
    return _stats(logits, input_ids, temperature, False)[0]


def token_log_probs_and_entropy(
    logits: Logits, input_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_log_probs` and the entropy of each next-token distribution, [B, T-1] each, from one pass
    (one gradient buffer: asking for them separately would hold two logits-sized gradients)."""
    log_probs, entropy, _ = _stats(logits, input_ids, temperature, True)
    return log_probs, entropy


def token_log_probs_and_predictions(
    logits: Logits, input_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_log_probs` and each position's most likely next token (argmax, no gradient), [B, T-1]
    each -- from one pass over the logits, which under the fused LM head are made only once."""
    log_probs, _, predictions = _stats(logits, input_ids, temperature, False, with_predictions=True)
    return log_probs, predictions


def token_entropy(logits: Logits, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution softmax(logits / temperature) at each target position,
    [B, T-1], in fp32, a chunk of positions at a time."""
    shape = logits.shape
    ids = torch.zeros(shape[:2], dtype=torch.long, device=_device_of(logits))
    return _stats(logits, ids, temperature, True)[1]


def _device_of(logits: Logits) -> torch.device:
    if isinstance(logits, ShardedLogits):
        return _device_of(logits.local)
    return (logits.hidden if isinstance(logits, LogitsFromHidden) else logits).device


def fused_head_ready(loss_fn: LossFn) -> LossFn:
    """Declare that ``loss_fn`` reads ``outputs.logits`` only through :func:`token_log_probs` and its siblings,
    so the engine may hand it a :class:`LogitsFromHidden` (``engine.fused_lm_head``); a loss without this
    mark always gets materialised logits."""
    loss_fn.fused_head_ready = True  # type: ignore[attr-defined]
    return loss_fn


def takes_fused_head(loss_fn: LossFn | None) -> bool:
    """Whether ``loss_fn`` (None: the forward-only pass's own log-probs) accepts :class:`LogitsFromHidden`."""
    return loss_fn is None or bool(getattr(loss_fn, "fused_head_ready", False))
