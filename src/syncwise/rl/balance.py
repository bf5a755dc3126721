"""What each rank trains on after sampling: groups without signal left out (``rl.skip_uniform_groups``) and
samples moved between ranks so every rank has about the same real tokens (``rl.balance_ranks``).

Both change *which* rank computes *which* sample, never the update: the engine normalises the loss over the
global batch (every rank, every micro-batch), so the gradient of a rebalanced batch equals the unbalanced
one's. Leaving out a group whose advantages are all zero removes no policy-gradient term and changes the
normaliser to the full-batch one over the samples that train, as DAPO's dynamic sampling does -- but with
``rl.loss.kl_coef`` or ``rl.loss.entropy_coef`` > 0 those samples' KL and entropy gradients are dropped too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.batching import Batch, karmarkar_karp, sequence_lengths
from ..runtime.distributed import agree, collective_timeout


@dataclass
class Selection:
    """The rows of a rank's batch that train, and what was left out."""

    rows: torch.Tensor  # indices into the rank's rollout batch
    masked: torch.Tensor  # of ``rows``: kept only so the rank has something to run (loss mask zeroed)


def uniform_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: the groups (``group_size`` consecutive samples) whose rewards are all equal -- their
    group-relative advantages are zero, so the policy-gradient term learns nothing from them."""
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


def select_trained_rows(uniform: torch.Tensor, group_size: int, min_rows: int, device: torch.device,
                        timeout_s: float) -> Selection:
    """Collective (one small all-reduce): the rows of the groups with signal (``uniform``: the groups
    without, from :func:`uniform_groups`). A rank left with fewer than
    ``min_rows`` rows (one per mini-batch) keeps as many rows of its uniform groups with the loss mask
    zeroed -- they count nowhere -- so every rank still runs the same optimizer steps. If no rank has a group
    with signal, every row trains as without the option (the step is then the KL term's alone)."""
    signal_rows = (~uniform).repeat_interleave(group_size)
    totals, _ = agree([float(signal_rows.sum())], [], "the uniform-group count all-reduce", device, timeout_s)
    everything = torch.arange(len(signal_rows))
    if totals[0] == 0:
        return Selection(everything, torch.zeros(len(everything), dtype=torch.bool))
    rows = everything[signal_rows]
    filler = everything[~signal_rows][: max(0, min_rows - len(rows))]
    masked = torch.cat([torch.zeros(len(rows), dtype=torch.bool), torch.ones(len(filler), dtype=torch.bool)])
    return Selection(torch.cat([rows, filler]), masked)


def take_rows(batch: Batch, selection: Selection) -> Batch:
    """The selected rows of every tensor; the filler rows' loss mask zeroed."""
    taken = {key: value[selection.rows] for key, value in batch.items()}
    if selection.masked.any():
        taken["loss_mask"] = taken["loss_mask"].masked_fill(selection.masked[:, None], 0)
    return taken


@dataclass
class Balance:
    """How the samples were spread over the ranks, before and after (max rank's real tokens / the mean)."""

    before: float
    after: float
    moved: int  # samples that changed rank


def balance_ranks(batch: Batch, pad_id: int, min_rows: int, timeout_s: float) -> tuple[Batch, Balance]:
    """Collective (one all-gather of every rank's batch): this rank's share of the global batch after a
    Karmarkar-Karp partition of all sequences by length, so each rank's real tokens are close to the mean.

    ``batch`` holds one row per sample ([B], [B, T] or [B, T-1] tensors, right-padded: the rollout's
    layout); the result has the same keys. The partition is computed alike on every rank from what the
    all-gather returned. If it would leave a rank with fewer than ``min_rows`` samples, or balance no better
    than the batch already is, nothing moves."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gathered: list[Batch | None] = [None] * world
    with collective_timeout("the cross-rank balance all-gather", timeout_s):
        dist.all_gather_object(gathered, {k: v.cpu() for k, v in batch.items()})
    lengths = [sequence_lengths(b) for b in gathered]
    owners = torch.cat([torch.full((len(n),), r) for r, n in enumerate(lengths)])
    flat = torch.cat(lengths)
    before = _imbalance([float(n.sum()) for n in lengths])
    parts = karmarkar_karp(flat.double().tolist(), world)
    if min(len(p) for p in parts) < min_rows:  # a rank would get too few rows
        return batch, Balance(before, before, 0)
    after = _imbalance([float(flat[torch.tensor(p)].sum()) for p in parts])
    if after >= before:  # no better than it is
        return batch, Balance(before, before, 0)
    owned = _assign(parts, owners, world)
    mine = torch.tensor(sorted(owned[rank]))
    width = max(b["input_ids"].shape[1] for b in gathered)
    merged = {key: torch.cat([_pad_columns(b[key], width - b["input_ids"].shape[1],
                                           pad_id if key == "input_ids" else 0) for b in gathered])
              for key in batch}
    shared = {key: value[mine] for key, value in merged.items()}
    moved = sum(int((owners[torch.tensor(p)] != r).sum()) for r, p in enumerate(owned))
    return _trim_right(shared, int(flat[mine].max())), Balance(before, after, moved)


def _assign(parts: list[list[int]], owners: torch.Tensor, world: int) -> list[list[int]]:
    """Which rank takes which part: greedily the pairs that keep the most samples where they are (fewest
    moved), ties by index -- the same answer on every rank."""
    overlap = [[int((owners[torch.tensor(p, dtype=torch.long)] == r).sum()) for r in range(world)] for p in parts]
    pairs = sorted(((overlap[p][r], p, r) for p in range(len(parts)) for r in range(world)),
                   key=lambda x: (-x[0], x[1], x[2]))
    owned: list[list[int] | None] = [None] * world
    taken = set()
    for _, p, r in pairs:
        if owned[r] is None and p not in taken:
            owned[r] = parts[p]
            taken.add(p)
    return owned  # type: ignore[return-value]


def rank_token_imbalance(batch: Batch, device: torch.device, timeout_s: float) -> float:
    """Collective (one small all-reduce): the busiest rank's real tokens over the mean, as the batch is."""
    _, per_rank = agree([], [float(sequence_lengths(batch).sum())], "the rank token count all-reduce", device,
                        timeout_s)
    return _imbalance(per_rank[:, 0].tolist())


def _imbalance(tokens: list[float]) -> float:
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean > 0 else 1.0


def _pad_columns(value: torch.Tensor, extra: int, fill: int) -> torch.Tensor:
    """Right-pad a [B, T] / [B, T-1] tensor by ``extra`` columns (a [B] tensor stays as it is)."""
    if value.dim() < 2 or extra == 0:
        return value
    return F.pad(value, (0, 0) * (value.dim() - 2) + (0, extra), value=fill)


def _trim_right(batch: Batch, longest: int) -> Batch:
    """Drop the right-padding columns no row uses any more (per-token tensors keep ``longest`` columns,
    per-target ones one fewer)."""
    cut = batch["input_ids"].shape[1] - longest
    mask = batch.get("attention_mask")
    if cut <= 0 or (mask is not None and bool(mask[:, longest:].any())):  # not right-padded: leave it
        return batch
    return {k: v[:, : v.shape[1] - cut] if v.dim() >= 2 else v for k, v in batch.items()}
