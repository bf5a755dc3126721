"""Shared prompt prefixes: the rows of a packed micro-batch that begin alike compute their common start once.

GRPO samples n responses to every prompt, so n rows of a micro-batch begin with the very same prompt tokens
at the very same positions -- and in a causal model those tokens' hidden states, keys and values do not
depend on what follows them. Computing them once per group instead of once per row takes (n - 1) x the
prompt out of every layer's forward and backward (on the GRPO jobs of issue 71, ~50 prompt tokens beside ~26
response tokens, 2.4x fewer tokens). The gradient is the same: the shared positions' gradient is the sum of
what each row's tokens send back to them, which autograd adds up where they are read.

The layout (:func:`shared_prefixes`): a row that has its first ``S`` real tokens in common with another
row (its *leader*) does not compute them -- ``S`` never reaches its first target's previous token (the loss
mask says which tokens it trains on), so its packed part begins at the latest at the prompt's last token, whose
logits predict its own first response token: every per-target tensor keeps its packed meaning (target j
predicts token j+1 of the same part). Its attention reads the keys and values of those ``S`` tokens where they
were computed (:func:`prefix_segments`: the leader's part, and where the leader itself read its start, there
-- samples of one prompt read the prompt from its first sample, which may read a system prompt common to
several prompts from another prompt's first sample), then its own causally (``shared_prefix`` beside the
packed bounds, :mod:`syncwise.data.attention`); its positions go on from ``S``. Dropped positions have no
outputs (zeros where unpacked): never targets.
"""

from __future__ import annotations

import json
from functools import cache

import torch

from ..models import one_small_layer

# Fewer common tokens than this: the row computes them itself. Reading costs a few extra small calls per row
# and layer (copies, the empty queries): on the default job's ~5-token prompts sharing 3-4 tokens made the
# update 1.8x slower; on issue 71's 52-token prompts it takes the update to 0.6x.
MIN_SHARED = 16


