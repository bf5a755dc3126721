"""Variable-length attention for packed rows on any device: ``sdpa_varlen``.

A packed row's attention computed with sdpa and a block-diagonal mask costs N² for N packed tokens,
which for a few long sequences is more than padding them would have cost. Variable-length kernels cost
Σ L² instead. ``sdpa_varlen`` is a transformers attention implementation that, given the packed sequences'
boundaries (``cu_seq_lens_q``, the keyword transformers' flash-attention path reads too), computes each
sequence's causal attention alone -- Σ L², exactly the attention of the sequences unpacked -- with one of
three kernels, chosen once at start (:func:`choose_kernel`, one line saying which):

- ``varlen_attn``: torch's variable-length flash kernel (``torch.nn.attention.varlen``), one kernel for the
  whole packed row -- on CUDA, for bf16 / fp16 compute. Its signature is read once, at the choice: torch 2.11's
  takes no ``enable_gqa`` (grouped-query models get their key / value heads repeated to the query heads, as
  transformers' ``repeat_kv`` does), 2.13's maps the heads itself;
- ``flash_attn``: flash-attention's ``flash_attn_varlen_func``, where it is installed and torch's is not;
- ``loop``: one sdpa call per sequence, on any device and dtype (on CPU a little faster than one call with
  a block-diagonal mask; on a GPU hundreds of small kernels per layer, hence the two above).

Padded batches and generation with a cache get plain sdpa with its mask -- on CPU with a grouped-query model
through sdpa's own ``enable_gqa`` (:func:`masked_gqa`), where transformers would copy the keys and values once per
query head. The engine switches a model from ``sdpa`` to ``sdpa_varlen`` when it packs.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from . import ulysses

NAME = "sdpa_varlen"
_kernel = "loop"  # set by choose_kernel; per process (one device, one compute dtype)
_kernel_gqa = True  # whether the chosen kernel maps query heads to fewer key / value heads itself
_said = ""  # the last choice announced


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch without it
        return None
    return varlen_attn


def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def takes_gqa(kernel) -> bool:
    """Whether torch's ``varlen_attn`` takes ``enable_gqa`` (torch 2.13 does, 2.11 does not)."""
    try:
        return "enable_gqa" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # no signature to read: call it as the oldest torch's
        return False


