"""Planning one batch: validate it, agree with the other ranks in one all-reduce, split it.

The all-reduce carries the loss-token and sequence counts (the global normaliser), an error flag (a rank
with bad input makes every rank raise instead of leaving the others waiting) and, in one slot per rank,
each rank's micro-batch count and longest loss span. Every rank then runs the largest count, so deferred
collectives line up even when ranks hold different amounts of data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import EngineConfig
from ..data.batching import (
    Batch,
    BatchError,
    MicroBatch,
    microbatches_needed,
    sequence_lengths,
    split_batch,
    split_lengths,
)
from ..data.packing import pack, packable, packing_pays
from ..data.partition import token_cost, workloads
from ..losses import LossFn, Normalizer, check_batch_keys, target_mask
from ..memory.autosync import FIRST_CAP_FLOOR, LONGEST
from ..runtime.distributed import agree


@dataclass
class BatchPlan:
    """This rank's micro-batches and the normaliser every rank shares."""

    micro_batches: list[MicroBatch]  # heaviest first (micro-batch i is the i-th heaviest on every rank)
    normalizer: Normalizer
    seq_len: int  # columns of the original batch (per-target outputs such as log-probs have one fewer)
    real_tokens: int = 0  # tokens of this rank's samples
    computed_tokens: int = 0  # positions its micro-batches compute (real tokens when packed)
    shared_tokens: int = 0  # real tokens read from a shared start, not computed (syncwise.data.prefixes)
    workloads: list[float] = field(default_factory=list)  # estimated compute of each micro-batch
    largest_tokens: int = 0  # positions of its largest micro-batch (what its activations scale with)
    real_token_pairs: int = 0  # Σ L² over this rank's samples (causal attention's useful work scales with it)


def check_model_limits(batch: Batch, vocab_size: int | None, max_positions: int | None) -> None:
    """Token ids must index the embedding and sequences fit the model's positions: either would fail inside
    one rank's forward, leaving the others in a collective."""
    ids = batch["input_ids"]
    if vocab_size is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise BatchError(
            f"batch['input_ids']: ids must lie in [0, {vocab_size}) (the model's vocabulary), "
            f"got {int(ids.min())}..{int(ids.max())}"
        )
    if max_positions is not None:
        lengths = sequence_lengths(batch)
        longest = int(lengths.max())
        if longest > max_positions:
            raise BatchError(
                f"batch: sample {int(lengths.argmax())} has {longest} tokens, more than the model's "
                f"max_position_embeddings={max_positions}"
            )


