"""``syncwise bench --workload load``: what each rank holds and how long it takes to load ``model.path``.

A ``save_pretrained`` directory of a real shape with random weights (default the Qwen2.5-0.5B shape, fp32: ~2 GB) is
written once; then, side by side in one run, each way of loading it on each world size is a job of its own on fresh
local ranks (interleaved: whole, meta; whole, meta; ...): **whole** -- every rank builds the whole model on its CPU
(``from_pretrained``, cast to the fp32 master weights) and FSDP2 shards it, as before -- and **meta** -- every rank
builds the model on the meta device and reads only its own shards (:mod:`syncwise.models.loading`). The file is
bf16, as such models ship. Per rank: the seconds from the build to the last shard filled, and the peak anonymous
resident memory over that span (:class:`~syncwise.models.loading.HostMemory`: the file's mmap'd pages are page
cache, shared by the ranks), absolute and above what the process held before it (the interpreter and torch); the
target is the fp32 model's bytes / W plus its largest FSDP unit plus 10%.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...runtime.launcher import launch_local
from .report import write_report

WAYS = ("whole", "meta")


@dataclass
class LoadBenchSpec:
    out_dir: str = "runs/bench_load"
    preset: str = "qwen2.5-0.5b"
    world_sizes: list[int] = field(default_factory=lambda: [2, 4])
    rounds: int = 1

    @classmethod
    def quick(cls, out_dir: str) -> LoadBenchSpec:
        return cls(out_dir=out_dir, preset="qwen2-20m", world_sizes=[2])


def run(args) -> int:
    from . import out_dir

    out = out_dir(args, "bench_load")
    spec = LoadBenchSpec.quick(out) if args.quick else LoadBenchSpec(out_dir=out)
    if args.presets:
        spec.preset = args.presets[0]
    if args.repeats is not None:
        spec.rounds = args.repeats
    return bench_load(spec)


def bench_load(spec: LoadBenchSpec) -> int:
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    facts = _write_model(spec.preset, model_dir)
    _write_model("qwen2-test", out / "warm_up")  # loaded first, each way: its imports and allocations not measured
    results: dict[str, dict[str, Any]] = {}
    for _ in range(spec.rounds):
        for world in spec.world_sizes:
            for way in WAYS:
                report = out / f"{way}_{world}.json"
                report.unlink(missing_ok=True)
                job = launch_local(load_worker, world, str(model_dir), way, str(report))
                if job.exit_code != 0:
                    return job.exit_code
                ranks = json.loads(report.read_text())
                row = results.setdefault(f"{way}, {world} ranks", {"way": way, "world": world, "runs": []})
                row["runs"].append(ranks)
    for row in results.values():
        runs = row.pop("runs")
        row["seconds"] = statistics.median(max(r["seconds"] for r in ranks) for ranks in runs)
        row["peak_bytes"] = max(r["peak"] for ranks in runs for r in ranks)
        row["load_peak_bytes"] = max(r["peak"] - r["before"] for ranks in runs for r in ranks)
        row["target_bytes"] = int((facts["bytes"] / row["world"] + facts["largest_unit_bytes"]) * 1.10)
    write_report(out, "bench_load", spec, {"model": facts, "results": results}, _table(spec, facts, results),
                 _lines(results))
    return 0


def _write_model(preset: str, folder: Path) -> dict[str, Any]:
    """The preset's shape, random weights, saved in bf16 as such models ship (once: kept between runs); the
    job trains fp32 master weights (``bytes``)."""
    import torch

    from ...config import load_config
    from ...models import build_model, count_parameters

    model = build_model(load_config(None, [f"model.preset={preset}"]).model)
    units = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    root = count_parameters(model) - sum(units)
    if not (folder / "config.json").is_file():
        model.to(torch.bfloat16).save_pretrained(folder)
    nbytes = count_parameters(model) * torch.float32.itemsize
    return {"preset": preset, "params": count_parameters(model), "bytes": nbytes,
            "largest_unit_bytes": max([root, *units]) * torch.float32.itemsize}


def load_worker(model_dir: str, way: str, report: str) -> None:
    """On every rank: the engine built from ``model_dir`` one way; rank 0 writes every rank's figures."""
    from ...runtime.distributed import run_rank

    def body(info) -> None:
        import torch.distributed as dist

        from ...config import load_config
        from ...engine import Engine
        from ...models import build_model
        from ...models.loading import HostMemory

        def config(path: str):
            return load_config(None, [f"model.path={path}", "engine.strategy=fsdp2", "sync.mode=per_microbatch"])

        warm = config(str(Path(model_dir).parent / "warm_up"))
        Engine(warm, build_model(warm.model, deferred=way == "meta"), info)  # the imports, the allocator's pools
        cfg = config(model_dir)
        dist.barrier()
        host = HostMemory().start()
        started = time.perf_counter()
        Engine(cfg, build_model(cfg.model, deferred=way == "meta"), info)
        seconds = time.perf_counter() - started
        mine = {"seconds": seconds, "peak": host.stop() or 0, "before": host.before or 0}
        everyone: list = [None] * info.world_size
        dist.all_gather_object(everyone, mine)
        if info.is_main:
            Path(report).write_text(json.dumps(everyone))

    run_rank(body)


def _table(spec: LoadBenchSpec, facts: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    gib = 2**30
    lines = [f"Loading model.path: {facts['preset']} shape, {facts['params'] / 1e6:.0f}M parameters, "
             f"{facts['bytes'] / gib:.2f} GiB in fp32 (largest FSDP unit {facts['largest_unit_bytes'] / gib:.2f} GiB), "
             f"a bf16 file, FSDP2; each rank's peak anonymous resident memory from the build to the last shard filled "
             f"(median seconds of {spec.rounds} round(s), the slowest rank)", "",
             "| way | ranks | seconds | peak per rank GiB | above the process's own GiB | target GiB |",
             "|---|---|---|---|---|---|"]
    for row in results.values():
        lines.append(f"| {row['way']} | {row['world']} | {row['seconds']:.1f} | {row['peak_bytes'] / gib:.2f} | "
                     f"{row['load_peak_bytes'] / gib:.2f} | {row['target_bytes'] / gib:.2f} |")
    return "\n".join(lines)


def _lines(results: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for world in sorted({r["world"] for r in results.values()}):
        whole, meta = results.get(f"whole, {world} ranks"), results.get(f"meta, {world} ranks")
        if whole and meta:
            peak = meta["load_peak_bytes"] / whole["load_peak_bytes"]
            out.append(f"{world} ranks: meta / whole load peak per rank {peak:.2f}, seconds "
                       f"{meta['seconds'] / whole['seconds']:.2f}; meta within its target: "
                       f"{meta['load_peak_bytes'] <= meta['target_bytes']}")
    return out