def left_aligned(ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each row's real tokens from column 0 (left or right padding removed), -1 after them: [B, longest]."""
    lengths = keep.sum(dim=1)
    out = torch.full((ids.shape[0], int(lengths.max()) if ids.shape[0] else 0), -1, dtype=ids.dtype,
                     device=ids.device)
    columns = torch.arange(out.shape[1], device=ids.device)[None, :] < lengths[:, None]
    out[columns] = ids[keep]
    return out


def shared_prefixes(ids: torch.Tensor, keep: torch.Tensor, loss_mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row of a micro-batch ([B, T] token ids, real-token mask, per-token loss mask: token j a
    target): the row whose start it reads (-1: none), how many of its first real tokens it reads there
    instead of computing them (0 for none), and whether that is all of its start before its first target (its
    prompt, for an RL sample: rows that share a prompt, not only a system prompt). A row reads from a row it
    has the most in common with (of equal starts, the first computes them); that row may read its own start
    from another, never in a circle (the order is the starts' lexicographic one)."""
    rows = ids.shape[0]
    leader = torch.full((rows,), -1, dtype=torch.long)
    shared = torch.zeros(rows, dtype=torch.long)
    whole = torch.zeros(rows, dtype=torch.bool)
    if rows < 2:
        return leader, shared, whole
    tokens = left_aligned(ids, keep).cpu()
    lengths = keep.sum(dim=1).cpu()
    # the first real token that is a target: a row keeps the token before it (its logits predict it)
    targets = left_aligned(loss_mask.long(), keep).cpu() > 0 if loss_mask is not None else tokens >= 0
    targets[:, 0] = False
    first_target = torch.where(targets.any(dim=1), targets.float().argmax(dim=1), lengths).long()
    limits = (first_target - 1).clamp(min=0)
    # what a row may read: its tokens up to its limit (-1 after them never matches a real token)
    starts = tokens[:, : int(limits.max())].clone()
    starts[torch.arange(starts.shape[1])[None, :] >= limits[:, None]] = -1
    # in lexicographic order, the most any earlier row has in common with a row is what its predecessor has
    order = sorted(range(rows), key=lambda r: (starts[r].tolist(), r))
    ordered = starts[order]
    common = ((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).long().cumprod(dim=1).sum(dim=1).tolist()
    for previous, row, n in zip(order[:-1], order[1:], common, strict=True):
        if n < MIN_SHARED:
            continue
        # where the predecessor read these tokens itself, read them there: chains only as deep as the nesting
        lead = int(leader[previous]) if n <= int(shared[previous]) else previous
        leader[row], shared[row], whole[row] = lead, n, n == int(limits[row])
    return leader, shared, whole


def prefix_segments(leader: torch.Tensor, shared: torch.Tensor, starts: list[int]) -> list[list[tuple[int, int]]]:
    """For each row, the pieces of the packed row (start, tokens) its shared start is read from, in position
    order: its leader's own shared start (recursively), then the leader's computed tokens after it."""
    lead, count = leader.tolist(), shared.tolist()

    def pieces(row: int, n: int) -> list[tuple[int, int]]:  # the first n tokens of ``row``'s sequence
        inherited = min(n, count[row])
        out = pieces(lead[row], inherited) if inherited else []
        return out + ([(starts[row], n - inherited)] if n > inherited else [])

    return [pieces(lead[row], count[row]) if count[row] else [] for row in range(len(lead))]


def shared_units(ids: torch.Tensor, keep: torch.Tensor, loss_mask: torch.Tensor | None
                 ) -> tuple[list[list[int]], torch.Tensor]:
    """The batch's rows as units that share a whole prompt (in row order), and the tokens each row computes
    with its start read from another row -- what a micro-batch split keeps together."""
    leader, shared, whole = shared_prefixes(ids, keep, loss_mask)
    members: dict[int, list[int]] = {}
    for row in range(ids.shape[0]):
        root = row
        while whole[root]:  # up to the row that computes this whole prompt
            root = int(leader[root])
        members.setdefault(root, []).append(row)
    return sorted(members.values()), keep.sum(dim=1).cpu() - shared


@cache
def shares_correctly(model_class: type, config_json: str) -> str | None:
    """Whether this kind of model computes a follower's tokens as it would the whole row: a one-layer copy of
    it, built from its own config, must give two rows that begin alike the same logits with the second one's
    start read from the first. Returns why not, or None. Cached per model class and config."""
    from transformers import AutoConfig

    from .attention import NAME, register

    try:
        register()
        config = AutoConfig.for_model(**one_small_layer(json.loads(config_json)))
        config._attn_implementation = NAME
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = model_class(config).eval()
            high = min(config.vocab_size, 1000)
            prompt = torch.randint(1, high, (6,))
            rows = [torch.cat([prompt, torch.randint(1, high, (n,))]) for n in (4, 3)]
        with torch.no_grad():
            alone = [model(input_ids=r[None], use_cache=False).logits[0] for r in rows]
            skip = len(prompt) - 1
            follower = rows[1][skip:]
            ids = torch.cat([rows[0], follower])[None]
            positions = torch.cat([torch.arange(len(rows[0])), torch.arange(skip, len(rows[1]))])[None]
            bounds = torch.tensor([0, len(rows[0]), ids.shape[1]], dtype=torch.int32)
            packed = model(input_ids=ids, position_ids=positions, use_cache=False, cu_seq_lens_q=bounds,
                           cu_seq_lens_k=bounds, max_length_q=len(rows[0]), max_length_k=len(rows[0]),
                           shared_prefix=[[], [(0, skip)]]).logits[0]
    except Exception as exc:  # a model that cannot run this check cannot be trusted to share
        return f"{model_class.__name__} could not be checked ({type(exc).__name__}: {exc})"
    first, second = packed.split([len(rows[0]), len(follower)])
    if not (torch.allclose(first, alone[0], atol=1e-4, rtol=1e-4)
            and torch.allclose(second, alone[1][skip:], atol=1e-4, rtol=1e-4)):
        return f"{model_class.__name__} does not compute a shared prompt's rows as it would each alone"
    return None
