"""``syncwise bench``: step time, communication and memory of every sync mode, side by side, with baselines.

Per model preset and micro-batch count it builds one engine per mode (and one under ``auto``), plus two
baselines on the same model and data:

- ``raw_fsdp2``: a minimal hand-written FSDP2 loop (``fully_shard`` + AdamW, sync deferred by hand with
  ``set_requires_gradient_sync``), to show the engine's own overhead;
- ``compute_floor``: the same per-rank work on an unwrapped local model (world size 1 per rank, no
  communication), run at the same time on every rank so the CPU is shared alike: the limit any mode
  can approach.

With ``lora_rank`` > 0 it adds LoRA rows (``lora8:deferred``, ...): the same model with adapters of that
rank, in ``lora_modes``, so step time and held bytes read beside the full model's.

Every round times one step of each configuration, in an order rotated each round, so machine drift hits
all alike. Ratios come from the same run. Results: ``bench.json`` (every sample), ``bench.md`` (table) and
PNG plots.
"""

from __future__ import annotations

import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from ...config import load_config
from ...engine import Engine
from ...losses import sft_loss
from ...models import PRESETS, build_model, count_parameters, decoder_layers, preset_config
from ...models.flops import UsefulFlops
from ...runtime.distributed import DistInfo, agreed_stop, run_rank
from ...runtime.signals import JobStopped
from ...sync.modes import MODES, SyncMode
from .report import fmt, machine, write_report
from .roofline import fraction_of_peak, gemm_rate

# Every whole-model mode plain FSDP2 runs (the table's order), and auto; partial on request (--modes).
ENGINE_MODES = tuple(
    m.value for m in MODES if MODES[m].runs_on("fsdp2", hsdp=False) and not MODES[m].per_unit
) + (SyncMode.AUTO.value,)
BASELINES = ("raw_fsdp2", "compute_floor")


@dataclass
class BenchSpec:
    presets: list[str] = field(default_factory=lambda: ["qwen2-tiny", "qwen2-20m"])
    microbatches: list[int] = field(default_factory=lambda: [2, 4, 8])
    modes: list[str] = field(default_factory=lambda: list(ENGINE_MODES))
    baselines: bool = True
    seq_len: int = 64
    warmup: int = 2
    repeats: int = 5
    out_dir: str = "runs/bench"
    lora_rank: int = 8  # LoRA rows with adapters of this rank (0: none)
    lora_modes: list[str] = field(default_factory=lambda: ["per_microbatch", "deferred", "deferred_unsharded"])

    @classmethod
    def quick(cls, out_dir: str = "runs/bench") -> BenchSpec:
        return cls(presets=["qwen2-tiny"], microbatches=[2, 8], warmup=1, repeats=3, out_dir=out_dir,
                   lora_modes=["deferred"])

    def lora_configs(self) -> list[str]:
        return [f"lora{self.lora_rank}:{mode}" for mode in self.lora_modes] if self.lora_rank else []


def _batch(num_samples: int, seq_len: int, vocab: int, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return {"input_ids": torch.randint(0, vocab, (num_samples, seq_len), generator=gen)}


class RawFSDP2Loop:
    """What a user would write by hand: per-layer ``fully_shard``, AdamW, token-mean loss over the global
    batch, gradient sync only on the last micro-batch."""

    def __init__(self, preset: str, info: DistInfo):
        cfg = load_config(None, [f"model.preset={preset}"])
        self.model = build_model(cfg.model).to(info.device)
        for layer in decoder_layers(self.model):
            fully_shard(layer)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr)
        self.world = info.world_size

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        ids = batch["input_ids"]
        global_tokens = ids[:, 1:].numel() * self.world
        for i in range(len(ids)):
            self.model.set_requires_gradient_sync(i == len(ids) - 1)
            logits = self.model(input_ids=ids[i : i + 1]).logits
            loss = F.cross_entropy(logits[0, :-1].float(), ids[i, 1:], reduction="sum")
            (loss / global_tokens * self.world).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class ComputeFloor:
    """The same per-rank forward/backward/AdamW work on an unwrapped model: no communication at all."""

    def __init__(self, preset: str, info: DistInfo):
        cfg = load_config(None, [f"model.preset={preset}"])
        self.model = build_model(cfg.model).to(info.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr)

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        ids = batch["input_ids"]
        for i in range(len(ids)):
            logits = self.model(input_ids=ids[i : i + 1]).logits
            loss = F.cross_entropy(logits[0, :-1].float(), ids[i, 1:], reduction="sum")
            (loss / ids[:, 1:].numel()).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _engine(preset: str, config: str, info: DistInfo) -> Engine:
    """An engine for ``config``: a mode, or ``lora<rank>:<mode>``; ``partial`` defers half the units (the ones
    that save the most per byte)."""
    lora, _, mode = config.rpartition(":")
    extra = [f"model.lora.rank={lora.removeprefix('lora')}"] if lora else []
    if mode == SyncMode.PARTIAL.value:
        extra.append(f"sync.deferred_units={(PRESETS[preset]['num_hidden_layers'] + 1) // 2}")
    cfg = load_config(None, [f"model.preset={preset}", "engine.strategy=fsdp2", f"sync.mode={mode}",
                             "engine.micro_batch_size=1", *extra])
    return Engine(cfg, build_model(cfg.model), info)


