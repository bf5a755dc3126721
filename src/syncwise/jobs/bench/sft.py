"""``syncwise bench --workload sft``: what the SFT data path costs. On the built-in ``arith_chat`` task (chat
rows through the tokenizer's template, the per-epoch order, the split over ranks, padding), each timed step
of ``syncwise sft`` -- the data path and ``Engine.train_batch`` -- runs beside ``Engine.train_batch`` alone on
the same pre-tokenised, pre-padded batch, on the same engine, one after the other (which goes first
alternates). The data path's share of a step is the difference of the medians over the whole step's median;
target <= 5%.
"""

from __future__ import annotations

import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...config import load_config
from ...data.sft_dataset import padded_batch, rank_share
from ...engine.wrap import DTYPE_BY_NAME
from ...losses import sft_loss
from ...runtime.distributed import DistInfo, run_rank
from ...runtime.signals import JobStopped
from ...sft.trainer import SFTTrainer
from .report import write_report
from .roofline import gemm_rate


@dataclass
class SFTBenchSpec:
    out_dir: str = "runs/bench_sft"
    steps: int = 12  # timed steps of each kind per round
    warmup: int = 3  # steps before the first round (auto measures on its first step)
    rounds: int = 3
    extra: list[str] = field(default_factory=list)  # config overrides (e.g. sft.batch_size=32)

    @classmethod
    def quick(cls, out_dir: str) -> SFTBenchSpec:
        return cls(out_dir=out_dir, steps=4, warmup=2, rounds=2)


def run_sft_bench(info: DistInfo, spec: SFTBenchSpec) -> dict[str, Any]:
    started = time.perf_counter()
    config = load_config(None, ["sft.task=arith_chat", f"sft.out_dir={Path(spec.out_dir) / 'job'}",
                                "sft.export=false", "sft.progress=false", *spec.extra])
    trainer = SFTTrainer(config, info)
    setup_s = time.perf_counter() - started
    sft, step = config.sft, 0
    for _ in range(spec.warmup):
        trainer.step(step)
        step += 1
    times: dict[str, list[float]] = {"syncwise sft step": [], "train_batch alone": []}
    data_s: list[float] = []  # the data path inside each syncwise sft step, timed on its own
    flops_per_s: dict[str, list[float]] = {kind: [] for kind in times}  # useful FLOPs (every rank) per second
    for round_ in range(spec.rounds):
        batches, position = [], trainer.position  # the batches the next steps will build, built beforehand
        for _ in range(spec.steps):
            samples, position = trainer.order.step(position, sft.batch_size, sft.batch_tokens, info.world_size)
            mine = rank_share(samples, trainer.data.lengths, info.rank, info.world_size)
            batches.append(padded_batch(trainer.data, mine, trainer.pad_id))
        for i, batch in enumerate(batches):  # side by side on the same batch, which goes first alternating
            for kind in sorted(times, reverse=bool(i % 2)):
                if kind == "syncwise sft step":
                    metrics = trainer.step(step)
                    step += 1
                    times[kind].append(metrics["time/step_s"])
                    data_s.append(metrics["time/data_s"])
                else:
                    began = time.perf_counter()
                    metrics = trainer.engine.train_batch(batch, sft_loss)
                    times[kind].append(time.perf_counter() - began)
                flops_per_s[kind].append(metrics["perf/useful_flops"] / times[kind][-1])
                _stop_if_asked(metrics, round_, spec)
    full, alone = (statistics.median(times[k]) for k in times)
    rate = gemm_rate(trainer.engine.features.hf_config, DTYPE_BY_NAME[config.model.param_dtype], info.device)
    return {"medians_s": {"syncwise sft step": full, "train_batch alone": alone}, "ratio": full / alone,
            "fraction_of_gemm_peak": {kind: statistics.median(values) / (rate * info.world_size)
                                      for kind, values in flops_per_s.items()}, "gemm_flops_per_s": rate,
            "data_path_share": (full - alone) / full, "data_s": statistics.median(data_s),
            "setup_s": setup_s, "rows": len(trainer.data),
            "batch_size": sft.batch_size, "world_size": info.world_size,
            "steps_per_kind": len(times["train_batch alone"])}


def _stop_if_asked(metrics: dict[str, Any], round_: int, spec: SFTBenchSpec) -> None:
    signum = int(metrics["stop/signal"])  # agreed by every rank in the step's last all-reduce
    if signum:
        raise JobStopped(signum, f"syncwise: bench stopped by {signal.Signals(signum).name} in round "
                                 f"{round_ + 1} of {spec.rounds}; no results written")


def format_result(result: dict[str, Any]) -> str:
    medians = result["medians_s"]
    return "\n".join([
        f"SFT data path on the arith_chat task: {result['world_size']} ranks, {result['batch_size']} sequences per "
        f"step, medians of {result['steps_per_kind']} steps of each kind",
        "",
        "| step | median s | of GEMM peak |",
        "|---|---|---|",
        *(f"| {name} | {value:.4f} | {result['fraction_of_gemm_peak'][name]:.1%} |" for name, value in medians.items()),
        "",
        f"syncwise sft / train_batch alone: {result['ratio']:.3f}; the data path's share of a step: "
        f"{100 * result['data_path_share']:.1f}% from the medians (target <= 5%), "
        f"{1e3 * result['data_s']:.2f} ms = {100 * result['data_s'] / medians['syncwise sft step']:.2f}% timed "
        f"inside the step (order, split over ranks, padding); set-up (task data, tokenisation, engine) "
        f"{result['setup_s']:.1f} s once; of GEMM peak: useful FLOPs per second over "
        f"{result['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s per rank (torch.mm at the model's shapes, this run)",
    ])


def run(args) -> int:
    """``syncwise bench --workload sft``: syncwise sft's steps beside train_batch alone, on launched ranks."""
    from ...runtime.launcher import launch
    from . import out_dir

    out = out_dir(args, "bench_sft")
    spec = SFTBenchSpec.quick(out) if args.quick else SFTBenchSpec(out_dir=out)
    if args.repeats is not None:
        spec.rounds = args.repeats
    return launch(bench_sft_worker, args.nproc, asdict(spec))


def bench_sft_worker(spec_dict: dict[str, Any]) -> None:
    spec = SFTBenchSpec(**spec_dict)

    def body(info: DistInfo) -> None:
        result = run_sft_bench(info, spec)
        if info.is_main:
            write_report(spec.out_dir, "bench_sft", spec, {"result": result}, format_result(result))

    run_rank(body)
