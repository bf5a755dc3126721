"""Ulysses sequence parallelism: one packed row split across a group of ranks (``dist.sequence_parallel``).

Each rank of a group of N holds 1/N of every packed row's positions -- its activations 1/N of the row's. Only
attention needs the whole sequence: before it, one all-to-all turns the group's sequence-sharded queries, keys and
values ([1, heads, L, dim] each, L = row / N) into head-sharded ones ([1, heads / N, row, dim]), on which the
packed-row attention (:mod:`syncwise.data.attention`) runs with the row's global bounds; after it, one all-to-all
turns its output back (the layout of verl's ``verl/utils/ulysses.py``). Key / value heads fewer than N (or not a
multiple of it) are repeated first, as few times as makes them divide, which maps each query head to the key /
value head it had.

What is per token stays exact because it is made on the whole row before the split: the row's targets are the
whole row's next tokens, sliced alike (a shard's last position predicts the next shard's first token -- the
label verl once shifted after the split, #6068); each rank computes the log-probs of its own positions and the
group exchanges them (:func:`gather_positions`, whose backward keeps each rank's own slice), so every loss sees the
whole row's log-probs and its per-sequence terms as it would on one rank. All exchanges are ``all_to_all_single``
(gloo and NCCL both have it), counted as ``comm/all_to_all_*``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceGroup:
    """The ranks that share each packed row: ``size`` consecutive ranks, this one ``rank``-th among them."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    def shard_bounds(self, length: int) -> tuple[int, int]:
        """This rank's positions [start, end) of a row of ``length`` (a multiple of ``size``)."""
        per = length // self.size
        return self.rank * per, (self.rank + 1) * per


_active: SequenceGroup | None = None  # set while a sequence-parallel forward runs (:func:`sharded_forward`)


@contextmanager
def sharded_forward(group: SequenceGroup) -> Iterator[None]:
    """Within the block, packed attention exchanges heads across ``group`` (:func:`heads_from_sequence`)."""
    global _active
    before, _active = _active, group
    try:
        yield
    finally:
        _active = before


def active() -> SequenceGroup | None:
    return _active


