"""Sequence packing: a micro-batch's sequences concatenated into one row, without padding.

The model sees ``input_ids`` [1, N] and ``position_ids`` restarting at 0 for each sequence, and no
attention mask: transformers detects the packed sequences from the restarting positions and keeps
attention within each (a block-diagonal causal mask for sdpa / eager, variable-length kernels for
flash-attention). Every other tensor of the micro-batch is laid out along the same row, so loss functions
see per-token tensors aligned exactly as in the padded layout:

- per token ([B, T]): the real tokens of each sequence, in order -> [1, N];
- per target ([B, T-1], target j predicts token j+1): each sequence's targets, then one masked filler where
  the last token of a sequence would "predict" the first of the next -> [1, N-1];
- per sample ([B]): repeated over the sample's targets -> [1, N-1];
- ``loss_mask`` is zero on each sequence's first token (never a target within its sequence), and
  ``target_sequence`` [1, N-1] says which sequence each target belongs to (for per-sequence reductions).

:func:`unpack` brings per-target and per-token outputs (log-probs, token losses) back to [B, T-1] / [B, T].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

import torch

from ..models import one_small_layer
from .prefixes import prefix_segments, shared_prefixes

Batch = dict[str, torch.Tensor]
PACKED_KEYS = ("position_ids", "target_sequence")


@dataclass(frozen=True)
class Packing:
    """Where the sequences of one micro-batch sit in its packed row."""

    keep: torch.Tensor  # [B, T] bool: the tokens of the padded micro-batch the packed row computes
    leader: torch.Tensor | None = None  # [B]: the row whose start each row reads (-1: none); None: no sharing
    shared: torch.Tensor | None = None  # [B]: the first real tokens each row reads there

    @property
    def lengths(self) -> torch.Tensor:
        return self.keep.sum(dim=1)

    def attention_inputs(self) -> dict[str, object]:
        """The keywords the packed row's forward passes on to the attention: each part's bounds in the row
        (``cu_seq_lens_q``, as transformers' flash-attention path names them), the longest part, and where
        rows read a shared start, ``shared_prefix``: per part the (start, tokens) pieces of the row it reads
        (:func:`~syncwise.data.prefixes.prefix_segments`)."""
        counts = self.lengths
        starts = torch.cumsum(counts, 0) - counts
        present = (counts > 0).tolist()  # an all-padding row has no part
        bounds = torch.cat([starts[counts > 0], counts.sum().reshape(1)]).to(torch.int32)
        longest = int(counts.max())
        inputs: dict[str, object] = {
            "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}
        if self.shared is not None and bool((self.shared > 0).any()):
            segments = prefix_segments(self.leader, self.shared, starts.tolist())
            inputs["shared_prefix"] = [pieces for pieces, real in zip(segments, present, strict=True) if real]
        return inputs


def layout(value: torch.Tensor, rows: int, width: int) -> str | None:
    """'token', 'target', 'sample' -- how a batch tensor packs -- or None when it fits none of them."""
    if value.dim() == 1 and value.shape[0] == rows:
        return "sample"
    if value.dim() >= 2 and value.shape[0] == rows:
        if value.shape[1] == width:
            return "token"
        if value.shape[1] == width - 1:
            return "target"
    return None


def pack(data: Batch, share_prefixes: bool = False) -> tuple[Batch, Packing]:
    """The packed form of one (right- or left-padded) micro-batch, and how to undo it. With
    ``share_prefixes``, rows that begin alike compute their common start once (:mod:`syncwise.data.prefixes`)."""
    ids = data["input_ids"]
    rows, width = ids.shape
    mask = data.get("attention_mask")
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    has_next = torch.zeros_like(real)
    has_next[:, :-1] = real[:, :-1] & real[:, 1:]  # target j exists when tokens j and j+1 are both real
    index = real.long().cumsum(dim=1) - 1  # each token's position within its sequence
    leader = shared = None
    keep = real
    if share_prefixes:
        leader, shared, _ = shared_prefixes(ids, real, data.get("loss_mask"))
        keep = real & (index >= shared.to(ids.device)[:, None])  # a follower's start is its leader's
    packed: Batch = {}
    for key, value in data.items():
        kind = layout(value, rows, width)
        if key == "attention_mask":
            continue
        if kind == "token":
            packed[key] = value[keep].unsqueeze(0)
        elif kind == "target":
            extended = value.new_zeros((rows, width, *value.shape[2:]))
            extended[:, :-1] = value * has_next[:, :-1].view(rows, width - 1, *[1] * (value.dim() - 2))
            packed[key] = extended[keep][:-1].unsqueeze(0)
        elif kind == "sample":
            packed[key] = value[:, None].expand(rows, width)[keep][:-1].unsqueeze(0)
        else:
            raise ValueError(f"batch[{key!r}]: shape {tuple(value.shape)} does not pack (see packable)")
    first = keep & ~torch.cat([torch.zeros_like(keep[:, :1]), keep[:, :-1]], dim=1)  # each sequence's first token
    loss_mask = data.get("loss_mask", keep.long())
    packed["loss_mask"] = (loss_mask * ~first)[keep].unsqueeze(0)
    counts = keep.sum(dim=1)
    packed["position_ids"] = index[keep].unsqueeze(0)
    sequence = torch.repeat_interleave(torch.arange(rows, device=ids.device), counts)
    packed["target_sequence"] = sequence[:-1].unsqueeze(0)
    return packed, Packing(keep, leader, shared)


def unpack(value: torch.Tensor, packing: Packing) -> torch.Tensor:
    """A per-target [1, N-1] or per-token [1, N] output back to the padded [B, T-1] / [B, T] layout (zeros
    where there is no token); per-sample outputs ([B]) as they are."""
    keep = packing.keep
    rows, width = keep.shape
    tokens = int(keep.sum())
    if value.dim() == 1 and value.shape[0] == rows:
        return value
    flat = value[0]
    if flat.shape[0] == tokens - 1:  # per target: add back the filler after the last sequence
        flat = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])
        out = flat.new_zeros((rows, width, *flat.shape[1:]))
        out[keep] = flat
        has_next = keep[:, :-1] & keep[:, 1:]
        return out[:, :-1] * has_next.view(rows, width - 1, *[1] * (flat.dim() - 1))
    if flat.shape[0] == tokens:
        out = flat.new_zeros((rows, width, *flat.shape[1:]))
        out[keep] = flat
        return out
    raise ValueError(f"unpack: an output of shape {tuple(value.shape)} is neither per token nor per target")


def packing_pays(lengths: list[int], linear_coef: float, varlen_attention: bool) -> bool:
    """Whether packing this micro-batch computes less than padding it, by the workload estimate a·L + L²:
    padded, every row costs its padded width T; packed, the linear layers see only the real tokens N, and
    attention costs Σ L² with variable-length kernels (flash-attention) but N² with a block-diagonal mask
    (sdpa, eager), which for equal lengths is more than the rows' B·T². Without padding it never pays."""
    if not lengths:
        return False
    rows, width, tokens = len(lengths), max(lengths), sum(lengths)
    if rows * width == tokens:
        return False
    attention = sum(n * n for n in lengths) if varlen_attention else tokens * tokens
    return linear_coef * tokens + attention < rows * (linear_coef * width + width * width)


def packable(batch: Batch) -> str | None:
    """Why ``batch`` cannot be packed (a message naming the key), or None."""
    rows, width = batch["input_ids"].shape
    for key, value in batch.items():
        if key != "attention_mask" and layout(value, rows, width) is None:
            return (
                f"batch[{key!r}]: shape {tuple(value.shape)} is neither per token [B, T], per target [B, T-1] "
                f"nor per sample [B], so it cannot be packed; set engine.packing=false"
            )
    mask = batch.get("attention_mask")
    if mask is not None:  # each sequence's tokens must be contiguous (left or right padding, no holes)
        starts = (mask[:, 1:] > mask[:, :-1]).sum(dim=1) + (mask[:, 0] > 0).long()
        if bool((starts > 1).any()):
            return "batch['attention_mask']: a sequence has gaps; packing needs each sequence's tokens contiguous"
    return None


@cache
def packs_correctly(model_class: type, config_json: str, attn_implementation: str) -> str | None:
    """Whether this kind of model keeps packed sequences apart: a one-layer copy of it, built from its own
    config with the layers shrunk, must give each sequence the same logits packed as alone. Returns why not,
    or None. Cached per model class, config and attention implementation."""
    from transformers import AutoConfig

    from .attention import sequence_bounds

    try:
        config = AutoConfig.for_model(**one_small_layer(json.loads(config_json)))
        # flash-attention packs through its variable-length kernels, but runs only on a GPU: check sdpa's mask
        config._attn_implementation = "sdpa" if attn_implementation.startswith("flash") else attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = model_class(config).eval()
            seqs = [torch.randint(1, min(config.vocab_size, 1000), (n,)) for n in (5, 3, 7)]
        with torch.no_grad():
            alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
            positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
            packed = model(input_ids=torch.cat(seqs)[None], position_ids=positions, use_cache=False,
                           **sequence_bounds(positions)).logits[0]
    except Exception as exc:  # a model that cannot run this check cannot be trusted to pack
        return f"{model_class.__name__} could not be checked ({type(exc).__name__}: {exc})"
    for part, reference in zip(packed.split([len(s) for s in seqs]), alone, strict=True):
        if not torch.allclose(part, reference, atol=1e-4, rtol=1e-4):
            return f"{model_class.__name__} lets packed sequences attend to each other (its logits differ when packed)"
    return None