def time_interleaved(entries: list[dict[str, Any]], warmup: int, repeats: int, info: DistInfo) -> None:
    """One step of every entry per round, in an order rotated each round (machine drift hits all alike);
    an engine under auto takes the extra warm-up steps it needs to settle (its decision, the caps it times);
    each entry's ``times`` gets its timed steps, ``metrics`` its engine's last metrics and
    ``first_metrics`` its first step's (the one whose memory peak the engine measures). Ctrl-C / SIGTERM
    stop it before the next step (agreed by every rank, outside the timed part): :class:`JobStopped`."""
    rounds = warmup + repeats
    for round_index in range(rounds):
        shift = round_index % len(entries)
        for entry in entries[shift:] + entries[:shift]:
            if signum := agreed_stop(info.device, 600.0):
                raise JobStopped(signum, f"syncwise: bench stopped by {signal.Signals(signum).name} in round "
                                         f"{round_index + 1} of {rounds}; no results written")
            dist.barrier()
            start = time.perf_counter()
            runner = entry["runner"]
            if isinstance(runner, Engine):
                entry["metrics"] = runner.train_batch(entry["batch"], sft_loss)
                entry.setdefault("first_metrics", entry["metrics"])
                while round_index < warmup and not runner.governor.settled:  # auto's decision, caps timed
                    entry["metrics"] = runner.train_batch(entry["batch"], sft_loss)
                if "settle_s" not in entry and runner.governor.settled:  # what auto's settling cost (all ranks)
                    entry["settle_s"], entry["settle_steps"] = time.perf_counter() - start, runner.step
            else:
                runner.step(entry["batch"])
            dist.barrier()  # a step ends when the slowest rank is done
            if round_index >= warmup:
                entry["times"].append(time.perf_counter() - start)


def run_bench(info: DistInfo, spec: BenchSpec) -> list[dict[str, Any]]:
    """Run every configuration; returns one record per configuration (on every rank)."""
    records: list[dict[str, Any]] = []
    for preset in spec.presets:
        params = count_parameters(build_model(load_config(None, [f"model.preset={preset}"]).model))
        entries = []
        for n in spec.microbatches:
            names = list(spec.modes) + spec.lora_configs() + (list(BASELINES) if spec.baselines else [])
            for name in names:
                if name == "raw_fsdp2":
                    runner: Any = RawFSDP2Loop(preset, info)
                elif name == "compute_floor":
                    runner = ComputeFloor(preset, info)
                else:
                    runner = _engine(preset, name, info)
                batch = _batch(n, spec.seq_len, _vocab(preset), info.rank)
                entries.append({"preset": preset, "params": params, "microbatches": n, "config": name,
                                "runner": runner, "batch": batch, "times": [], "metrics": {}})
        time_interleaved(entries, spec.warmup, spec.repeats, info)
        engine = next((e["runner"] for e in entries if isinstance(e["runner"], Engine)), None)
        minimum = minimum_collectives_s(engine, info) if engine is not None else None
        hf_config = preset_config(preset)
        rate = gemm_rate(hf_config, torch.float32, info.device)  # after the timed steps, on the same threads
        for entry in entries:
            flops = UsefulFlops.of(entry["runner"].model, hf_config).of_lengths([spec.seq_len] * entry["microbatches"])
            roofline = {"useful_flops_per_step": flops * info.world_size, "gemm_flops_per_s": rate,
                        "fraction_of_gemm_peak": fraction_of_peak(flops * info.world_size, statistics.median(
                            entry["times"]), rate, info.world_size)}
            records.append(_record(entry, info, spec) | {"minimum_collectives_s": minimum} | roofline)
            del entry["runner"]
    _add_ratios(records)
    return records


