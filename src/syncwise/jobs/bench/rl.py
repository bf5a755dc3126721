"""``syncwise bench --workload rl``: real tokens per second on RL-shaped data, padded vs packed.

RL responses are long-tailed: here each rank holds ``sequences`` lengths drawn from a log-normal (median
96, sigma 1.5, clamped to 16-512; fixed seeds), the shape on which padded micro-batches computed twice the
real tokens. Every configuration trains the same model on the same data with the same loss; rounds are
interleaved as in :mod:`syncwise.jobs.bench.modes`. Per configuration: real tokens per second (all ranks), the
padding fraction, micro-batches per step, the estimated cross-rank imbalance (sum over micro-batches of
the slowest rank's workload / the mean's: the share of compute spent waiting for the slowest rank at the
micro-batch collectives) and the memory peak measured on the first step. A uniform-length dataset (every
sequence ``uniform_len`` tokens) is run beside it, where packing must cost nothing.

Beside the engine's packed, capped configurations runs what a user would write by hand over the same
packed micro-batches (:class:`HandWrittenPackedLoop`: the same split, attention and FSDP2 switches, a plain
``log_softmax`` + ``gather`` loss), so the engine's own overhead is a printed ratio.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...config import load_config
from ...engine import Engine
from ...models import PRESETS, build_model, count_parameters, preset_config
from ...models.flops import UsefulFlops
from ...runtime.distributed import DistInfo, run_rank
from .drift import drift_lines, in_turn
from .modes import time_interleaved
from .report import fmt, machine, write_report
from .roofline import fraction_of_peak, gemm_rate

# name -> overrides; the first is the reference the others are compared with. Rows whose name says nothing
# of the LM head fuse it (engine.fused_lm_head=true), beside the same row with the logits materialised and
# with the head auto's to choose.
CAP = ("engine.packing=true", "engine.max_tokens_per_micro_batch=512")
FUSED, MATERIALISED_HEAD = "engine.fused_lm_head=true", "engine.fused_lm_head=false"
RL_CONFIGS: dict[str, tuple[str, ...]] = {
    "padded, 4 per micro-batch": ("engine.packing=false", "engine.micro_batch_size=4", "sync.mode=deferred", FUSED),
    "packed, 4 per micro-batch": ("engine.packing=true", "engine.micro_batch_size=4", "sync.mode=deferred", FUSED),
    "packed, 512-token cap": (*CAP, "sync.mode=deferred", FUSED),
    "packed, 512-token cap, logits materialised": (*CAP, "sync.mode=deferred", MATERIALISED_HEAD),
    "packed, 512-token cap, LM head auto": (*CAP, "sync.mode=deferred"),
    "packed, 512-token cap, per_microbatch": (*CAP, "sync.mode=per_microbatch", FUSED),
    "packed, 512-token cap, per_microbatch, logits materialised": (*CAP, "sync.mode=per_microbatch", MATERIALISED_HEAD),
    "packed, 512-token cap, per_microbatch, LM head auto": (*CAP, "sync.mode=per_microbatch"),
    "packed, 512-token cap, deferred_unsharded": (*CAP, "sync.mode=deferred_unsharded", FUSED),
    "packed, 512-token cap, deferred_unsharded, logits materialised": (
        *CAP, "sync.mode=deferred_unsharded", MATERIALISED_HEAD,
    ),
    "packed, 2048-token cap, deferred_unsharded, logits materialised": (
        "engine.packing=true", "engine.max_tokens_per_micro_batch=2048", "sync.mode=deferred_unsharded",
        MATERIALISED_HEAD,
    ),
    "defaults (sync mode, LM head and token cap auto)": (),
    "padded, 4 per micro-batch, checkpointed": (
        "engine.packing=false", "engine.micro_batch_size=4", "sync.mode=deferred", FUSED,
        "engine.activation_checkpointing=true",
    ),
    "packed, 512-token cap, checkpointed": (*CAP, "sync.mode=deferred", FUSED, "engine.activation_checkpointing=true"),
}
UNIFORM_CONFIGS = ("padded, 4 per micro-batch", "packed, 4 per micro-batch")
MATERIALISED = ", logits materialised"  # engine.fused_lm_head=false: the same configuration with the logits kept
HEAD_AUTO = ", LM head auto"  # engine.fused_lm_head=auto: the same configuration, the head auto's to choose
DEFAULTS = "defaults (sync mode, LM head and token cap auto)"
# Hand-written baseline -> (the engine configuration it mirrors, its sync mode, its token cap).
HAND_WRITTEN: dict[str, tuple[str, str, int]] = {
    "hand-written packed loop, 512-token cap": ("packed, 512-token cap, logits materialised", "deferred", 512),
    "hand-written packed loop, 512-token cap, per_microbatch": (
        "packed, 512-token cap, per_microbatch, logits materialised", "per_microbatch", 512,
    ),
    "hand-written packed loop, 512-token cap, deferred_unsharded": (
        "packed, 512-token cap, deferred_unsharded, logits materialised", "deferred_unsharded", 512,
    ),
}


class HandWrittenPackedLoop:
    """A plain FSDP2 training step over the engine's packed micro-batches, as a user would write it:
    ``fully_shard`` per decoder layer and the root, ``sdpa_varlen`` attention, each step the batch split and
    packed with syncwise's data layer under the same token cap (the micro-batch count agreed by one
    all-reduce, the global target count by another), the sync mode's switches set by hand
    (``set_requires_gradient_sync`` / ``set_reshard_after_backward`` / ``set_reshard_after_forward``), a
    token-mean ``log_softmax`` + ``gather`` loss, clipping at 1.0 and AdamW. No metering, audit or metrics."""

    def __init__(self, preset: str, mode: str, max_tokens: int, info: DistInfo, model: torch.nn.Module | None = None,
                 param_dtype: torch.dtype = torch.float32):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ...data import attention
        from ...models import decoder_layers

        cfg = load_config(None, [f"model.preset={preset}"])
        self.model = (model if model is not None else build_model(cfg.model)).to(info.device)
        attention.register()
        self.model.set_attn_implementation(attention.NAME)
        # bf16 compute, fp32 master weights and reduction: as the engine's model.param_dtype=bfloat16
        mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for layer in decoder_layers(self.model):
            fully_shard(layer, mp_policy=mixed)
        fully_shard(self.model, mp_policy=mixed)
        if mode == "deferred_unsharded":  # as the engine with sync.unsharded_forward: never reshard after forward
            self.model.set_reshard_after_forward(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr)
        self.mode, self.max_tokens, self.info = mode, max_tokens, info
        self.real_tokens = 0.0  # over every rank, of the last step
        self.microbatches = 0

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        import torch.distributed as dist
        import torch.nn.functional as F

        from ...data.attention import sequence_bounds
        from ...data.batching import microbatches_needed, sequence_lengths, split_batch
        from ...data.packing import pack

        counts = torch.tensor([float(microbatches_needed(batch, 1, self.max_tokens, packed=True))])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        lengths = sequence_lengths(batch)
        totals = torch.tensor([float((lengths - 1).clamp(min=0).sum()), float(lengths.sum())])
        dist.all_reduce(totals)
        targets, self.real_tokens = float(totals[0]), float(totals[1])
        parts = split_batch(batch, int(counts[0]), max_tokens=self.max_tokens, packed=True)
        self.microbatches = len(parts)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            self.model.set_requires_gradient_sync(last or self.mode == "per_microbatch")
            if self.mode == "deferred_unsharded":
                self.model.set_reshard_after_backward(last)
            if part.data is None:  # this rank has fewer samples: a zero loss still runs every unit
                ids = torch.zeros((1, 2), dtype=torch.long)
                (self.model(input_ids=ids, use_cache=False).logits.sum() * 0.0).backward()
                continue
            packed, _ = pack(part.data)
            positions = packed["position_ids"]
            logits = self.model(input_ids=packed["input_ids"], position_ids=positions, use_cache=False,
                                **sequence_bounds(positions)).logits
            ids, mask = packed["input_ids"][0, 1:], packed["loss_mask"][0, 1:]
            token_loss = F.cross_entropy(logits[0, :-1].float(), ids, reduction="none")
            ((token_loss * mask).sum() / targets * self.info.world_size).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@dataclass
class RLBenchSpec:
    presets: list[str] = field(default_factory=lambda: ["qwen2-20m"])
    sequences: int = 32  # per rank
    uniform_len: int = 128
    configs: list[str] = field(default_factory=lambda: list(RL_CONFIGS))
    warmup: int = 1
    repeats: int = 5
    out_dir: str = "runs/bench_rl"
    hand_written: bool = True  # the hand-written packed loops beside the engine's packed, capped configurations
    # then the defaults beside the hand-written loop, alternately, for this many steps (after settling): the slope
    # of each one's step time (issue 62: the engine's drifted up within a run while the loop's stayed flat)
    drift_steps: int = 24

    @classmethod
    def quick(cls, out_dir: str = "runs/bench_rl") -> RLBenchSpec:
        """The small version (about 2 minutes on 2 CPU ranks): the tiny model, 16 sequences per rank, the
        padded reference and the packed configurations without activation checkpointing."""
        configs = [name for name in RL_CONFIGS if "checkpointed" not in name]
        return cls(presets=["qwen2-tiny"], sequences=16, configs=configs, warmup=1, repeats=2, out_dir=out_dir,
                   drift_steps=8)


def long_tail_lengths(count: int, rank: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * seed + rank)
    draws = torch.exp(math.log(96.0) + 1.5 * torch.randn(count, generator=gen))
    return draws.round().clamp(16, 512).long()


def batch_of(lengths: torch.Tensor, vocab: int, rank: int) -> dict[str, torch.Tensor]:
    """Right-padded prompts of the given lengths, every token in the loss."""
    width = int(lengths.max())
    gen = torch.Generator().manual_seed(1000 + rank)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask}


def run_rl_bench(info: DistInfo, spec: RLBenchSpec) -> list[dict[str, Any]]:
    records = []
    for preset in spec.presets:
        vocab = PRESETS[preset]["vocab_size"]
        datasets = {
            "rl": long_tail_lengths(spec.sequences, info.rank),
            "uniform": torch.full((spec.sequences,), spec.uniform_len),
        }
        entries = []
        for data, lengths in datasets.items():
            for name in spec.configs if data == "rl" else [c for c in spec.configs if c in UNIFORM_CONFIGS]:
                cfg = load_config(None, [f"model.preset={preset}", "engine.strategy=fsdp2", *RL_CONFIGS[name]])
                entries.append({"preset": preset, "data": data, "config": name, "times": [], "metrics": {},
                                "runner": Engine(cfg, build_model(cfg.model), info),
                                "batch": batch_of(lengths, vocab, info.rank)})
        for name, (mirrors, mode, cap) in HAND_WRITTEN.items():
            if spec.hand_written and mirrors in spec.configs:
                entries.append({"preset": preset, "data": "rl", "config": name, "times": [], "metrics": {},
                                "runner": HandWrittenPackedLoop(preset, mode, cap, info),
                                "batch": batch_of(datasets["rl"], vocab, info.rank)})
        time_interleaved(entries, spec.warmup, spec.repeats, info)
        drift = _drift(entries, spec.drift_steps, info) if spec.drift_steps else {}
        params = count_parameters(build_model(load_config(None, [f"model.preset={preset}"]).model))
        hf_config = preset_config(preset)
        rate = gemm_rate(hf_config, torch.float32, info.device)  # after the timed steps, on the same threads
        for entry in entries:
            flops = torch.tensor([UsefulFlops.of(entry["runner"].model, hf_config).of_lengths(
                datasets[entry["data"]].tolist())])
            dist.all_reduce(flops)  # each rank's own sequences
            record = _record(entry, params)
            if entry["config"] in drift:
                record["drift"] = drift[entry["config"]]
            record |= {"useful_flops_per_step": float(flops), "gemm_flops_per_s": rate, "fraction_of_gemm_peak":
                       fraction_of_peak(float(flops), record["step_time_median_s"], rate, info.world_size)}
            records.append(record)
            del entry["runner"]
    _add_ratios(records)
    return records


def _drift(entries: list[dict[str, Any]], steps: int, info: DistInfo) -> dict[str, dict[str, Any]]:
    """The defaults and the hand-written loop (of the defaults' sync mode, if run) in turn: :func:`drift.in_turn`."""
    pair = [e for e in entries if e["config"] == DEFAULTS and e["data"] == "rl"]
    if not pair:
        return {}
    mode = pair[0]["metrics"]["sync/mode"]
    loops = [e for e in entries if e["config"] in HAND_WRITTEN]
    pair += sorted(loops, key=lambda e: HAND_WRITTEN[e["config"]][1] != mode)[:1]
    return in_turn(pair, steps, info)


def _record(entry: dict[str, Any], params: int) -> dict[str, Any]:
    median = statistics.median(entry["times"])
    runner = entry["runner"]
    if isinstance(runner, HandWrittenPackedLoop):
        return {
            "preset": entry["preset"], "params": params, "data": entry["data"], "config": entry["config"],
            "step_time_samples_s": entry["times"], "step_time_median_s": median,
            "real_tokens_per_step": runner.real_tokens, "real_tokens_per_s": runner.real_tokens / median,
            "computed_tokens_per_step": runner.real_tokens, "padding_fraction": 0.0,
            "microbatches": runner.microbatches, "cross_rank_imbalance": None, "peak_bytes": None,
            "peak_measured": None, "sync_mode": runner.mode,
        }
    m, first = entry["metrics"], entry["first_metrics"]
    return {
        "preset": entry["preset"], "params": params, "data": entry["data"], "config": entry["config"],
        "step_time_samples_s": entry["times"], "step_time_median_s": median,
        "real_tokens_per_step": m["batch/real_tokens"], "real_tokens_per_s": m["batch/real_tokens"] / median,
        "computed_tokens_per_step": m["batch/computed_tokens"], "padding_fraction": m["batch/padding_fraction"],
        "microbatches": m["train/num_microbatches"], "cross_rank_imbalance": m["batch/cross_rank_imbalance"],
        "peak_bytes": first.get("memory/peak_bytes"), "peak_measured": first.get("memory/peak_measured"),
        "sync_mode": m["sync/mode"], "fused_lm_head": bool(m["engine/fused_lm_head"]),
        "token_cap": m["engine/max_tokens_per_micro_batch"], "engine_useful_flops": m["perf/useful_flops"],
        "settle_s": entry["settle_s"], "settle_steps": entry["settle_steps"],  # its first steps, auto's choice made
    }


def _add_ratios(records: list[dict[str, Any]]) -> None:
    reference = next(iter(RL_CONFIGS))
    speed = {(r["preset"], r["data"]): r["real_tokens_per_s"] for r in records if r["config"] == reference}
    for r in records:
        base = speed.get((r["preset"], r["data"]))
        r["throughput_vs_padded"] = r["real_tokens_per_s"] / base if base else None
    steps = {(r["preset"], r["config"]): r["step_time_median_s"] for r in records if r["data"] == "rl"}
    peaks = {(r["preset"], r["config"]): r["peak_bytes"] for r in records if r["data"] == "rl"}
    for r in records:
        for name, (mirrors, _, _) in HAND_WRITTEN.items():
            if r["config"] == mirrors and r["data"] == "rl" and (r["preset"], name) in steps:
                r["engine_vs_hand_written"] = r["step_time_median_s"] / steps[(r["preset"], name)]
        materialised = (r["preset"], r["config"] + MATERIALISED)
        if r["data"] == "rl" and materialised in steps:
            r["fused_vs_materialised"] = r["step_time_median_s"] / steps[materialised]
            r["materialised_peak_bytes"] = peaks[materialised]
        if r["data"] == "rl" and r["config"].endswith(HEAD_AUTO):
            r["auto_vs_materialised"] = r["step_time_median_s"] / steps[(r["preset"], r["config"][:-len(HEAD_AUTO)]
                                                                         + MATERIALISED)]
    for r in records:  # the defaults against the fastest hand-set split (a cap or a size) of the engine
        hand_set = [x for x in records if x["preset"] == r["preset"] and x["data"] == "rl"
                    and x["config"] not in HAND_WRITTEN and x["config"] != DEFAULTS]
        if r["config"] == DEFAULTS and r["data"] == "rl" and hand_set:
            best = max(hand_set, key=lambda x: x["real_tokens_per_s"])
            r["defaults_vs_best_hand_set"] = r["real_tokens_per_s"] / best["real_tokens_per_s"]
            r["best_hand_set"] = best["config"]


def markdown_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| model | data | configuration | step s (median) | real tokens/s | vs padded | padding | micro-batches "
        "| cross-rank imbalance | of GEMM peak | peak MiB | ran in |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        peak = f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] else "–"
        ran = r["sync_mode"]
        if "fused_lm_head" in r:
            cap = f", cap {r['token_cap']:g}" if r["token_cap"] else ""
            ran += f", {'fused' if r['fused_lm_head'] else 'materialised'}{cap}"
        lines.append(
            f"| {r['preset']} ({r['params'] / 1e6:.1f}M) | {r['data']} | {r['config']} | {r['step_time_median_s']:.3f} "
            f"| {r['real_tokens_per_s']:.0f} | {r['throughput_vs_padded']:.2f} | {r['padding_fraction']:.1%} "
            f"| {r['microbatches']:g} | {fmt(r['cross_rank_imbalance'], 3, '–')} "
            f"| {r['fraction_of_gemm_peak']:.1%} | {peak} "
            f"| {ran} |"
        )
    return "\n".join(lines)


def summary(records: list[dict[str, Any]]) -> list[str]:
    """The targets of docs/benchmarks.md: packed >= 1.7x padded micro-batches of 4 on the long tail, and no
    slower on uniform lengths."""
    lines = []
    for r in records:
        if r["config"] == "packed, 4 per micro-batch":
            target = ">= 1.70" if r["data"] == "rl" else ">= 1.00 (no slower)"
            lines.append(f"{r['preset']}, {r['data']} data: packed / padded real tokens per second "
                         f"{r['throughput_vs_padded']:.2f} (target {target})")
    for r in records:
        if "engine_vs_hand_written" in r:
            lines.append(f"{r['preset']}: engine / hand-written packed loop step time, {r['sync_mode']} "
                         f"{r['engine_vs_hand_written']:.3f} (target <= 1.03)")
    for r in records:
        if "fused_vs_materialised" in r:
            peaks_mib = [b / 2**20 if b else None for b in (r["peak_bytes"], r["materialised_peak_bytes"])]
            peak = f"; first-step peak {peaks_mib[0]:.1f} vs {peaks_mib[1]:.1f} MiB" if all(peaks_mib) else ""
            lines.append(f"{r['preset']}: fused LM head / materialised logits step time, {r['sync_mode']} "
                         f"{r['fused_vs_materialised']:.3f} (target <= 1.00){peak}")
    for r in records:
        if "auto_vs_materialised" in r:
            lines.append(f"{r['preset']}: LM head auto / materialised logits step time, {r['sync_mode']} "
                         f"{r['auto_vs_materialised']:.3f} (target <= 1.00 where they fit)")
        if r["config"] == DEFAULTS:
            lines.append(f"{r['preset']}, {r['data']} data: auto settled in {r['settle_steps']} steps, "
                         f"{r['settle_s']:.2f} s (the first measured in the safe setting, the next in its choice, "
                         f"measured too) against {r['step_time_median_s']:.2f} s for a settled step")
        if "defaults_vs_best_hand_set" in r:
            lines.append(f"{r['preset']}: defaults / fastest hand-set configuration ({r['best_hand_set']}) real "
                         f"tokens per second {r['defaults_vs_best_hand_set']:.3f} (target >= 0.97); the defaults "
                         f"ran {r['sync_mode']}, {r['microbatches']:g} micro-batch(es)")
    lines += drift_lines(records)
    engine_rows = [r for r in records if r["data"] == "rl" and r["config"] not in HAND_WRITTEN]
    best = max(engine_rows, key=lambda r: r["real_tokens_per_s"], default=None)
    if best:
        lines.append(f"fastest on the long tail: {best['config']} ({best['throughput_vs_padded']:.2f}x padded)")
    for r in records:  # how far from the machine's limit, the engine's defaults beside the hand-written loops
        if r["data"] == "rl" and (r["config"] == DEFAULTS or r["config"] in HAND_WRITTEN):
            lines.append(f"{r['preset']}: {r['config']}: {r['fraction_of_gemm_peak']:.1%} of the GEMM peak "
                         f"({r['useful_flops_per_step'] / 1e9:.1f} useful GFLOP per step over "
                         f"{r['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s per rank at the model's shapes, this run)")
    return lines


def spec_of(args) -> RLBenchSpec:
    """The spec of the parsed arguments (``--quick``: the small version; explicit options override it)."""
    from . import out_dir

    out = out_dir(args, "bench_rl")
    spec = RLBenchSpec.quick(out) if args.quick else RLBenchSpec(out_dir=out)
    for name in ("presets", "repeats", "warmup", "sequences"):
        if getattr(args, name) is not None:
            setattr(spec, name, getattr(args, name))
    return spec


def run(args) -> int:
    """``syncwise bench --workload rl``: launched ranks; with ``--profile`` one process, no ranks."""
    from ...runtime.launcher import launch
    from . import out_dir

    if args.profile:
        from .profile import profile_packed_step

        preset = (args.presets or ["qwen2-20m"])[0]
        batch = batch_of(long_tail_lengths(args.sequences or 32, 0), PRESETS[preset]["vocab_size"], 0)
        return profile_packed_step(batch, CAP, preset, out_dir=out_dir(args, "bench_rl"))
    return launch(bench_rl_worker, args.nproc, asdict(spec_of(args)))


def bench_rl_worker(spec_dict: dict[str, Any]) -> None:
    spec = RLBenchSpec(**spec_dict)

    def body(info: DistInfo) -> None:
        records = run_rl_bench(info, spec)
        if info.is_main:
            write_report(spec.out_dir, "bench_rl", spec, {"machine": machine(info), "records": records},
                         markdown_table(records), summary(records))

    run_rank(body)
