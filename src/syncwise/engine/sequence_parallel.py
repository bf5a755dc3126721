"""Sequence parallelism in the engine (``dist.sequence_parallel=N``): the batches of a group's N ranks gathered so
the group trains them together -- every rank 1/N of each packed row's positions (:mod:`syncwise.data.ulysses`) --
each rank's per-sample outputs handed back to it, and what every rank of a group computed alike counted once.

The data is each rank's own, as without it: every rank samples, reads or is given its own rows (no prompt is
drawn twice), and the group's batch is their union. FSDP still shards over every rank; the loss shares and the
normaliser count each token once (:func:`~syncwise.engine.planning.plan_batch`'s ``replicas``), so the summed
gradient equals one rank's on the whole batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..config import Config, ModelConfig
from ..data import attention
from ..data.batching import ROW_GROUP, Batch, BatchError
from ..data.packing import layout
from ..data.ulysses import SequenceGroup, split_check
from ..losses import is_maximum
from ..runtime.distributed import DistInfo, collective_timeout
from .features import ModelFeatures
from .step import ForwardBackwardResult

_groups: dict[tuple[int, int], SequenceGroup] = {}  # (id of the default group, N) -> this rank's group

# metrics computed from each rank's own positions, not from the whole rows every rank of a group sees
_LOCAL_METRICS = ("moe/",)


def sequence_group(info: DistInfo, size: int | str, features: ModelFeatures) -> SequenceGroup | None:
    """This rank's group of ``size`` consecutive ranks (made once per process group; collective the first time),
    or None for ``size`` 1. A model it cannot split raises, naming why (:func:`unsplittable`)."""
    if size == "auto":
        raise ValueError("dist.sequence_parallel=auto is resolved by a job from its longest sequence "
                         "(syncwise.engine.sequence_parallel.resolve_split); an Engine of your own takes a number")
    if size <= 1:
        return None
    if not dist.is_initialized() or info.world_size % size:
        raise ValueError(f"dist.sequence_parallel={size} does not divide the world size {info.world_size}")
    if reason := unsplittable(features.hf_config, features.packing, size):
        raise ValueError(reason)
    key = (id(dist.group.WORLD), size)
    if key not in _groups:
        group, _ = dist.new_subgroups(group_size=size)
        _groups[key] = SequenceGroup(group, size, info.rank % size)
        if info.is_main:
            print(f"syncwise: dist.sequence_parallel={size}: each packed row split across {size} consecutive ranks "
                  f"(Ulysses: attention's heads exchanged); {info.world_size // size} data-parallel group(s)",
                  flush=True)
    return _groups[key]


def resolve_split(config: Config, info: DistInfo, longest: int, model: ModelConfig | None = None) -> None:
    """``dist.sequence_parallel=auto`` made a number, in place, before a job builds its engines (every rank alike,
    from the same shapes): the fewest ranks per sequence whose predicted peak for its ``longest`` sequence fits
    ``sync.memory_budget`` (:mod:`syncwise.memory.sequence_split`); the main rank says which and why. ``model``:
    the model the job trains where it is not ``config.model`` (a task that brings its own)."""
    if config.dist.sequence_parallel != "auto":
        return
    from ..memory.accounting import resolve_budget
    from ..memory.sequence_split import choose_split, split_options
    from ..models import hf_config_for

    hf_config = hf_config_for(model or config.model)
    options = split_options(hf_config, info.world_size, longest, param_dtype=config.model.param_dtype,
                            reduce_dtype=config.model.reduce_dtype, lora_rank=config.model.lora.rank,
                            checkpointing=config.engine.activation_checkpointing,
                            fused_head=config.engine.fused_lm_head is not False,
                            logprob_chunk=config.engine.logprob_chunk_size)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    size, line = choose_split(options, resolve_budget(config.sync.memory_budget, info.device, local), longest)
    config.dist.sequence_parallel = size
    if info.is_main:
        print(f"syncwise: {line}", flush=True)


def unsplittable(hf_config, packs: bool, size: int) -> str | None:
    """Why a model cannot be split over ``size`` ranks by Ulysses (one line naming it), or None: it must keep
    packed sequences apart (its rows are split at global bounds) and have heads to share out."""
    name = type(hf_config).__name__.removesuffix("Config") if hf_config is not None else "this model"
    if hf_config is None or not packs:
        return (f"dist.sequence_parallel={size}: {name} cannot be split by sequence (its packed rows do not keep "
                f"sequences apart; see engine.packing)")
    heads = getattr(hf_config, "num_attention_heads", None)
    if not heads:
        return f"dist.sequence_parallel={size}: {name} has no num_attention_heads to share across ranks"
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    reason = split_check(heads, kv_heads, size)
    return f"dist.sequence_parallel={size}: {name} cannot be split: {reason}" if reason else None


def split_problem(config: Config, hf_config, world: int) -> str | None:
    """What is wrong with ``dist.sequence_parallel`` for this job before any rank starts (one line), or None: a
    size that does not divide the ranks that train, a model whose packed rows cannot be split or whose heads
    cannot be shared out."""
    from ..data.packing import packs_correctly

    size = config.dist.sequence_parallel
    if not isinstance(size, int) or size == 1:
        return None
    trainers = world - config.dist.rollout_ranks  # rollout ranks only sample: the trainers form the groups
    if trainers % size:
        return f"dist.sequence_parallel={size} does not divide the {trainers} ranks that train (dist.nproc)"
    if config.engine.strategy not in ("fsdp2", "fsdp1", "ddp"):
        return f"dist.sequence_parallel={size} needs ranks: engine.strategy={config.engine.strategy} runs one process"
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    attention.register()  # the packed attention whose heads the group exchanges, as the engine will switch to
    packs = model_class is not None and packs_correctly(model_class, hf_config.to_json_string(), attention.NAME) is None
    return unsplittable(hf_config, packs, size)


def gather_batch(batch: Batch, group: SequenceGroup, timeout_s: float) -> tuple[Batch, slice]:
    """The group's batch (every rank's rows, in rank order; the narrower padded on the right, where no token is)
    and where this rank's rows are in it."""
    parts: list[Batch | None] = [None] * group.size
    own = {key: value.cpu() for key, value in batch.items()}
    with collective_timeout("the sequence-parallel group's gather of its batches", timeout_s):
        dist.all_gather_object(parts, own, group=group.group)
    for rank, part in enumerate(parts):
        if sorted(part) != sorted(own):
            raise BatchError(f"batch: its keys {sorted(own)} differ from those of rank {rank} of this "
                             f"sequence-parallel group ({sorted(part)}); every rank must give the same keys")
    rows = [part["input_ids"].shape[0] for part in parts]
    width = max(part["input_ids"].shape[1] for part in parts)
    device = batch["input_ids"].device
    joined: Batch = {}
    for key in batch:
        pieces, offset = [], 0
        for part in parts:
            value, (count, own_width) = part[key], part["input_ids"].shape
            if layout(value, count, own_width) in ("token", "target"):
                value = torch.nn.functional.pad(value, (*[0, 0] * (value.dim() - 2), 0, width - own_width))
            if key == ROW_GROUP and value.numel():  # a preference pair's rows stay one group, apart from others'
                shifted = value + offset
                offset = int(shifted.max()) + 1
                value = shifted
            pieces.append(value)
        joined[key] = torch.cat(pieces).to(device)
    start = sum(rows[:group.rank])
    return joined, slice(start, start + rows[group.rank])


def own_share(result: ForwardBackwardResult, rows: slice, group: SequenceGroup) -> ForwardBackwardResult:
    """``result`` of the group's batch as this rank's: its own rows' outputs, and the metrics every rank of the
    group computed alike (from the whole rows) at 1/N each, so that summed over ranks they count once."""
    result.outputs = {key: value[rows] for key, value in result.outputs.items()}
    result.metrics = {key: value if key.startswith(_LOCAL_METRICS) or is_maximum(key) else value / group.size
                      for key, value in result.metrics.items()}
    return result