def minimum_collectives_s(engine: Engine, info: DistInfo) -> float:
    """The time of the collectives no sync mode can avoid in a step: one all-gather and one reduce-scatter
    of every FSDP unit, timed on these ranks (:func:`syncwise.memory.calibrate.time_collective`)."""
    from ...memory.calibrate import time_collective
    from ...memory.schedule import unit_traffic

    units = unit_traffic(engine.memory_model, hsdp=False)
    return sum(time_collective("all_gather", u.gather_bytes, info.device)
               + time_collective("reduce_scatter", u.reduce_bytes, info.device) for u in units)


def _vocab(preset: str) -> int:
    return PRESETS[preset]["vocab_size"]


def _record(entry: dict[str, Any], info: DistInfo, spec: BenchSpec) -> dict[str, Any]:
    m = entry["metrics"]
    record = {
        "preset": entry["preset"], "params": entry["params"], "microbatches": entry["microbatches"],
        "config": entry["config"], "world_size": info.world_size, "seq_len": spec.seq_len,
        "step_time_samples_s": entry["times"],
        "step_time_median_s": statistics.median(entry["times"]),
        "step_time_spread_s": max(entry["times"]) - min(entry["times"]),
    }
    if m:
        record["mode_run"] = m["sync/mode"]
        record.update({k: v for k, v in m.items() if k.startswith(("comm/", "memory/"))})
        if entry["config"] == "auto":
            record["auto_choice"] = m.get("sync/next_mode")
    return record


def _add_ratios(records: list[dict[str, Any]]) -> None:
    def median(preset: str, n: int, config: str) -> float | None:
        for r in records:
            if (r["preset"], r["microbatches"], r["config"]) == (preset, n, config):
                return r["step_time_median_s"]
        return None

    for r in records:
        key = (r["preset"], r["microbatches"])
        for name, base in (("per_microbatch", "ratio_to_per_microbatch"), ("compute_floor", "ratio_to_floor")):
            ref = median(*key, name)
            r[base] = r["step_time_median_s"] / ref if ref else None
        raw = median(*key, "raw_fsdp2")
        if r["config"] == "deferred" and raw:
            r["engine_overhead_vs_raw"] = r["step_time_median_s"] / raw
        floor = median(*key, "compute_floor")
        if floor is not None and r.get("minimum_collectives_s") is not None:
            # The truer limit: the same compute, plus the collectives every mode must issue.
            r["limit_s"] = floor + r["minimum_collectives_s"]
            r["ratio_to_limit"] = r["step_time_median_s"] / r["limit_s"]


def markdown_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| model | micro-batches | configuration | step s (median) | spread s | vs per_microbatch | vs floor "
        "| vs limit | of GEMM peak | all-gathers | reduce-scatters | all-reduces | AG MiB | RS MiB | held grad MiB "
        "| held params MiB | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        config = r["config"] + (f" → {r['auto_choice']}" if r.get("auto_choice") else "")
        comm = [str(r[f"comm/{k}_count"]) if f"comm/{k}_count" in r else "–"
                for k in ("all_gather", "reduce_scatter", "all_reduce")]
        mib = [fmt(r[k] / 2**20, 1) if k in r else "–" for k in
               ("comm/all_gather_bytes", "comm/reduce_scatter_bytes", "memory/retained_grad_bytes",
                "memory/unsharded_param_bytes", "memory/peak_bytes")]
        lines.append(
            f"| {r['preset']} ({r['params'] / 1e6:.1f}M) | {r['microbatches']} | {config} "
            f"| {r['step_time_median_s']:.3f} | {r['step_time_spread_s']:.3f} "
            f"| {fmt(r['ratio_to_per_microbatch'])} | {fmt(r['ratio_to_floor'])} | {fmt(r.get('ratio_to_limit'))} "
            f"| {r['fraction_of_gemm_peak']:.1%} | {' | '.join(comm)} "
            f"| {' | '.join(mib)} |"
        )
    return "\n".join(lines)


