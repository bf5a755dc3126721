"""Variable-length attention for packed rows on any device: ``sdpa_varlen``.

A packed row's attention computed with sdpa and a block-diagonal mask costs N² for N packed tokens,
which for a few long sequences is more than padding them would have cost. Flash-attention's
variable-length kernels cost Σ L² instead, but run only on some GPUs. ``sdpa_varlen`` is a transformers
attention implementation that, given the packed sequences' boundaries (``cu_seq_lens_q``, the keyword
transformers' flash-attention path reads too), runs causal sdpa on each sequence alone -- Σ L², exactly the
attention of the sequences unpacked -- and otherwise (padded batches, generation with a cache) is plain
sdpa with its mask. The engine switches a model from ``sdpa`` to it when it packs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NAME = "sdpa_varlen"


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
    """Per-sequence causal sdpa over a packed row [1, heads, N, dim] split at ``cu_seq_lens_q``; plain
    sdpa (with ``attention_mask``) for anything else. A ``sliding_window`` (Mistral, Qwen2's sliding
    layers) is honoured: a token attends to itself and the ``window - 1`` before it, as transformers'
    own sliding-window mask has it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: every query head reads its key/value head
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    dropout = dropout if module.training else 0.0
    window = kwargs.get("sliding_window")
    parts = []
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if window and end - start > window:
            offsets = torch.arange(end - start, device=query.device)
            distance = offsets[:, None] - offsets[None, :]  # query position - key position
            band = (distance >= 0) & (distance < window)
            parts.append(F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=dropout, scale=scaling))
        else:
            parts.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``sdpa_varlen`` a transformers attention implementation (its masks are sdpa's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, varlen_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def sequence_bounds(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The keywords a packed row's forward passes on: each sequence's start (where ``position_ids``
    restarts) as cumulative lengths, and the longest sequence."""
    positions = position_ids[0]
    starts = (positions == 0).nonzero().flatten()
    bounds = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    longest = int(bounds.diff().max())
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}
