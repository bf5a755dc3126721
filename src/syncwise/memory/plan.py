"""``syncwise plan``: what each sync mode costs for a model and cluster, without running a job.

The model is built on the meta device from its Hugging Face config (no weights, no memory), wrapped the
way the engine wraps it (one FSDP unit per decoder layer plus the root), and fed to the same byte
estimator and collective schedule the engine checks itself against. Communication time uses an α-β ring
model per collective over its group of g ranks: all-gather and reduce-scatter ``(g-1)·α + (g-1)/g·S/β``,
all-reduce twice that. Memory: parameters, gradients and AdamW state sharded in fp32, plus activations
you give, plus what the mode holds between micro-batches. For GRPO (``--rollout-sequences``): the rollout
copy of the whole model, resident on every rank, in every mode's base; and the sampling phase's own peak
(the copy, the KV cache, the logits: one step's with the compact sampler, every step's with ``generate``),
which no sync mode changes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import AutoConfig

from ..config import LoraConfig
from ..data.partition import capped_bins, token_cost
from ..models import meta_model_units
from ..models.moe import active_parameters
from ..sync.modes import SyncChoice, SyncMode, spec, supported_modes
from .accounting import DTYPE_BYTES, ShardedModel, format_bytes, sharded_model_of
from .activations import estimate_activations, working_bytes
from .autosync import CAPS, AutoSync, Setting, StepShape, step_shape
from .costs import Links, candidates, head_recompute_seconds
from .plan_input import SHAPES, PlanInput
from .rollout import rollout_footprint
from .schedule import step_traffic, unit_traffic

ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32, sharded like the parameters


@dataclass
class ModePlan:
    mode: str
    retained_grad_bytes: int
    unsharded_param_bytes: int
    extra_bytes: int
    peak_bytes: int
    fits: bool
    collectives: dict[str, int]
    collective_bytes: dict[str, int]
    comm_time_s: float


@dataclass
class Plan:
    input: PlanInput
    num_params: int
    trainable_params: int
    active_params: int  # a token's share: all of a dense model's, a MoE's experts at k of E (models/moe.py)
    num_units: int
    base_bytes: int
    budget_bytes: int
    modes: list[ModePlan] = field(default_factory=list)  # whole-model modes
    partial: list[ModePlan] = field(default_factory=list)  # partial(K), K = U-1 .. 1
    auto_choice: str = ""
    auto_reason: str = ""
    auto_runner_up: str = ""  # the next fastest setting that fits (where auto chooses the head or the cap too)
    auto_predicted_peak: int = 0  # of auto's choice
    activation_bytes: int = 0
    rollout: RolloutMemory | None = None
    links_measured: bool = False
    latency_us: float = 0.0
    bandwidth_gbps: float = 0.0
    held_outside_bytes: int = 0  # kept beside this model for the whole job (PPO: the other model, the copy)
    critic: Plan | None = None  # PPO (--critic): the value model's own plan, with the actor held outside it
    # with --seq-len: each dist.sequence_parallel size's per-rank peak and exchange (memory/sequence_split.py)
    splits: list = field(default_factory=list)


@dataclass
class RolloutMemory:
    """GRPO's sampling on one rank: the copy is resident (in every mode's base); the KV cache and the scores
    exist while sampling, when no gradient or unsharded parameter is held."""

    copy_bytes: int  # the whole model in the rollout dtype
    kv_cache_bytes: int  # K and V of every layer for every sequence's prompt + new tokens
    scores_bytes: int  # logits in flight: generate keeps every step's scores; compact one step's
    peak_bytes: int  # sharded params + AdamW + the copy + KV cache + scores
    fits: bool


def rollout_memory(hf_config, inp: PlanInput, num_params: int, resident: int, budget: int) -> RolloutMemory:
    """What the rollout adds (see :class:`RolloutMemory`; the engine's own model:
    :func:`~syncwise.memory.rollout.rollout_footprint`); ``resident``: the sharded state that stays."""
    footprint = rollout_footprint(inp.rollout_sampler, hf_config, inp.rollout_dtype, num_params,
                                  inp.rollout_sequences, inp.rollout_prompt_len, inp.rollout_new_tokens)
    peak = resident + footprint.sampling
    return RolloutMemory(footprint.weights, footprint.kv_cache, footprint.logits + footprint.runtime, peak,
                         peak <= budget)


def load_hf_config(spec: str):
    """A built-in shape name (case-insensitive), a model preset of the engine (``qwen2-tiny``, ...), a model
    directory, or a config.json path."""
    from ..models import PRESETS, preset_config

    key = spec.lower()
    if key in SHAPES:
        kwargs = dict(SHAPES[key])
        return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    if key in PRESETS:
        return preset_config(key)
    path = Path(spec)
    if path.is_dir() or path.is_file():
        return AutoConfig.from_pretrained(path.parent if path.is_file() else path, local_files_only=True)
    raise ValueError(
        f"model {spec!r}: not a built-in shape ({', '.join(SHAPES)}), a preset ({', '.join(PRESETS)}) nor a local path"
    )


def sharded_model_for(
    hf_config, shard_size: int, param_dtype: str, reduce_dtype: str, lora_rank: int = 0, value_head: bool = False,
) -> ShardedModel:
    """The estimator input for the engine's wrapping of this model (with LoRA adapters of ``lora_rank``, the
    only trainable parameters; ``value_head``: as PPO's critic), built on the meta device."""
    _, units = meta_model_units(hf_config, LoraConfig(rank=lora_rank), value_head=value_head)
    return sharded_model_of(units, shard_size, param_dtype, reduce_dtype)