def summary(records: list[dict[str, Any]]) -> list[str]:
    """The targets of docs/benchmarks.md, at the largest micro-batch count of each model."""
    lines = []
    for preset in dict.fromkeys(r["preset"] for r in records):
        n = max(r["microbatches"] for r in records if r["preset"] == preset)
        at = {r["config"]: r for r in records if r["preset"] == preset and r["microbatches"] == n}
        parts = [f"{preset}, {n} micro-batches:"]
        if "deferred" in at and at["deferred"]["ratio_to_per_microbatch"]:
            parts.append(f"deferred/per_microbatch {at['deferred']['ratio_to_per_microbatch']:.2f}")
        if "deferred_unsharded" in at and at["deferred_unsharded"]["ratio_to_per_microbatch"]:
            ratio = at["deferred_unsharded"]["ratio_to_per_microbatch"]
            parts.append(f"deferred_unsharded/per_microbatch {ratio:.2f}")
        if "deferred" in at and "engine_overhead_vs_raw" in at["deferred"]:
            parts.append(f"engine/raw loop (deferred) {at['deferred']['engine_overhead_vs_raw']:.3f}")
        modes = [at[m] for m in at if m not in BASELINES and at[m].get("ratio_to_floor")]
        if modes:
            best = min(modes, key=lambda r: r["step_time_median_s"])
            parts.append(f"best mode ({best['config']})/compute floor {best['ratio_to_floor']:.2f}")
            if best.get("ratio_to_limit"):
                parts.append(f"best mode/limit (floor + minimum collectives) {best['ratio_to_limit']:.2f}")
            beside = ", ".join(f"{name} {at[name]['fraction_of_gemm_peak']:.1%}" for name in BASELINES if name in at)
            parts.append(f"best mode at {best['fraction_of_gemm_peak']:.1%} of the GEMM peak "
                         f"({best['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s per rank at the model's shapes, this run)"
                         + (f"; {beside}" if beside else ""))
        if "auto" in at:
            parts.append(f"auto chose {at['auto'].get('auto_choice')}")
        for config in (c for c in at if c.startswith("lora") and c.partition(":")[2] in at):
            full, lora = at[config.partition(":")[2]], at[config]
            held = [r.get("memory/retained_grad_bytes", 0) / 2**20 for r in (lora, full)]
            ratio = lora["step_time_median_s"] / full["step_time_median_s"]
            parts.append(f"{config}/{full['config']} step {ratio:.2f}, held grads {held[0]:.2f} vs {held[1]:.2f} MiB")
        lines.append(" ".join(parts[:1]) + " " + "; ".join(parts[1:]))
    return lines


def plot(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in records))
    configs = list(dict.fromkeys(r["config"] for r in records))
    paths = []

    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        for config in configs:
            pts = sorted((r["microbatches"], r["step_time_median_s"]) for r in records
                         if r["preset"] == preset and r["config"] == config)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=config,
                        linestyle="--" if config in BASELINES else "-")
        ax.set_title(f"{preset}: step time")
        ax.set_xlabel("micro-batches per step")
        ax.set_ylabel("seconds (median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "step_time.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    for name, keys, title in (
        ("bytes.png", ("comm/all_gather_bytes", "comm/reduce_scatter_bytes", "comm/all_reduce_bytes"),
         "bytes per step"),
        ("memory.png", ("memory/retained_grad_bytes", "memory/unsharded_param_bytes"),
         "held between micro-batches"),
    ):
        fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
        for ax, preset in zip(axes[0], presets, strict=True):
            n = max(r["microbatches"] for r in records if r["preset"] == preset)
            rows = [r for r in records if r["preset"] == preset and r["microbatches"] == n and keys[0] in r]
            bottom = [0.0] * len(rows)
            for key in keys:
                values = [r.get(key, 0) / 2**20 for r in rows]
                ax.bar([r["config"] for r in rows], values, bottom=bottom, label=key.split("/")[1])
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            if name == "memory.png":
                ax.plot([r["config"] for r in rows], [r.get("memory/peak_bytes", 0) / 2**20 for r in rows],
                        "k_", markersize=30, label="peak")
            ax.set_title(f"{preset}, {n} micro-batches: {title}")
            ax.set_ylabel("MiB")
            ax.tick_params(axis="x", labelsize=8)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def spec_of(args) -> BenchSpec:
    """The spec of the parsed arguments (``--quick``: the small version; explicit options override it)."""
    spec = BenchSpec.quick(args.out) if args.quick else BenchSpec(out_dir=args.out)
    spec.baselines = not args.no_baselines
    for name in ("presets", "microbatches", "modes", "repeats", "warmup", "seq_len", "lora_rank", "lora_modes"):
        if getattr(args, name) is not None:
            setattr(spec, name, getattr(args, name))
    return spec


def run(args) -> int:
    """``syncwise bench`` (``--workload modes``): the sync modes side by side on launched ranks."""
    from ...runtime.launcher import launch

    return launch(bench_worker, args.nproc, asdict(spec_of(args)))


def bench_worker(spec_dict: dict[str, Any]) -> None:
    spec = BenchSpec(**spec_dict)

    def body(info: DistInfo) -> None:
        records = run_bench(info, spec)
        if info.is_main:
            Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
            write_report(spec.out_dir, "bench", spec, {"machine": machine(info), "records": records},
                         markdown_table(records), summary(records), plot(records, Path(spec.out_dir)))

    run_rank(body)
