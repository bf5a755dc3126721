"""``syncwise bench --workload gpu``: the one command for a machine with a GPU, run as it is (the torch it has, nothing
else installed), in at most about 8 minutes on one H200. It writes the GPU table of docs/benchmarks.md.

1. **The CUDA tests** (``tests/test_cuda.py`` of a checkout: NCCL, the allocator's peak, CPU offload, the packed
   rows through the variable-length kernel against padding), their pass / fail counts and seconds.
2. **The engine on models of real shapes** (``qwen2.5-0.5b`` and ``qwen2.5-1.5b``: random weights; bf16 compute,
   fp32 master weights and reduction), one rank per GPU, on a long-tailed batch (log-normal lengths, median 512,
   up to 4,096 tokens), each configuration after the other on the same model and batch: the defaults (auto), fixed
   16,384-token caps with the fused head and with the logits materialised, the fused head with activation
   checkpointing, padded rows, and a hand-written packed FSDP2 loop at the same cap. Per row: seconds a step
   (median after the warm-up), real tokens per second, useful TFLOP/s, the fraction of the GEMM rate measured in
   the same run (bf16 8192^3) and of the GPU's nominal dense bf16 peak (what peers quote MFU against), the
   allocator's peak, auto's predicted peak over it for the step after its decision, and how long building and
   wrapping the model took.
3. **GRPO steps** (``bench --workload grpo`` on the repeat task, qwen2-30m, fp32): the compact sampler against
   Hugging Face ``generate``, synchronous, with partial rollouts and with a lag of 1.

``--quick`` runs every part at a small size (the 0.5B shape's defaults and one fixed cap; two GRPO jobs); on a
machine without CUDA it is the CPU check of everything but CUDA itself (tiny model, gloo, fp32), which the tests run.
"""

from __future__ import annotations

import copy
import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...config import load_config
from ...engine import Engine
from ...memory.calibrate import best_matmul_seconds
from ...models import build_model, count_parameters, preset_config
from ...models.flops import UsefulFlops
from ...runtime.distributed import DistInfo, run_rank
from ...runtime.launcher import launch_local
from .grpo import GRPOBenchSpec, bench_grpo
from .report import fmt, machine, write_report
from .rl import HandWrittenPackedLoop, batch_of

CAP = 16384
FUSED, MATERIALISED = "engine.fused_lm_head=true", "engine.fused_lm_head=false"
FIXED_CAP = (f"engine.max_tokens_per_micro_batch={CAP}", "sync.mode=deferred")
DEFAULTS = "defaults (sync mode, LM head and token cap auto)"
HAND_WRITTEN = f"hand-written packed FSDP2 loop, {CAP}-token cap, deferred"
# name -> overrides (beside the common ones: the preset and the compute dtype)
GPU_CONFIGS: dict[str, tuple[str, ...]] = {
    DEFAULTS: (),
    f"fused head, {CAP}-token cap, deferred": (*FIXED_CAP, FUSED),
    f"logits materialised, {CAP}-token cap, deferred": (*FIXED_CAP, MATERIALISED),
    f"fused head, {CAP}-token cap, deferred, activation checkpointing": (
        *FIXED_CAP, FUSED, "engine.activation_checkpointing=true"),
    "padded, 4 per micro-batch, fused head, deferred": (
        "engine.packing=false", "engine.micro_batch_size=4", "sync.mode=deferred", FUSED),
    HAND_WRITTEN: (),
}
# The GPU's nominal dense bf16 rate (no sparsity), by a part of its name: what peers quote MFU against.
NOMINAL_BF16 = (("H200", 989.4e12), ("H100 PCIe", 756e12), ("H100", 989.4e12), ("B200", 2250e12),
                ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12))
GRPO_ROWS = ("generate, unbalanced (before)", "compact sampler, balanced", "compact, balanced, partial rollouts",
             "compact, balanced, lag 1")