def in_flight_bytes(sharded: ShardedModel) -> tuple[int, int]:
    """What FSDP2 has in flight in the two phases of backward where the peak can come (see
    :mod:`syncwise.memory.activations`): during the loss's backward, the root's parameters (gathered from its
    forward to its backward) and the last layer's, gathered ahead; during a layer's backward, the root's, that
    layer's and the next one's being gathered (param dtype), and the largest unit's gradient on its way to
    the reduce-scatter (reduce dtype). A shard group of one gathers and scatters nothing."""
    if sharded.shard_size <= 1:
        return 0, 0
    root, *layers = sharded.unit_padded_numels()
    layer = max(layers, default=0)
    largest_gradient = max(sharded.unit_padded_numels(trainable_only=True)) * DTYPE_BYTES[sharded.reduce_dtype]
    param = DTYPE_BYTES[sharded.param_dtype]
    return (root + layer) * param, (root + 2 * layer) * param + largest_gradient


def _row(choice: SyncChoice, sharded: ShardedModel, units, inp: PlanInput, links: Links, base: int,
         budget: int, root_in_base: bool) -> ModePlan:
    n = inp.microbatches
    traffic, comm_time = _comm(choice, n, units, inp, links)
    extra = sharded.peak_extra_bytes(choice, n, root_in_base)
    return ModePlan(
        mode=choice.label,
        retained_grad_bytes=sharded.retained_grad_bytes(choice, n),
        unsharded_param_bytes=sharded.unsharded_param_bytes(choice, n),
        extra_bytes=extra,
        peak_bytes=base + extra,
        fits=base + extra <= budget,
        collectives=dict(traffic.counts),
        collective_bytes=dict(traffic.bytes),
        comm_time_s=comm_time,
    )