def _exchange(chunks: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[N, ...] chunks, the i-th for rank i of the group -> [N, ...], the i-th from rank i."""
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks.contiguous(), group=group.group)
    return out


class _Exchange(torch.autograd.Function):
    """:func:`_exchange` with its gradient: the same exchange of the incoming gradient sends each chunk back."""

    @staticmethod
    def forward(ctx, chunks: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(chunks, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def kv_repeats(kv_heads: int, size: int) -> int:
    """How many times each key / value head is repeated so that the group's ranks get whole heads: the fewest
    that make their count a multiple of ``size``."""
    return size // math.gcd(kv_heads, size)


def split_check(query_heads: int, kv_heads: int, size: int) -> str | None:
    """Why a model with these heads cannot be split over ``size`` ranks by heads, or None."""
    if query_heads % size:
        return f"its {query_heads} attention heads are not a multiple of dist.sequence_parallel={size}"
    repeats = kv_repeats(kv_heads, size)
    if (query_heads // kv_heads) % repeats:
        return (f"its {kv_heads} key/value heads cannot be repeated to a multiple of dist.sequence_parallel={size} "
                f"that its {query_heads} query heads share evenly")
    return None


def heads_from_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: SequenceGroup
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence-sharded [1, heads, L, dim] queries, keys and values -> head-sharded [1, heads / N, N L, dim], in one
    exchange (the three stacked per destination)."""
    size = group.size
    repeats = kv_repeats(key.shape[1], size)
    if repeats > 1:  # each key / value head beside itself, as transformers' repeat_kv lays them out
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    batch, _, length, dim = query.shape
    q_heads, kv_heads = query.shape[1] // size, key.shape[1] // size
    per_rank = [t.reshape(batch, size, t.shape[1] // size, length, dim).transpose(0, 1).reshape(size, -1)
                for t in (query, key, value)]
    received = _Exchange.apply(torch.cat(per_rank, dim=1), group)  # [N source ranks, their part of the three]
    sizes = [batch * q_heads * length * dim, batch * kv_heads * length * dim, batch * kv_heads * length * dim]
    out = []
    for part, heads in zip(received.split(sizes, dim=1), (q_heads, kv_heads, kv_heads), strict=True):
        # [N, batch, heads, L, dim] -> [batch, heads, N L, dim]: the source ranks' positions in order
        part = part.reshape(size, batch, heads, length, dim).permute(1, 2, 0, 3, 4)
        out.append(part.reshape(batch, heads, size * length, dim))
    return out[0], out[1], out[2]


def sequence_from_heads(output: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """The attention's head-sharded output [1, N L, heads / N, dim] -> sequence-sharded [1, L, heads, dim]."""
    size = group.size
    batch, total, heads, dim = output.shape
    length = total // size
    chunks = output.reshape(batch, size, length, heads, dim).transpose(0, 1)  # [N destinations, ...]
    received = _Exchange.apply(chunks.reshape(size, -1), group)
    # [N source ranks (head groups), batch, L, heads / N, dim] -> [batch, L, heads, dim]
    received = received.reshape(size, batch, length, heads, dim).permute(1, 2, 0, 3, 4)
    return received.reshape(batch, length, size * heads, dim)


class _GatherPositions(torch.autograd.Function):
    """Every rank's [B, L, ...] -> the group's [B, N L, ...]; backward keeps this rank's slice of the gradient (each
    rank computes the same loss from the gathered values, and its own positions' share of it flows back)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
        ctx.group, ctx.length = group, local.shape[1]
        chunks = local.unsqueeze(0).expand(group.size, *local.shape)  # the same part to every rank
        received = _exchange(chunks, group)  # [N, B, L, ...]
        return received.transpose(0, 1).reshape(local.shape[0], group.size * local.shape[1], *local.shape[2:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.group.rank * ctx.length
        return grad[:, start:start + ctx.length].contiguous(), None


def gather_positions(local: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """The group's positions of a per-position tensor [B, L, ...] -> [B, N L, ...] (autograd: own slice back)."""
    return _GatherPositions.apply(local, group)


@dataclass
class ShardedLogits:
    """What stands for a packed row's logits under sequence parallelism: this rank's logits (or
    :class:`~syncwise.losses.LogitsFromHidden`) for its positions [start, start + L) of the row padded to a
    multiple of N positions, of which the first ``length`` are the row's. :func:`~syncwise.losses.token_log_probs`
    and its siblings take it as they take whole logits and return the whole row's values."""

    local: object  # torch.Tensor [1, L, V] or LogitsFromHidden
    group: SequenceGroup
    start: int
    length: int  # the row's real positions (the padding after them predicts nothing that counts)

    @property
    def shape(self) -> torch.Size:
        """The shape the whole row's logits would have."""
        local = self.local.shape
        return torch.Size((local[0], self.length, *local[2:]))

    def local_targets(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each of this rank's positions' next token in the whole row ``input_ids`` [1, length] (shifted before
        the split); 0 past the row's last token (a position that predicts nothing)."""
        positions = self.local.shape[1]
        targets = input_ids.new_zeros((input_ids.shape[0], positions))
        available = input_ids[:, self.start + 1:self.start + 1 + positions]
        targets[:, :available.shape[1]] = available
        return targets

    def whole_row(self, per_position: torch.Tensor) -> torch.Tensor:
        """This rank's per-position values [B, L] -> the row's per-target values [B, length - 1]."""
        return gather_positions(per_position, self.group)[:, :self.length - 1]


def shard_row(data: dict[str, torch.Tensor], bounds: dict[str, object], group: SequenceGroup,
              per_token: tuple[str, ...] = ()) -> tuple[dict[str, object], int]:
    """This rank's forward inputs of a packed row (``data``: its ``input_ids`` and ``position_ids`` [1, T];
    ``bounds``: its sequences' :meth:`~syncwise.data.packing.Packing.attention_inputs`), and where its positions
    start in the row. The row is padded to a multiple of N with a sequence of its own (positions from 0, loss
    nowhere) -- a shard may be all padding -- and the bounds stay the whole row's, which attention needs once the
    heads are exchanged. ``per_token``: more keys of ``data`` laid out per token, sliced alike."""
    ids, positions = data["input_ids"], data["position_ids"]
    length = ids.shape[1]
    padded = -(-length // group.size) * group.size
    edges, longest = bounds["cu_seq_lens_q"], int(bounds["max_length_q"])
    extra = padded - length
    rows = {key: data[key] for key in (*per_token, "input_ids") if data.get(key) is not None}
    if extra:
        rows = {key: torch.cat([value, value.new_zeros((1, extra, *value.shape[2:]))], dim=1)
                for key, value in rows.items()}
        positions = torch.cat([positions, torch.arange(extra, device=positions.device, dtype=positions.dtype)[None]],
                              dim=1)
        edges, longest = torch.cat([edges, edges.new_tensor([padded])]), max(longest, extra)
    start, end = group.shard_bounds(padded)
    inputs: dict[str, object] = {key: value[:, start:end] for key, value in rows.items()}
    inputs |= {"position_ids": positions[:, start:end], "cu_seq_lens_q": edges, "cu_seq_lens_k": edges,
               "max_length_q": longest, "max_length_k": longest}
    return inputs, start