def plan_batch(
    batch: Batch,
    cfg: EngineConfig,
    *,
    dp_size: int,
    device: torch.device,
    timeout_s: float,
    require_tokens: bool,
    packing: bool = False,
    share_prefixes: bool = False,
    read_cost: tuple[float, float] = (0.0, 0.0),
    varlen_attention: bool = False,
    vocab_size: int | None = None, max_positions: int | None = None,
    loss_fn: LossFn | None = None,
    split: tuple[int, int] | None = None, stretch_cap: bool = False,
    replicas: int = 1, rejected: BatchError | None = None,
) -> BatchPlan:
    """Validate ``batch``, agree with every rank (one all-reduce), split it into micro-batches, heaviest
    first. With ``packing``, each micro-batch is packed into one row where that computes less than padding
    it (:func:`~syncwise.data.packing.packing_pays`): micro-batches without padding stay as they are; with
    ``share_prefixes`` too, rows that begin alike (GRPO's samples of one prompt) stay in one micro-batch where
    the split allows and compute their common start once (:mod:`syncwise.data.prefixes`). The keys
    ``loss_fn`` declares (:func:`~syncwise.losses.reads`) are checked with the rest, before the all-reduce.
    ``split``: (sequences per micro-batch, token cap) (default ``cfg.fixed_split``); ``stretch_cap``: auto's cap grows
    to this rank's longest sequence. ``read_cost``: what a row reading a shared start keeps beyond its computed
    tokens, in computed tokens' activations: per token of its start and own part (the copied keys and values), per
    token of its start (the empty queries and their outputs) -- counted into ``largest_tokens``.
    ``replicas``: ranks holding this batch alike (:mod:`.sequence_parallel`): all packed, each token counted once.
    ``rejected``: found before (a sequence-parallel group's batches that do not join), raised on every rank."""
    size, max_tokens = split or cfg.fixed_split
    error: BatchError | None = None
    sums, own = [0.0, 0.0, 0.0], [0.0, 0.0]  # [tokens, sequences, bad ranks], [micro-batches, longest span]
    try:
        if rejected is not None:
            raise rejected
        if stretch_cap and max_tokens > 0 and (lengths := split_lengths(batch, packing)).numel():
            floor = FIRST_CAP_FLOOR if max_tokens == LONGEST else max_tokens  # auto's first step: the longest
            max_tokens = max(floor, int(lengths.max()))
        needed = microbatches_needed(batch, size, max_tokens, packing)
        check_model_limits(batch, vocab_size, max_positions)
        check_batch_keys(batch, loss_fn)
        if packing and (reason := packable(batch)):
            raise BatchError(reason)
        per_sequence = target_mask(batch).sum(dim=1)
        sums[:2] = [float(per_sequence.sum()), float((per_sequence > 0).sum())]
        own = [float(needed), float(per_sequence.max())]
    except BatchError as exc:
        error = exc
        sums[2] = 1.0
    totals, per_rank = agree(sums, own, "the all-reduce of batch statistics (start of the step)", device, timeout_s)
    totals[:2] /= replicas  # a sequence-parallel group's ranks each counted the group's batch
    if error is not None:
        raise error
    if totals[2] > 0:
        raise BatchError(f"batch: invalid on {int(totals[2])} other rank(s); see the error raised there")
    if require_tokens and totals[0] == 0:
        raise BatchError("batch: loss_mask (or attention_mask) leaves no target token on any rank: nothing to train on")
    micro_batches = split_batch(
        batch, int(per_rank[:, 0].max()), balance=max_tokens > 0,
        max_tokens=max_tokens, packed=packing, linear_coef=cfg.workload_linear_coef,
        share_prefixes=packing and share_prefixes,
    )
    # Heaviest first on every rank, so micro-batch i costs about the same everywhere: ranks that meet in
    # its collectives then wait less for each other.
    loads = [_workload(mb, cfg.workload_linear_coef) for mb in micro_batches]
    order = sorted(range(len(micro_batches)), key=lambda i: (-loads[i], i))
    micro_batches, loads = [micro_batches[i] for i in order], [loads[i] for i in order]
    computed, largest, shared = _pack_where_it_pays(micro_batches, packing, share_prefixes, varlen_attention,
                                                    max_tokens, cfg.workload_linear_coef, read_cost, replicas > 1)
    largest = math.ceil(largest / replicas)
    norm = Normalizer(
        tokens=float(totals[0]), sequences=float(totals[1]), dp_size=dp_size,
        max_target_len=float(per_rank[:, 1].max()),
    )
    real = sequence_lengths(batch)
    return BatchPlan(
        micro_batches, norm, seq_len=batch["input_ids"].shape[1],
        real_tokens=int(real.sum()), computed_tokens=computed, workloads=loads,
        largest_tokens=largest, real_token_pairs=int((real * real).sum()), shared_tokens=shared,
    )


def _pack_where_it_pays(micro_batches: list[MicroBatch], packing: bool, share_prefixes: bool,
                        varlen_attention: bool, max_tokens: int, linear_coef: float,
                        read_cost: tuple[float, float], always: bool = False) -> tuple[int, int, int]:
    """Pack each micro-batch (in place) where that computes less than padding it -- always where its rows
    share a prefix -- or where padded it would break the cap; the positions computed (all), the most one
    micro-batch's activations count (with what reading a shared start keeps: ``read_cost``) and the real
    tokens read from a shared start instead of computed. ``always``: every micro-batch packed (sequence
    parallelism splits packed rows)."""
    computed = largest = shared = 0
    for position, mb in enumerate(micro_batches):
        if mb.data is None:
            continue
        lengths = sequence_lengths(mb.data).tolist()
        pays = always or (packing and packing_pays(lengths, linear_coef, varlen_attention))
        if packing and not pays and max_tokens > 0:  # padded, it must keep within the cap
            pays = token_cost(lengths, packed=False) > max_tokens
        # packed only where it is kept: where it pays, or to see whether the rows share a start
        packed = pack(mb.data, share_prefixes) if pays or (packing and share_prefixes) else None
        shares = packed is not None and int(packed[1].lengths.sum()) < sum(lengths)
        packs = pays or shares
        tokens = int(packed[1].lengths.sum()) if packs else mb.data["input_ids"].numel()
        positions = tokens
        if packs:
            micro_batches[position] = MicroBatch(mb.indices, *packed, offset=mb.offset)
            shared += sum(lengths) - tokens
            if shares:  # a reading row's copied keys and values (start and own part), its start's empty queries
                reads = packed[1].shared
                readers = reads > 0
                positions += math.ceil(read_cost[0] * float(packed[1].lengths[readers].sum() + reads.sum())
                                       + read_cost[1] * float(reads.sum()))
                micro_batches[position].positions = positions
        computed, largest = computed + tokens, max(largest, positions)
    return computed, largest, shared


def _workload(mb: MicroBatch, linear_coef: float) -> float:
    return sum(workloads(sequence_lengths(mb.data), linear_coef)) if mb.data is not None else 0.0