def _comm(choice: SyncChoice, n: int, units, inp: PlanInput, links: Links):
    """A step's collectives in ``choice`` over ``n`` micro-batches and their time over ``links``."""
    traffic = step_traffic(choice, n, units, unsharded_forward=True, hsdp=inp.replicas > 1)
    return traffic, links.step_time(traffic.counts, traffic.bytes, inp.trainers // inp.replicas, inp.replicas)


def make_plan(inp: PlanInput, hf_config=None, links: Links | None = None) -> Plan:
    """Every mode's (and every partial(K)'s) held bytes, peak, collectives and communication time, and what
    auto would choose. ``links``: measured link speeds (default: ``inp``'s latency and bandwidth). With
    ``inp.critic`` (PPO), the critic's own plan too (``plan.critic``): each model budgets with the other's
    parameters and optimizer state (and the rollout copy) held outside it, as each engine's auto does."""
    inp.validate()
    hf_config = hf_config if hf_config is not None else load_hf_config(inp.model)
    links = links or Links(inp.latency_us * 1e-6, inp.bandwidth_gbps * 1e9,
                           inp.replica_bandwidth_gbps * 1e9 if inp.replica_bandwidth_gbps else None)
    shard = inp.trainers // inp.replicas
    actor = sharded_model_for(hf_config, shard, inp.param_dtype, inp.reduce_dtype, inp.lora_rank)
    if not inp.critic:
        return _model_plan(inp, hf_config, links, actor)
    critic = sharded_model_for(hf_config, shard, inp.param_dtype, inp.reduce_dtype, inp.lora_rank, value_head=True)
    plan = _model_plan(inp, hf_config, links, actor, held_outside=resident_per_rank(critic, shard))
    copy = plan.rollout.copy_bytes if plan.rollout and not inp.rollout_ranks else 0
    plan.critic = _model_plan(inp, hf_config, links, critic, held_outside=resident_per_rank(actor, shard) + copy,
                              value_head=True)
    return plan


def resident_per_rank(sharded: ShardedModel, shard: int) -> int:
    """A model's bytes on each rank between its steps: its sharded parameters and AdamW's state of what trains."""
    local = sharded.padded_numel() // shard
    local_trainable = sum(sharded.unit_padded_numels(trainable_only=True)) // shard
    return local * DTYPE_BYTES[sharded.orig_dtype] + local_trainable * ADAMW_STATE_BYTES


def _model_plan(inp: PlanInput, hf_config, links: Links, sharded: ShardedModel, held_outside: int = 0,
                value_head: bool = False) -> Plan:
    """One model's plan (the actor's, with the rollout copy; or ``value_head``: the critic's) with
    ``held_outside`` bytes beside it in every mode's base."""
    shard = inp.trainers // inp.replicas
    hsdp = inp.replicas > 1
    n = inp.microbatches
    in_loss, in_layer = in_flight_bytes(sharded)
    if inp.seq_len:
        act = estimate_activations(hf_config, inp.seq_len, inp.micro_batch_size, inp.activation_checkpointing,
                                   inp.param_dtype, inp.logprob_chunk, inp.fused_lm_head,
                                   head_trains=not inp.lora_rank, value_head=value_head,
                                   sequence_parallel=inp.sequence_parallel)
        activation_bytes = act.peak_bytes
        working = working_bytes(act, in_loss, in_layer)
    else:  # activations as measured (if given), plus the most FSDP2 holds in flight with them
        activation_bytes = int(inp.activation_gib * 2**30)
        working = activation_bytes + in_layer if activation_bytes else 0
    resident = resident_per_rank(sharded, shard)  # AdamW: what trains
    budget = int(inp.device_memory_gib * 2**30 * inp.budget_fraction)
    # on its own rank (dist.rollout_ranks) the engine is all there is; else beside this rank's training state
    beside = 0 if inp.rollout_ranks else resident + held_outside
    rollout = (rollout_memory(hf_config, inp, sharded.num_params, beside, budget)
               if inp.rollout_sequences and not value_head else None)
    copy = rollout.copy_bytes if rollout and not inp.rollout_ranks else 0
    base = (
        resident  # sharded parameters and optimizer state
        + sharded.retained_grad_bytes(SyncMode.PER_MICROBATCH, n)  # sharded gradients
        + working  # activations and FSDP2's parameters / gradients in flight
        + copy  # GRPO's rollout copy stays in memory while training (colocated)
        + held_outside  # PPO: the other model's parameters and optimizer state (and the copy, for the critic)
    )
    trainable = sum(sharded.unit_trainable_numels)
    active = active_parameters((shape for unit in sharded.unit_shapes for shape in unit), hf_config)
    plan = Plan(inp, sharded.num_params, trainable, active, len(sharded.unit_shapes), base, budget,
                activation_bytes=activation_bytes, rollout=rollout, held_outside_bytes=held_outside,
                links_measured=links.measured, latency_us=links.latency_s * 1e6, bandwidth_gbps=links.bandwidth / 1e9)
    units = unit_traffic(sharded, hsdp)
    choices = candidates(supported_modes("fsdp2", hsdp), sharded, links)
    root_in_base = bool(working and in_loss)  # the root's gathered parameters are in flight in the base
    for choice in choices:
        row = _row(choice, sharded, units, inp, links, base, budget, root_in_base)
        (plan.partial if spec(choice.mode).per_unit else plan.modes).append(row)
    auto = AutoSync(sharded, choices, budget, root_in_base=root_in_base)
    shape, first = (_step_shape(inp, hf_config, links, units, in_loss, in_layer, value_head) if inp.seq_len
                    else (StepShape.fixed(n), Setting(SyncChoice(SyncMode.PER_MICROBATCH))))
    # the estimated base stands for the first step's measured peak: per_microbatch, its activations as configured
    plan.auto_choice = auto.decide(base, first, shape, working if inp.seq_len else 0, source="estimated").label
    plan.auto_reason = auto.decisions[-1]
    plan.auto_runner_up = auto.runner_up.label if auto.runner_up is not None else ""
    plan.auto_predicted_peak = auto.predicted_peak
    if inp.seq_len and not value_head:
        from .sequence_split import split_options  # it reads this module's sizes

        plan.splits = split_options(hf_config, shard, inp.seq_len, param_dtype=inp.param_dtype,
                                    reduce_dtype=inp.reduce_dtype, lora_rank=inp.lora_rank,
                                    checkpointing=inp.activation_checkpointing,
                                    fused_head=inp.fused_lm_head is not False, logprob_chunk=inp.logprob_chunk)
    return plan


def _step_shape(inp: PlanInput, hf_config, links: Links, units, in_loss: int, in_layer: int,
                value_head: bool) -> tuple[StepShape, Setting]:
    """The step as ``inp`` describes it, for auto's choice of the LM head's path (``--fused-lm-head auto``)
    and the token cap (``--auto-cap``), as the engine's first step sizes it (:mod:`syncwise.engine.tuning`):
    the shape and the setting standing for the first step."""
    heads = (False, True) if inp.fused_lm_head == "auto" and not value_head else (None,)
    fixed_fused = inp.fused_lm_head is not False

    def activations(tokens: int, fused: bool | None) -> int:
        act = estimate_activations(hf_config, tokens, 1, inp.activation_checkpointing, inp.param_dtype,
                                   inp.logprob_chunk, fixed_fused if fused is None else fused,
                                   head_trains=not inp.lora_rank, value_head=value_head,
                                   sequence_parallel=inp.sequence_parallel)
        return working_bytes(act, in_loss, in_layer)

    lengths = [inp.seq_len] * (inp.microbatches * inp.micro_batch_size)
    splits = {}
    for cap in (c for c in CAPS if c >= inp.seq_len) if inp.auto_cap else ():
        bins = capped_bins(lengths, cap, packed=True)
        splits[cap] = (len(bins), max(token_cost([lengths[i] for i in part], True) for part in bins))

    def comm_seconds(choice: SyncChoice, n: int) -> float:
        return _comm(choice, n, units, inp, links)[1]

    rate = inp.compute_tflops * 1e12
    head_s = head_recompute_seconds(sum(lengths), hf_config.vocab_size, hf_config.hidden_size, rate)
    fixed = (inp.microbatches, inp.micro_batch_size * inp.seq_len)
    shape = step_shape(splits, fixed, heads, activations, comm_seconds, head_s)
    first = Setting(SyncChoice(SyncMode.PER_MICROBATCH), True if heads != (None,) else None)  # as configured
    return shape, first


def format_plan(plan: Plan) -> str:
    inp = plan.input
    mesh = f"{inp.replicas} x {inp.trainers // inp.replicas} (HSDP)" if inp.replicas > 1 else f"{inp.trainers}"
    if inp.rollout_ranks:
        mesh += f" training + {inp.rollout_ranks} rollout rank(s) of their own"
    links = "measured" if plan.links_measured else "assumed"
    lora = (f" (LoRA rank {inp.lora_rank}: {plan.trainable_params / 1e6:.2f}M trainable, "
            f"{plan.trainable_params / plan.num_params:.2%})" if inp.lora_rank else "")
    active = (f" ({plan.active_params / 1e9:.3f}B active a token: a mixture of experts)"
              if plan.active_params < plan.num_params else "")
    lines = [
        f"{inp.model}: {plan.num_params / 1e9:.3f}B parameters{lora}{active} in {plan.num_units} FSDP units; "
        f"ranks {mesh}; "
        f"{inp.microbatches} micro-batches/step; params {inp.param_dtype}, reduce {inp.reduce_dtype}",
        f"budget {format_bytes(plan.budget_bytes)} per rank ({inp.budget_fraction:.0%} of {inp.device_memory_gib:g} "
        f"GiB); links {plan.bandwidth_gbps:.3g} GB/s, {plan.latency_us:.3g} us ({links})",
    ]
    if plan.critic is None:
        lines += ["", *_model_lines(plan, "")]
    else:
        lines += ["", *_model_lines(plan, "actor (the policy, trained by its own engine)"),
                  "", *_model_lines(plan.critic, "critic (the same decoder with a one-output value head)")]
    if plan.rollout:
        r = plan.rollout
        where = "a rollout rank, the engine alone" if inp.rollout_ranks else "sampling"
        lines += ["", f"{where} ({inp.rollout_sequences} sequences x {inp.rollout_prompt_len} + "
                  f"{inp.rollout_new_tokens} tokens, {inp.rollout_dtype} copy): copy {format_bytes(r.copy_bytes)} + "
                  f"KV cache {format_bytes(r.kv_cache_bytes)} + logits ({inp.rollout_sampler}) "
                  f"{format_bytes(r.scores_bytes)} -> peak "
                  f"{format_bytes(r.peak_bytes)} ({'fits' if r.fits else 'does NOT fit'}"
                  f"{'' if inp.rollout_ranks else '; the same in every mode'})"]
    if plan.splits:
        lines += ["", f"dist.sequence_parallel (one {inp.seq_len}-token sequence per micro-batch, per_microbatch; "
                  f"auto takes the fewest that fit):", "", "| N | peak per rank | fits | all-to-all bytes / rank "
                  "| all-to-all time |", "|---|---|---|---|---|"]
        for option in plan.splits:
            seconds = option.exchange_seconds(inp.latency_us * 1e-6, inp.bandwidth_gbps * 1e9)
            lines.append(f"| {option.size} | {format_bytes(option.peak_bytes)} | "
                         f"{'yes' if option.peak_bytes <= plan.budget_bytes else 'NO'} | "
                         f"{format_bytes(option.exchange_bytes)} | {seconds * 1e3:.1f} ms |")
    if plan.critic is None:
        lines += ["", f"auto would choose: {plan.auto_choice} (predicted peak {format_bytes(plan.auto_predicted_peak)})"
                  + (f"; runner-up: {plan.auto_runner_up}" if plan.auto_runner_up else ""), f"  {plan.auto_reason}"]
    else:
        lines += ["", f"auto would choose: actor {plan.auto_choice}, critic {plan.critic.auto_choice}",
                  f"  actor: {plan.auto_reason}", f"  critic: {plan.critic.auto_reason}"]
    return "\n".join(lines)


def _model_lines(plan: Plan, title: str) -> list[str]:
    """One model's base and its table of modes."""
    inp = plan.input
    if inp.seq_len:
        shape = (f"{inp.micro_batch_size} x {inp.seq_len} tokens per micro-batch"
                 f"{', checkpointed' if inp.activation_checkpointing else ''}"
                 f"{'' if inp.fused_lm_head else ', logits materialised'}")
        activations = f" + activations {format_bytes(plan.activation_bytes)} ({shape})"
    else:
        activations = f" + {inp.activation_gib:g} GiB activations" if inp.activation_gib else ""
    colocated = plan.rollout and not inp.rollout_ranks
    copy = f" + rollout copy {format_bytes(plan.rollout.copy_bytes)}" if colocated else ""
    held = (f" + held outside {format_bytes(plan.held_outside_bytes)} (the other model's params and AdamW"
            f"{'' if plan.rollout or not inp.rollout_sequences or inp.rollout_ranks else ', the rollout copy'})"
            if plan.held_outside_bytes else "")
    lines = [
        *([f"{title}: {plan.num_params / 1e6:.2f}M parameters"] if title else []),
        f"per {'trainer ' if inp.rollout_ranks else ''}rank: base {format_bytes(plan.base_bytes)} (sharded fp32 "
        f"params + grads + AdamW{activations}{copy}"
        f"{held})",
        "",
        "| mode | held grads | held params | extra | peak | fits | all-gathers | reduce-scatters | all-reduces "
        "| AG bytes | RS bytes | AR bytes | comm time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in plan.modes[:-1] + plan.partial + plan.modes[-1:]:  # per_microbatch (the cheapest) last
        lines.append(
            f"| {m.mode} | {format_bytes(m.retained_grad_bytes)} | {format_bytes(m.unsharded_param_bytes)} "
            f"| +{format_bytes(m.extra_bytes)} | {format_bytes(m.peak_bytes)} | {'yes' if m.fits else 'NO'} "
            f"| {m.collectives['all_gather']} | {m.collectives['reduce_scatter']} | {m.collectives['all_reduce']} "
            f"| {format_bytes(m.collective_bytes['all_gather'])} "
            f"| {format_bytes(m.collective_bytes['reduce_scatter'])} "
            f"| {format_bytes(m.collective_bytes['all_reduce'])} | {m.comm_time_s * 1e3:.1f} ms |"
        )
    return lines


def plan_to_json(plan: Plan) -> str:
    return json.dumps(asdict(plan), indent=1)