@dataclass
class GpuBenchSpec:
    out_dir: str = "runs/bench_gpu"
    presets: list[str] = field(default_factory=lambda: ["qwen2.5-0.5b", "qwen2.5-1.5b"])
    configs: dict[str, list[str]] = field(default_factory=lambda: {
        "qwen2.5-0.5b": list(GPU_CONFIGS), "qwen2.5-1.5b": [DEFAULTS, HAND_WRITTEN]})
    sequences: int = 64  # per rank
    median_len: int = 512
    sigma: float = 1.2
    shortest: int = 32
    longest: int = 4096
    dtype: str = "bfloat16"  # compute (the weights, their optimizer state and the reduction fp32)
    cap: int = CAP
    warmup: int = 2
    repeats: int = 4
    gemm_size: int = 8192
    nproc: int = 1
    grpo_preset: str = "qwen2-30m"
    grpo_configs: list[str] = field(default_factory=lambda: list(GRPO_ROWS))
    grpo_steps: int = 8
    grpo_warmup: int = 2
    grpo_warm_start: int = 30
    cuda_tests: bool = True

    @classmethod
    def quick(cls, out_dir: str) -> GpuBenchSpec:
        return cls(out_dir=out_dir, presets=["qwen2.5-0.5b"],
                   configs={"qwen2.5-0.5b": [DEFAULTS, f"fused head, {CAP}-token cap, deferred", HAND_WRITTEN]},
                   repeats=2, grpo_configs=["generate, unbalanced (before)", "compact sampler, balanced"],
                   grpo_steps=4, grpo_warmup=1, grpo_warm_start=5)

    @classmethod
    def cpu_check(cls, out_dir: str) -> GpuBenchSpec:
        """Every part but CUDA itself, small enough for the test suite: the tiny model, fp32, a cap of 256."""
        return cls(out_dir=out_dir, presets=["qwen2-tiny"], configs={"qwen2-tiny": list(GPU_CONFIGS)}, sequences=6,
                   median_len=48, sigma=1.0, shortest=8, longest=200, dtype="float32", cap=256, warmup=2,
                   repeats=1, gemm_size=256, grpo_configs=["compact sampler, balanced"], grpo_steps=2,
                   grpo_warmup=1, grpo_warm_start=2, cuda_tests=False)


def run(args) -> int:
    """``syncwise bench --workload gpu``: one rank per GPU; without CUDA only ``--quick`` (the CPU check)."""
    from . import out_dir

    out = out_dir(args, "bench_gpu")
    if not torch.cuda.is_available():
        if not args.quick:
            print("syncwise: error: bench --workload gpu needs a CUDA device (torch.cuda.is_available() is False); "
                  "--quick runs its parts on this CPU at a small size", file=sys.stderr)
            return 2
        spec = GpuBenchSpec.cpu_check(out)
    else:
        spec = GpuBenchSpec.quick(out) if args.quick else GpuBenchSpec(out_dir=out)
        spec.nproc = torch.cuda.device_count()
    return bench_gpu(spec)


def bench_gpu(spec: GpuBenchSpec) -> int:
    """The three parts, each timed; the report. Exit status: the first part that failed (the others still run)."""
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    status = 0
    started = time.perf_counter()
    tests = _cuda_tests(out) if spec.cuda_tests else {"skipped": "no CUDA device: the CPU check"}
    seconds["cuda tests"] = time.perf_counter() - started
    if tests.get("exit", 0):
        status = tests["exit"]
    started = time.perf_counter()
    engine = out / "engine.json"
    engine.unlink(missing_ok=True)
    result = launch_local(engine_worker, spec.nproc, asdict(spec))
    seconds["engine rows"] = time.perf_counter() - started
    status = status or result.exit_code
    data = json.loads(engine.read_text()) if engine.is_file() else {"records": [], "machine": {}}
    started = time.perf_counter()
    grpo = GRPOBenchSpec(out_dir=str(out / "grpo"), nproc=spec.nproc, steps=spec.grpo_steps, warmup=spec.grpo_warmup,
                         rounds=1, warm_start_steps=spec.grpo_warm_start, configs=list(spec.grpo_configs),
                         extra=[f"model.preset={spec.grpo_preset}"])
    status = status or bench_grpo(grpo)
    seconds["grpo"] = time.perf_counter() - started
    grpo_file = out / "grpo" / "bench_grpo.json"
    grpo_results = json.loads(grpo_file.read_text())["results"] if grpo_file.is_file() else {}
    results = {"machine": data["machine"], "cuda_tests": tests, "records": data["records"], "grpo": grpo_results,
               "seconds": seconds}
    write_report(out, "bench_gpu", spec, results, gpu_table(results), summary(results))
    return status


def _cuda_tests(out: Path) -> dict[str, Any]:
    """``pytest tests/test_cuda.py`` of this checkout (none where syncwise was installed from a wheel)."""
    tests = Path(__file__).resolve().parents[4] / "tests" / "test_cuda.py"
    if not tests.is_file():
        return {"skipped": f"{tests} not found (not a checkout)"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                          capture_output=True, text=True, cwd=tests.parents[1], timeout=600)
    (out / "cuda_tests.txt").write_text(proc.stdout + proc.stderr)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"exit": proc.returncode, "summary": last, "seconds": time.perf_counter() - started}


def long_tailed(count: int, rank: int, median: int, sigma: float, shortest: int, longest: int) -> torch.Tensor:
    """``count`` log-normal lengths (fixed seed per rank), clamped to [shortest, longest]."""
    gen = torch.Generator().manual_seed(20_000 + rank)
    draws = torch.exp(torch.log(torch.tensor(float(median))) + sigma * torch.randn(count, generator=gen))
    return draws.round().clamp(shortest, longest).long()


