"""``syncwise bench``: step time, collectives and retained gradient bytes of each sync mode, side by side.

Every configuration (model x micro-batches x mode) gets its own engine; one round times one step of each,
in an order rotated every round, so machine drift hits all configurations alike. Ratios are taken against
``per_microbatch`` at the same model and micro-batch count, from the same run.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import load_config
from .distributed import DistInfo
from .engine import Engine
from .losses import sft_loss
from .models import build_model, count_parameters


@dataclass
class BenchSpec:
    presets: list[str] = field(default_factory=lambda: ["qwen2-tiny", "qwen2-20m"])
    microbatches: list[int] = field(default_factory=lambda: [2, 4, 8])
    modes: list[str] = field(default_factory=lambda: ["per_microbatch", "deferred", "deferred_unsharded"])
    strategy: str = "fsdp2"
    seq_len: int = 64
    warmup: int = 2
    repeats: int = 5
    out_dir: str = "runs/bench"

    @classmethod
    def quick(cls, out_dir: str = "runs/bench") -> BenchSpec:
        return cls(presets=["qwen2-tiny"], microbatches=[2, 8], warmup=1, repeats=3, out_dir=out_dir)


def _batch(num_samples: int, seq_len: int, vocab: int, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return {"input_ids": torch.randint(0, vocab, (num_samples, seq_len), generator=gen)}


def run_bench(info: DistInfo, spec: BenchSpec) -> list[dict[str, Any]]:
    """Run every configuration; returns one record per configuration (on every rank)."""
    records: list[dict[str, Any]] = []
    for preset in spec.presets:
        configs = []
        for n in spec.microbatches:
            for mode in spec.modes:
                cfg = load_config(
                    None,
                    [f"model.preset={preset}", f"engine.strategy={spec.strategy}", f"sync.mode={mode}",
                     "engine.micro_batch_size=1"],
                )
                model = build_model(cfg.model)
                params = count_parameters(model)
                engine = Engine(cfg, model, info)
                batch = _batch(n, spec.seq_len, engine.model.config.vocab_size, info.rank)
                configs.append({"preset": preset, "params": params, "microbatches": n, "mode": mode,
                                "engine": engine, "batch": batch, "times": [], "metrics": None})
        for round_index in range(spec.warmup + spec.repeats):
            shift = round_index % len(configs)
            for entry in configs[shift:] + configs[:shift]:
                torch.distributed.barrier()
                start = time.perf_counter()
                metrics = entry["engine"].train_batch(entry["batch"], sft_loss)
                elapsed = time.perf_counter() - start
                if round_index >= spec.warmup:
                    entry["times"].append(elapsed)
                entry["metrics"] = metrics
        for entry in configs:
            m = entry["metrics"]
            records.append({
                "preset": entry["preset"], "params": entry["params"], "microbatches": entry["microbatches"],
                "mode": entry["mode"], "strategy": spec.strategy, "world_size": info.world_size,
                "step_time_samples_s": entry["times"],
                "step_time_median_s": statistics.median(entry["times"]),
                "step_time_spread_s": max(entry["times"]) - min(entry["times"]),
                **{k: v for k, v in m.items() if k.startswith(("comm/", "memory/"))},
            })
            del entry["engine"]
    _add_ratios(records)
    return records


def _add_ratios(records: list[dict[str, Any]]) -> None:
    base = {
        (r["preset"], r["microbatches"]): r["step_time_median_s"] for r in records if r["mode"] == "per_microbatch"
    }
    for r in records:
        ref = base.get((r["preset"], r["microbatches"]))
        r["ratio_to_per_microbatch"] = r["step_time_median_s"] / ref if ref else None


def markdown_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| model | params | micro-batches | mode | step (median s) | spread s | vs per_microbatch "
        "| all-gathers | reduce-scatters | all-reduces | RS MiB | retained grad MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ratio = r["ratio_to_per_microbatch"]
        lines.append(
            f"| {r['preset']} | {r['params'] / 1e6:.1f}M | {r['microbatches']} | {r['mode']} "
            f"| {r['step_time_median_s']:.3f} | {r['step_time_spread_s']:.3f} "
            f"| {ratio:.2f} | {r['comm/all_gather_count']} | {r['comm/reduce_scatter_count']} "
            f"| {r['comm/all_reduce_count']} | {r['comm/reduce_scatter_bytes'] / 2**20:.1f} "
            f"| {r['memory/retained_grad_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


def bench_worker(spec_dict: dict[str, Any]) -> None:
    from .distributed import run_rank

    spec = BenchSpec(**spec_dict)

    def body(info: DistInfo) -> None:
        records = run_bench(info, spec)
        if info.is_main:
            out = Path(spec.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench.json").write_text(json.dumps({"spec": spec_dict, "records": records}, indent=1))
            table = markdown_table(records)
            (out / "bench.md").write_text(table + "\n")
            print(table, flush=True)
            print(f"written: {out / 'bench.json'}, {out / 'bench.md'}", flush=True)

    run_rank(body)
