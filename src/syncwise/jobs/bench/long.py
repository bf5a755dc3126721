"""``syncwise bench --workload long``: SFT steps on long sequences with ``dist.sequence_parallel`` N = 1, 2 (and 4
where there are 4 ranks) side by side in one run, on one engine configuration but N: each rank's measured peak (the
step's own ``memory/peak_bytes``) beside the memory model's prediction, tokens/s, the all-to-alls' share of the step
(the time spent inside ``all_to_all_single``, waiting included), and the longest sequence the memory model says fits
a budget at each N (default: what N = 1 needed for ``--seq-len``). N = 1 is the baseline every ratio is over.

The model is a Qwen2 built from its config (4 query heads, 2 key/value heads, positions for the length), each rank
one sequence of ``--seq-len`` random tokens a step; sync mode per_microbatch throughout, so that only N differs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...config import load_config
from ...engine import Engine
from ...losses import sft_loss
from ...memory.accounting import format_bytes
from ...memory.sequence_split import split_options
from ...runtime.distributed import DistInfo, run_rank
from .report import write_report

SHAPE = dict(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


@dataclass
class LongBenchSpec:
    out_dir: str = "runs/bench_long"
    seq_len: int = 16384
    steps: int = 3  # timed steps per N, after the metered first
    budget_bytes: int = 0  # the budget the longest fitting length is found for (0: N = 1's measured peak)
    sizes: list[int] = field(default_factory=list)  # default: 1, 2 and 4 where the world allows

    @classmethod
    def quick(cls, out_dir: str) -> LongBenchSpec:
        return cls(out_dir=out_dir, seq_len=2048, steps=1)


class _AllToAllTimer:
    """Seconds spent inside ``dist.all_to_all_single`` while installed (the call blocks until every rank's part is
    there, so waiting counts: what a step loses to the exchanges)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = None

    def __enter__(self) -> _AllToAllTimer:
        self._original = original = dist.all_to_all_single

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began

        dist.all_to_all_single = timed
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._original


def _shape(positions: int = 512):
    from transformers import AutoConfig

    return AutoConfig.for_model(**SHAPE, max_position_embeddings=positions)


def _model(seq_len: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_shape(seq_len))


def _one_size(info: DistInfo, spec: LongBenchSpec, size: int) -> dict[str, Any]:
    config = load_config(None, ["model.preset=qwen2-test", "engine.strategy=fsdp2", "sync.mode=per_microbatch",
                                f"dist.sequence_parallel={size}", "engine.micro_batch_size=1",
                                "engine.max_tokens_per_micro_batch=0", "engine.fused_lm_head=true", "optim.name=adamw",
                                "optim.lr=1e-4"])
    engine = Engine(config, _model(spec.seq_len), info)
    gen = torch.Generator().manual_seed(info.rank)
    batch = {"input_ids": torch.randint(1, SHAPE["vocab_size"], (1, spec.seq_len), generator=gen)}
    first = engine.train_batch(batch, sft_loss)  # metered: the job's own peak (CPU: slowed, not timed)
    times, exchanges = [], []
    for _ in range(spec.steps):
        with _AllToAllTimer() as timer:
            began = time.perf_counter()
            engine.train_batch(batch, sft_loss)
            times.append(time.perf_counter() - began)
        exchanges.append(timer.seconds)
    step_s = statistics.median(times)
    return {"size": size, "peak_bytes": first["memory/peak_bytes"], "step_s": step_s,
            "tokens_per_s": info.world_size * spec.seq_len / step_s,
            "all_to_all_share": statistics.median(exchanges) / step_s,
            "all_to_all_bytes": first.get("comm/all_to_all_bytes", 0), "loss": first["loss"]}


def _longest_fitting(world: int, budget: int, sizes: list[int]) -> dict[int, int]:
    """Per N, the longest sequence (a multiple of 256) the memory model predicts fits ``budget`` per rank."""
    config = _shape()
    longest = {}
    for size in sizes:
        low, high = 0, 1 << 22
        while high - low > 256:
            middle = (low + high) // 2 // 256 * 256
            option = next(o for o in split_options(config, world, max(middle, 1), param_dtype="float32",
                                                   reduce_dtype="float32") if o.size == size)
            low, high = (middle, high) if option.peak_bytes <= budget else (low, middle)
        longest[size] = low
    return longest


def run_long_bench(info: DistInfo, spec: LongBenchSpec) -> dict[str, Any]:
    sizes = spec.sizes or [n for n in (1, 2, 4) if info.world_size % n == 0]
    rows = [_one_size(info, spec, size) for size in sizes]
    budget = spec.budget_bytes or rows[0]["peak_bytes"]
    fits = _longest_fitting(info.world_size, budget, sizes)
    predicted = {o.size: o.peak_bytes for o in split_options(_shape(), info.world_size, spec.seq_len,
                                                             param_dtype="float32", reduce_dtype="float32")}
    for row in rows:
        row["predicted_peak_bytes"], row["longest_fitting"] = predicted.get(row["size"]), fits[row["size"]]
    return {"rows": rows, "budget_bytes": budget, "world_size": info.world_size, "seq_len": spec.seq_len,
            "device": info.device.type}


def format_result(result: dict[str, Any]) -> str:
    base = result["rows"][0]
    lines = [f"SFT steps on one {result['seq_len']}-token sequence per rank, {result['world_size']} ranks "
             f"({result['device']}), per_microbatch; N = 1 is the baseline", "",
             "| N | peak per rank (measured) | predicted | peak vs N=1 | step s | tokens/s | vs N=1 "
             f"| all-to-all share | longest fitting {format_bytes(result['budget_bytes'])} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        predicted = format_bytes(row["predicted_peak_bytes"] or 0)
        lines.append(f"| {row['size']} | {format_bytes(row['peak_bytes'])} | {predicted} | "
                     f"{row['peak_bytes'] / base['peak_bytes']:.2f}x "
                     f"| {row['step_s']:.3f} | {row['tokens_per_s']:.0f} | "
                     f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x | {row['all_to_all_share']:.1%} | "
                     f"{row['longest_fitting']} tokens |")
    return "\n".join(lines)


def run(args) -> int:
    """``syncwise bench --workload long``: N = 1, 2 (4) side by side on launched ranks."""
    from ...runtime.launcher import launch
    from . import out_dir

    out = out_dir(args, "bench_long")
    spec = LongBenchSpec.quick(out) if args.quick else LongBenchSpec(out_dir=out)
    if args.seq_len:
        spec.seq_len = args.seq_len
    if args.repeats is not None:
        spec.steps = args.repeats
    return launch(bench_long_worker, args.nproc, asdict(spec))


def bench_long_worker(spec_dict: dict[str, Any]) -> None:
    spec = LongBenchSpec(**spec_dict)

    def body(info: DistInfo) -> None:
        result = run_long_bench(info, spec)
        if info.is_main:
            write_report(spec.out_dir, "bench_long", spec, {"result": result}, format_result(result))

    run_rank(body)