def engine_worker(spec_dict: dict[str, Any]) -> None:
    spec = GpuBenchSpec(**spec_dict)

    def body(info: DistInfo) -> None:
        records = [record for preset in spec.presets for record in _preset_rows(info, spec, preset)]
        if info.is_main:
            Path(spec.out_dir, "engine.json").write_text(json.dumps({"machine": machine(info), "records": records}))

    run_rank(body)


def _preset_rows(info: DistInfo, spec: GpuBenchSpec, preset: str) -> list[dict[str, Any]]:
    """Every configuration of ``preset`` after the other, on one model built once (each configuration wraps a
    copy) and one batch; the GEMM rate measured after them."""
    common = [f"model.preset={preset}", "engine.strategy=fsdp2", f"model.param_dtype={spec.dtype}",
              "model.reduce_dtype=float32"]
    hf_config = preset_config(preset)
    started = time.perf_counter()
    base = build_model(load_config(None, common).model)
    build_s = time.perf_counter() - started
    params = count_parameters(base)
    lengths = long_tailed(spec.sequences, info.rank, spec.median_len, spec.sigma, spec.shortest, spec.longest)
    batch = batch_of(lengths, int(hf_config.vocab_size), info.rank)
    totals = torch.tensor([float(lengths.sum()), UsefulFlops.of(base, hf_config).of_lengths(lengths.tolist())],
                          dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)  # over every rank's own sequences
    real_tokens, flops = float(totals[0]), float(totals[1])
    rows = []
    for name in spec.configs[preset]:
        rows.append({"preset": preset, "params": params, "config": name, "real_tokens_per_step": real_tokens,
                     "useful_flops_per_step": flops, "model_build_s": build_s,
                     **_time_config(info, spec, preset, name, base, batch, common)})
        gc.collect()
        if info.device.type == "cuda":
            torch.cuda.empty_cache()
    rate = _gemm_rate(info, spec)
    nominal = _nominal_rate(info)
    for row in rows:
        per_s = flops / row["step_s"]
        row |= {"real_tokens_per_s": real_tokens / row["step_s"], "useful_flops_per_s": per_s,
                "gemm_flops_per_s": rate, "fraction_of_gemm": per_s / (rate * info.world_size),
                "nominal_flops_per_s": nominal,
                "fraction_of_nominal": per_s / (nominal * info.world_size) if nominal else None}
    return rows


def _time_config(info: DistInfo, spec: GpuBenchSpec, preset: str, name: str, base: torch.nn.Module,
                 batch: dict[str, torch.Tensor], common: list[str]) -> dict[str, Any]:
    """``warmup`` + ``repeats`` steps of one configuration: the median step, the allocator's peak, auto's
    prediction for the step after its decision, what building the engine took."""
    from ...losses import sft_loss

    started = time.perf_counter()
    if name == HAND_WRITTEN:
        runner = HandWrittenPackedLoop(preset, "deferred", spec.cap, info, model=copy.deepcopy(base),
                                       param_dtype=getattr(torch, spec.dtype))
    else:
        overrides = [o.replace(f"={CAP}", f"={spec.cap}") for o in GPU_CONFIGS[name]]
        cfg = load_config(None, [*common, *overrides])
        runner = Engine(cfg, copy.deepcopy(base), info)
    wrap_s = time.perf_counter() - started
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    times, steps = [], []
    for _ in range(spec.warmup + spec.repeats):
        _synchronize(info)
        started = time.perf_counter()
        metrics = runner.step(batch) if isinstance(runner, HandWrittenPackedLoop) else runner.train_batch(batch,
                                                                                                           sft_loss)
        _synchronize(info)
        times.append(time.perf_counter() - started)
        steps.append(metrics or {})
    timed = times[spec.warmup:]
    decided = steps[1] if len(steps) > 1 else {}
    predicted = decided.get("memory/predicted_peak_bytes")
    peak = (torch.cuda.max_memory_allocated(info.device) if info.device.type == "cuda"
            else max((s.get("memory/peak_bytes") or 0 for s in steps), default=0) or None)
    last = steps[-1]
    return {
        "step_s": statistics.median(timed), "step_samples_s": timed, "wrap_s": wrap_s, "peak_bytes": peak,
        "predicted_over_measured": (predicted / decided["memory/peak_bytes"]
                                    if predicted and decided.get("memory/peak_bytes") else None),
        "sync_mode": last.get("sync/mode", "deferred"), "microbatches": last.get("train/num_microbatches"),
        "fused_head": last.get("engine/fused_lm_head"), "cap": last.get("engine/max_tokens_per_micro_batch"),
        "decision": steps[0].get("sync/decision", ""),
    }


