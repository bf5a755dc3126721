"""Split a batch (dict of tensors, one row per sample) into micro-batches, and put outputs back in order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .packing import Packing
from .partition import capped_bins, capped_partition, karmarkar_karp, token_cost, workloads
from .prefixes import shared_units

Batch = dict[str, torch.Tensor]
ROW_GROUP = "row_group"  # [B] ints: rows with one value are kept in one micro-batch (a preference pair)


class BatchError(ValueError):
    """The batch cannot be trained on; the message names the key and the problem."""


@dataclass
class MicroBatch:
    indices: torch.Tensor  # positions of its samples in the original batch
    data: Batch | None  # None: an empty micro-batch (this rank has fewer samples than micro-batches)
    packing: Packing | None = None  # set when ``data`` is packed into one row (see syncwise.data.packing)
    offset: int = 0  # leading columns of the batch trimmed away (left padding no sample of it uses)
    positions: int = 0  # what its activations count, where not its tokens (rows reading a shared start)

    @property
    def width(self) -> int:
        """Token columns of the (trimmed) padded micro-batch: per-token outputs have this many, per-target
        ones one fewer (packed outputs are unpacked to this layout)."""
        if self.packing is not None:
            return self.packing.keep.shape[1]
        return self.data["input_ids"].shape[1] if self.data is not None else 0


def batch_size_of(batch: Batch) -> int:
    """Validate the batch layout and return its number of samples."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise BatchError(f"batch: needs key 'input_ids' (got {keys})")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise BatchError(f"batch['input_ids']: expected a 2-D tensor [batch, seq], got {_describe(input_ids)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise BatchError(f"batch['input_ids']: expected an integer dtype, got {input_ids.dtype}")
    size = input_ids.shape[0]
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise BatchError(f"batch[{key!r}]: expected a tensor, got {type(value).__name__}")
        if value.dim() == 0 or value.shape[0] != size:
            raise BatchError(
                f"batch[{key!r}]: first dimension {tuple(value.shape)[:1]} does not match "
                f"input_ids' batch size {size}"
            )
        if key in ("attention_mask", "loss_mask"):
            if value.shape != input_ids.shape:
                raise BatchError(
                    f"batch[{key!r}]: shape {tuple(value.shape)} does not match input_ids {tuple(input_ids.shape)}"
                )
            if value.is_floating_point() or value.is_complex():
                raise BatchError(f"batch[{key!r}]: expected an integer or bool mask, got {value.dtype}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise BatchError(f"batch[{key!r}]: {bad} non-finite value(s) (NaN or inf)")
    if size == 0:
        raise BatchError("batch: is empty (0 samples)")
    return size


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def sequence_lengths(batch: Batch) -> torch.Tensor:
    """Tokens per sample: ``attention_mask`` sums, or the full width without a mask."""
    mask = batch.get("attention_mask")
    if mask is None:
        return torch.full((batch["input_ids"].shape[0],), batch["input_ids"].shape[1], dtype=torch.long)
    return mask.sum(dim=1).long()


def row_units(batch: Batch) -> list[list[int]] | None:
    """The rows that must share a micro-batch (one ``batch['row_group']`` value each), in order of first
    appearance; None where the batch has no such key (every row placed on its own)."""
    groups = batch.get(ROW_GROUP)
    if groups is None:
        return None
    units: dict[int, list[int]] = {}
    for row, group in enumerate(groups.tolist()):
        units.setdefault(group, []).append(row)
    return list(units.values())


def split_lengths(batch: Batch, packed: bool) -> torch.Tensor:
    """What a split places, as token counts: each sequence's tokens, or where rows are kept together
    (``row_group``) each unit's :func:`token_cost` -- what a micro-batch cap must hold at least."""
    lengths = sequence_lengths(batch)
    units = row_units(batch)
    if units is None:
        return lengths
    sizes = lengths.tolist()
    return torch.tensor([token_cost([sizes[r] for r in unit], packed) for unit in units], dtype=torch.long)


def _check_budget(lengths: list[int], budget: int) -> None:
    longest = max(lengths)
    if longest > budget:
        raise BatchError(
            f"batch: a sequence of {longest} tokens exceeds engine.max_tokens_per_micro_batch={budget} "
            f"(sample {lengths.index(longest)}; a sequence cannot be split across micro-batches: raise the budget)"
        )


def microbatches_needed(batch: Batch, micro_batch_size: int, max_tokens: int = 0, packed: bool = True) -> int:
    """This rank's own count: ``ceil(B / size)``, or with a token budget the fewest micro-batches that
    keep within it (:func:`capped_bins`; real tokens when ``packed``, rows × longest otherwise)."""
    size = batch_size_of(batch)
    units = row_units(batch)
    if max_tokens > 0:
        lengths = sequence_lengths(batch).tolist()
        if units is not None:
            return len(_unit_bins(lengths, units, max_tokens, packed))
        _check_budget(lengths, max_tokens)
        return len(capped_bins(lengths, max_tokens, packed))
    if units is not None:  # as many whole units as fit the size's rows, at least one
        return math.ceil(len(units) / max(1, micro_batch_size // max(len(unit) for unit in units)))
    return math.ceil(size / micro_batch_size)


def _unit_bins(lengths: list[int], units: list[list[int]], budget: int, packed: bool) -> list[list[int]]:
    """:func:`capped_bins` over units of rows kept together: the fewest groups of units (their indices) whose
    rows' :func:`token_cost` stays within ``budget``, first-fit decreasing."""
    def cost(rows: list[int]) -> int:
        return token_cost([lengths[r] for r in rows], packed)

    for unit in units:
        if cost(unit) > budget:
            raise BatchError(
                f"batch: rows {unit} (one batch['{ROW_GROUP}'] value: kept in one micro-batch) need {cost(unit)} "
                f"tokens, more than engine.max_tokens_per_micro_batch={budget}: raise the budget")
    bins: list[list[int]] = []
    rows: list[list[int]] = []
    for i in sorted(range(len(units)), key=lambda i: (-cost(units[i]), i)):
        for b in range(len(bins)):
            if cost(rows[b] + units[i]) <= budget:
                bins[b].append(i)
                rows[b] += units[i]
                break
        else:
            bins.append([i])
            rows.append(list(units[i]))
    return bins


def _unit_parts(batch: Batch, units: list[list[int]], k: int, balance: bool, max_tokens: int, packed: bool,
                linear_coef: float) -> list[list[int]]:
    """``k`` micro-batches' rows, every unit of rows kept together whole in one: balanced by the workload
    estimate within ``max_tokens`` (Karmarkar-Karp, else greedy, else the fewest bins and empty ones), or
    balanced alone, or consecutive units in near-equal chunks."""
    lengths = sequence_lengths(batch)
    row_weights = workloads(lengths, linear_coef)
    weights = [sum(row_weights[r] for r in unit) for unit in units]
    if max_tokens > 0:
        sizes = lengths.tolist()

        def fits(group: list[int]) -> bool:
            return token_cost([sizes[r] for i in group for r in units[i]], packed) <= max_tokens

        chosen = karmarkar_karp(weights, k)
        if not all(fits(g) for g in chosen):
            chosen = [[] for _ in range(k)]
            loads = [0.0] * k
            for i in sorted(range(len(units)), key=lambda i: (-weights[i], i)):
                room = [g for g in range(k) if fits(chosen[g] + [i])]
                if not room:
                    bins = _unit_bins(sizes, units, max_tokens, packed)
                    chosen = bins + [[] for _ in range(k - len(bins))]
                    break
                g = min(room, key=lambda g: (loads[g], g))
                chosen[g].append(i)
                loads[g] += weights[i]
    elif balance:
        chosen = karmarkar_karp(weights, k)
    else:
        chosen = [chunk.tolist() for chunk in torch.arange(len(units)).tensor_split(k)]
    return [sorted(row for i in group for row in units[i]) for group in chosen]


def _trim(data: Batch) -> tuple[Batch, int]:
    """Drop the columns no sample uses, right padding and left padding, so a micro-batch is as wide as its
    longest sequence; returns the trimmed micro-batch and how many leading columns went.

    Per-token tensors ([B, T]) keep columns ``[first, last]``, per-target ones ([B, T-1]: old log-probs,
    advantages, ...) the targets between them ``[first, last)``; anything else is left alone."""
    mask = data.get("attention_mask")
    if mask is None or mask.shape[1] == 0:
        return data, 0
    full = mask.shape[1]
    used = mask.any(dim=0).nonzero()
    first, last = (int(used.min()), int(used.max())) if used.numel() else (0, 0)
    last = max(last, first + 1)  # at least one target column
    if last >= full:
        first, last = max(0, min(first, full - 2)), full - 1
    if first == 0 and last == full - 1:
        return data, 0
    trimmed = {}
    for key, value in data.items():
        if value.dim() >= 2 and value.shape[1] == full:
            value = value[:, first : last + 1]
        elif value.dim() >= 2 and value.shape[1] == full - 1:
            value = value[:, first:last]
        trimmed[key] = value
    return trimmed, first


def split_batch(
    batch: Batch, num_microbatches: int, *, balance: bool = False, max_tokens: int = 0, packed: bool = True,
    linear_coef: float = 24576.0, share_prefixes: bool = False,
) -> list[MicroBatch]:
    """Exactly ``num_microbatches`` micro-batches, each trimmed to its longest sequence.

    ``max_tokens`` > 0: every micro-batch within that many tokens (real tokens when ``packed``, rows ×
    longest otherwise; :func:`capped_partition`), balanced by the workload estimate. ``balance`` alone:
    Karmarkar–Karp on the workload estimate. Otherwise consecutive, near-equal chunks. Rows with one
    ``batch['row_group']`` value are kept in one micro-batch, placed as a unit the same ways. ``share_prefixes``
    (packed): the balanced splits move rows that share a prefix as one unit, costed at the tokens it computes
    shared (:func:`_shared_parts`), where that fits the count and the cap; the consecutive chunks are cut
    with such rows side by side. A rank with fewer
    samples than micro-batches gets empty ones (``data`` None): the engine still runs them, with zero
    gradient, so every rank issues the same collectives.
    """
    size = batch_size_of(batch)
    units = row_units(batch)
    if units is not None:  # rows kept together: placed as units (a pair's common prompt is shared within it)
        parts = _unit_parts(batch, units, num_microbatches, balance, max_tokens, packed, linear_coef)
        parts.sort(key=lambda p: (not p, p[:1]))
    elif max_tokens > 0 or balance:
        lengths = sequence_lengths(batch)
        parts = _shared_parts(batch, num_microbatches, max_tokens, linear_coef) if share_prefixes else None
        if parts is None:
            weights = workloads(lengths, linear_coef)
            if max_tokens > 0:
                parts = capped_partition(lengths.tolist(), weights, num_microbatches, max_tokens, packed)
            else:
                parts = karmarkar_karp(weights, num_microbatches)
        parts.sort(key=lambda p: (not p, p[:1]))  # non-empty first, in sample order
    else:
        parts = _shared_chunks(batch, num_microbatches) if share_prefixes else None
        if parts is None:
            parts = [chunk.tolist() for chunk in torch.arange(size).tensor_split(num_microbatches)]
    out = []
    for part in parts:
        indices = torch.tensor(part, dtype=torch.long)
        if part:
            data, offset = _trim({k: v[indices] for k, v in batch.items()})
            out.append(MicroBatch(indices, data, offset=offset))
        else:
            out.append(MicroBatch(indices, None))
    return out


def _real_tokens(batch: Batch) -> torch.Tensor:
    mask = batch.get("attention_mask")
    return mask.bool() if mask is not None else torch.ones_like(batch["input_ids"], dtype=torch.bool)


def _shared_chunks(batch: Batch, k: int) -> list[list[int]] | None:
    """``k`` chunks of at most ceil(B / k) rows, as the consecutive split has them, with rows that share a
    prefix kept together (a unit of more rows cut into pieces that fit; first fit, largest first), or None
    where nothing is shared or the pieces do not fit."""
    units, _ = shared_units(batch["input_ids"], _real_tokens(batch), batch.get("loss_mask"))
    rows = sum(len(u) for u in units)
    if len(units) == rows:
        return None
    limit = math.ceil(rows / k)
    pieces = [unit[i:i + limit] for unit in units for i in range(0, len(unit), limit)]
    chunks: list[list[int]] = [[] for _ in range(k)]
    for piece in sorted(pieces, key=len, reverse=True):
        room = [c for c in chunks if len(c) + len(piece) <= limit]
        if not room:
            return None
        room[0].extend(piece)
    chunks.sort(key=lambda c: (not c, min(c, default=0)))
    return [sorted(c) for c in chunks]


def _shared_parts(batch: Batch, k: int, max_tokens: int, linear_coef: float) -> list[list[int]] | None:
    """The balanced split over units of rows that share a prefix (a unit over the cap cut into consecutive
    pieces that keep within it), or None where the rows share nothing or the units do not fit ``k``
    micro-batches (the row-wise split then)."""
    keep = _real_tokens(batch)
    units, computed = shared_units(batch["input_ids"], keep, batch.get("loss_mask"))
    if len(units) == len(keep):
        return None
    whole, own = keep.sum(dim=1).tolist(), computed.tolist()
    if max_tokens > 0:  # a unit over the cap: consecutive pieces within it, each computing its start again
        pieces: list[list[int]] = []
        for unit in units:
            pieces.append([])
            load = 0
            for row in unit:
                if pieces[-1] and load + own[row] > max_tokens:
                    pieces.append([])
                load = load + own[row] if pieces[-1] else whole[row]
                pieces[-1].append(row)
        units = pieces
    tokens = [whole[u[0]] + sum(own[r] for r in u[1:]) for u in units]
    weights = workloads(torch.tensor(tokens), linear_coef)
    if max_tokens > 0:
        groups = capped_partition(tokens, weights, k, max_tokens, packed=True)
    else:
        groups = karmarkar_karp(weights, k)
    if sum(1 for g in groups if g) > k:
        return None
    groups += [[] for _ in range(k - len(groups))]
    return [sorted(row for u in g for row in units[u]) for g in groups]


def restore_order(chunks: list[torch.Tensor], micro_batches: list[MicroBatch], seq_len: int) -> torch.Tensor:
    """Concatenate per-micro-batch outputs (one per non-empty micro-batch, in order) and undo the split.

    A per-sample output ([b]) is concatenated as it is. A per-token ([b, w]) or per-target ([b, w-1]) output
    of a micro-batch trimmed to ``w`` columns goes back to its columns of the batch ([B, seq_len] or
    [B, seq_len - 1]; zeros where the micro-batch had no columns)."""
    filled = [mb for mb in micro_batches if mb.data is not None]
    if not chunks or len(chunks) != len(filled):
        raise ValueError(f"restore_order: {len(chunks)} chunks for {len(filled)} non-empty micro-batches")
    if chunks[0].dim() > 1:
        chunks = [_to_batch_columns(c, mb, seq_len) for c, mb in zip(chunks, filled, strict=True)]
    merged = torch.cat(chunks)
    order = torch.cat([mb.indices for mb in filled])
    restored = torch.empty_like(merged)
    restored[order] = merged
    return restored


def _to_batch_columns(value: torch.Tensor, mb: MicroBatch, seq_len: int) -> torch.Tensor:
    if value.shape[1] == mb.width:
        total = seq_len
    elif value.shape[1] == mb.width - 1:
        total = seq_len - 1
    else:
        raise ValueError(f"restore_order: an output of shape {tuple(value.shape)} is neither per token "
                         f"({mb.width} columns) nor per target ({mb.width - 1}) for its micro-batch")
    return F.pad(value, (0, 0) * (value.dim() - 2) + (mb.offset, total - mb.offset - value.shape[1]))