def choose_kernel(device: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """The kernel packed rows use from now on in this process (``dtype``: the compute dtype), and a line
    saying which and why -- None when this process said it already (a second engine, e.g. the reference)."""
    global _kernel, _kernel_gqa, _said
    if device.type != "cuda":
        _kernel, why = "loop", f"no variable-length kernel on {device.type}"
    elif dtype not in (torch.bfloat16, torch.float16):
        _kernel, why = "loop", f"the variable-length kernels need bf16 / fp16 compute, not {str(dtype)[6:]}"
    elif _torch_varlen() is not None:
        _kernel, why = "varlen_attn", "torch.nn.attention.varlen, one kernel per packed row"
        if not takes_gqa(_torch_varlen()):
            why += "; key / value heads repeated for grouped-query models (this torch's takes no enable_gqa)"
    elif _flash_attn_varlen() is not None:
        _kernel, why = "flash_attn", "flash-attention's flash_attn_varlen_func, one kernel per packed row"
    else:
        _kernel, why = "loop", "neither torch's varlen_attn nor flash-attention is available"
    _kernel_gqa = _kernel != "varlen_attn" or takes_gqa(_torch_varlen())
    line = f"packed attention: {_kernel} ({why})"
    line, _said = (None if line == _said else line), line
    return _kernel, line


def current_kernel() -> str:
    return _kernel


def varlen_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Each sequence's causal attention within a packed row [1, heads, N, dim] split at ``cu_seq_lens_q``,
    with the kernel :func:`choose_kernel` chose (the loop where it chose none, or for dropout or fp32);
    plain sdpa (with ``attention_mask``) for anything else. A ``sliding_window`` (Mistral, Qwen2's sliding
    layers) is honoured: a token attends to itself and the ``window - 1`` before it, as transformers'
    own sliding-window mask has it."""
    group = ulysses.active()
    if group is not None and kwargs.get("cu_seq_lens_q") is not None:  # sequence parallel (dist.sequence_parallel)
        query, key, value = ulysses.heads_from_sequence(query, key, value, group)  # the whole row, own heads
        out = _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        return ulysses.sequence_from_heads(out, group), None
    return _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs), None


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, **kwargs) -> torch.Tensor:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        if _takes_masked_gqa(query, key, attention_mask, kwargs):
            return masked_gqa(query, key, value, attention_mask, dropout, scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)[0]
    dropout = dropout if module.training else 0.0
    window = kwargs.get("sliding_window")
    prefixes = kwargs.get("shared_prefix")  # rows reading their leader's start (syncwise.data.prefixes)
    if (_kernel != "loop" and prefixes is None and not dropout
            and query.dtype in (torch.bfloat16, torch.float16)):
        return _one_kernel(query, key, value, bounds, kwargs["max_length_q"], scaling, window)
    # grouped-query attention: sdpa maps each query head to its key/value head itself (no repeated copies of
    # the keys and values, which every sequence's backward would keep: ~17% of the loop's time on CPU)
    gqa = query.shape[1] != key.shape[1]
    reads = prefixes if prefixes is not None else [()] * (len(bounds) - 1)
    parts = []
    edges = bounds.tolist()
    for start, end, pieces in zip(edges[:-1], edges[1:], reads, strict=True):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if pieces:
            parts.append(_after_prefix(q, k, v, *(torch.cat([t[:, :, a:a + n] for a, n in pieces], dim=2)
                                                   for t in (key, value)), dropout, scaling, window, gqa))
        elif window and end - start > window:
            offsets = torch.arange(end - start, device=query.device)
            distance = offsets[:, None] - offsets[None, :]  # query position - key position
            band = (distance >= 0) & (distance < window)
            parts.append(F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=dropout, scale=scaling,
                                                        enable_gqa=gqa))
        else:
            parts.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True,
                                                        enable_gqa=gqa))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                  dropout: float, scaling: float | None, window: int | None, gqa: bool) -> torch.Tensor:
    """A follower's attention: its queries (positions S, S+1, ...) over the S keys and values of its start and
    then its own, causally, as the whole row's would be. sdpa's causal mask is aligned to the top left, so S
    empty queries go first and their outputs are dropped: no [own, S + own] mask is made or kept for backward
    (a layer with a sliding window shorter than the row gets one)."""
    shared, own = prefix_k.shape[2], q.shape[2]
    keys, values = torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)
    if window and shared + own > window:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=prefix_mask(shared, own, window, q.device),
                                              dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    padded = torch.cat([q.new_zeros((*q.shape[:2], shared, q.shape[3])), q], dim=2)
    return F.scaled_dot_product_attention(padded, keys, values, dropout_p=dropout, scale=scaling, is_causal=True,
                                          enable_gqa=gqa)[:, :, shared:]


def _one_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, longest: int,
                scaling: float | None, window: int | None) -> torch.Tensor:
    """The packed row [1, heads, N, dim] through one variable-length kernel; [1, N, heads, dim] out."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, heads, dim]
    left = window - 1 if window else -1  # a token sees itself and the window - 1 before it
    if _kernel == "varlen_attn":
        gqa = q.shape[1] != k.shape[1]
        if gqa and not _kernel_gqa:  # each query head's key / value head beside it, as transformers' repeat_kv
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": gqa} if _kernel_gqa else {}
        out = _torch_varlen()(q, k, v, bounds, bounds, longest, longest, scale=scaling, window_size=(left, 0),
                              **extra)
    else:
        out = _flash_attn_varlen()(q, k, v, bounds, bounds, longest, longest, 0.0, softmax_scale=scaling,
                                   causal=True, window_size=(left, -1 if left < 0 else 0))
    return out[None]


def _takes_masked_gqa(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict) -> bool:
    """A masked grouped-query call on CPU that transformers' sdpa would need nothing else for (no position bias,
    no paged cache, no attention weights asked)."""
    return (mask is not None and query.device.type == "cpu" and query.shape[1] != key.shape[1]
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False)
            and type(kwargs.get("cache")).__name__ != "PagedAttentionCache")


def masked_gqa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
               dropout: float = 0.0, scaling: float | None = None) -> torch.Tensor:
    """Grouped-query attention with a mask (the samplers' left-padded prefill and decode) by sdpa's own
    ``enable_gqa``, which takes a mask on CPU: transformers repeats the keys and values to every query head
    wherever a mask is given (``repeat_kv``: a copy of a layer's whole cache at every decode step; 2-3.7x the
    attention's time at 60-300 cached tokens). [batch, tokens, heads, dim], as transformers' sdpa returns it."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def register() -> None:
    """Make ``sdpa_varlen`` a transformers attention implementation (its masks are sdpa's, but none under sequence
    parallelism: the row's bounds say everything, and a shard's [L, L] mask would be built from positions that do
    not start at 0 -- 64 MiB of bools for an 8k-token shard, unused)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args, **kwargs):
        return None if ulysses.active() is not None else sdpa_mask(*args, **kwargs)

    AttentionInterface.register(NAME, varlen_sdpa_attention)
    AttentionMaskInterface.register(NAME, mask)


def sequence_bounds(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The keywords a packed row's forward passes on: each sequence's start (where ``position_ids``
    restarts) as cumulative lengths, and the longest sequence."""
    positions = position_ids[0]
    starts = (positions == 0).nonzero().flatten()
    bounds = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    longest = int(bounds.diff().max())
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}


def prefix_mask(shared: int, own: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[own, shared + own] bool: query i of a row's own part (position shared + i) sees every key up to its own
    position -- its start's and its own -- or the last ``window`` of them where there is a window."""
    distance = torch.arange(shared, shared + own, device=device)[:, None] - torch.arange(shared + own, device=device)
    return (distance >= 0) & (distance < window) if window else distance >= 0