def _synchronize(info: DistInfo) -> None:
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)


def _gemm_rate(info: DistInfo, spec: GpuBenchSpec) -> float:
    """FLOP/s of a square matmul of ``gemm_size`` in the compute dtype on this rank, the best of 5."""
    size = spec.gemm_size
    dtype = getattr(torch, spec.dtype)
    a = torch.randn(size, size, dtype=dtype, device=info.device)
    b = torch.randn(size, size, dtype=dtype, device=info.device)
    return 2.0 * size**3 / best_matmul_seconds(a, b, 6)


def _nominal_rate(info: DistInfo) -> float | None:
    """The GPU's nominal dense bf16 rate (None for a CPU or a GPU not in :data:`NOMINAL_BF16`)."""
    if info.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(info.device)
    return next((rate for part, rate in NOMINAL_BF16 if part in name), None)


def gpu_table(results: dict[str, Any]) -> str:
    """The report: where it ran, the CUDA tests, the engine rows, the GRPO rows."""
    where = results["machine"]
    tests = results["cuda_tests"]
    lines = [f"Device: {where.get('cuda') or where.get('device', '?')}, {where.get('world_size', '?')} rank(s), torch "
             f"{where.get('torch', torch.__version__)}; CUDA tests: "
             + (tests["summary"] if "summary" in tests else tests.get("skipped", "")), ""]
    records = results["records"]
    if records:
        lines += [
            "| model | configuration | s / step | real tok/s | useful TFLOP/s | of GEMM rate | of nominal peak | "
            "peak GiB | predicted / peak | mode, micro-batches, head, cap | build + wrap s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in records:
            head = {1.0: "fused", 0.0: "materialised"}.get(r["fused_head"], "")
            parts = (r["sync_mode"], r["microbatches"], head, r["cap"])
            setting = ", ".join(str(x) for x in parts if x not in (None, ""))
            nominal = f"{r['fraction_of_nominal']:.1%}" if r["fraction_of_nominal"] else "--"
            peak = fmt(r["peak_bytes"] / 2**30 if r["peak_bytes"] else None, 2, "--")
            lines.append(
                f"| {r['preset']} | {r['config']} | {r['step_s']:.3f} | {r['real_tokens_per_s']:.0f} | "
                f"{r['useful_flops_per_s'] / 1e12:.2f} | {r['fraction_of_gemm']:.1%} | {nominal} | {peak} | "
                f"{fmt(r['predicted_over_measured'], 3, '--')} | {setting} | {r['model_build_s']:.1f} + "
                f"{r['wrap_s']:.1f} |")
        rate = records[0]["gemm_flops_per_s"]
        lines += ["", f"GEMM rate measured in this run: {rate / 1e12:.1f} TFLOP/s (square matmul); nominal dense peak "
                      + (f"{records[0]['nominal_flops_per_s'] / 1e12:.1f} TFLOP/s" if records[0]["nominal_flops_per_s"]
                         else "unknown for this device")]
    grpo = results["grpo"]
    if grpo:
        reference = next(iter(grpo))
        lines += ["", f"GRPO steps (repeat task; end-to-end tokens/s over {reference!r}'s):", "",
                  "| configuration | end-to-end tok/s | speed-up | s / step | rollout s | decode fill |",
                  "|---|---|---|---|---|---|"]
        for name, r in grpo.items():
            lines.append(f"| {name} | {r['end_to_end_tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['step_s']:.3f} | "
                         f"{r['phases_s']['rollout']:.3f} | {r['decode_fill']:.2f} |")
    lines += ["", "Seconds per part: " + ", ".join(f"{k} {v:.0f}" for k, v in results["seconds"].items())]
    return "\n".join(lines)


def summary(results: dict[str, Any]) -> list[str]:
    """One line per finding: the engine against the hand-written loop, auto's prediction."""
    lines = []
    by_preset: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results["records"]:
        by_preset.setdefault(r["preset"], {})[r["config"]] = r
    for preset, rows in by_preset.items():
        if DEFAULTS in rows and HAND_WRITTEN in rows:
            ratio = rows[DEFAULTS]["real_tokens_per_s"] / rows[HAND_WRITTEN]["real_tokens_per_s"]
            lines.append(f"{preset}: the defaults' real tokens/s over the hand-written loop's: {ratio:.3f}")
        if DEFAULTS in rows and rows[DEFAULTS]["predicted_over_measured"]:
            lines.append(f"{preset}: auto's predicted / measured peak for the step after its decision: "
                         f"{rows[DEFAULTS]['predicted_over_measured']:.3f} (target [1.00, 1.10])")
    return lines
