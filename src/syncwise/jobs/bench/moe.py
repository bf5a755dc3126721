"""``syncwise bench --workload moe``: a tiny mixture of experts through whole GRPO jobs, beside a dense model of the
same active size, side by side in one run (rounds interleaved: A B C, A B C).

Three rows, each a real ``syncwise train`` job on the built-in task from a model saved with ``save_pretrained``
(written by the bench, with the arith chat tokenizer): a Qwen3-MoE (8 experts a layer, 2 a token) with router
replay, the same without it (``rl.router_replay=false``), and a dense Qwen3 whose MLP is the width of the two
experts a token goes through (its active parameters the MoE's, to within the router). A bfloat16 sampler beside
fp32 training, so that the sampler routes some tokens elsewhere: what replay is for. Per row, medians over the
steps after the first (its first step is metered and warms up): response tokens per second end to end, the step
time, each rank's peak (``memory/peak_bytes``; every step on a GPU, the first on a CPU), ``moe/route_agreement``
and the sampler-trainer gap ``rollout/log_prob_diff`` (mean and max). The dense row is the baseline of the ratios.
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import config_to_dict, load_config
from ...metrics import read_jsonl
from ...rl.job import train_worker
from ...runtime.launcher import launch_local
from .report import fmt, write_report

ROWS: dict[str, tuple[str, tuple[str, ...]]] = {  # name -> (model folder, keys); the first is the baseline
    "dense, same active size": ("dense", ()),
    "MoE, router replay": ("moe", ("rl.router_replay=true",)),
    "MoE, no replay": ("moe", ("rl.router_replay=false",)),
}
HIDDEN, LAYERS, HEADS, EXPERT_WIDTH, EXPERTS, TOP_K = 64, 2, 4, 32, 8, 2


@dataclass
class MoEBenchSpec:
    out_dir: str = "runs/bench_moe"
    steps: int = 8  # per job (the first left out of the medians)
    rounds: int = 2
    nproc: int = 2
    prompts_per_rank: int = 4
    samples_per_prompt: int = 8
    max_new_tokens: int = 16

    @classmethod
    def quick(cls, out_dir: str) -> MoEBenchSpec:
        return cls(out_dir=out_dir, steps=3, rounds=1, prompts_per_rank=2, samples_per_prompt=4, max_new_tokens=8)


def write_models(folder: Path) -> dict[str, Path]:
    """The MoE and its dense counterpart, ``save_pretrained`` with the arith chat tokenizer: the same attention,
    embeddings and layers; the dense MLP as wide as a token's experts together."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from ...sft.tasks import arith_chat_rows, chat_tokenizer

    tokenizer = chat_tokenizer(arith_chat_rows(300, seed=1))
    common = dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=HEADS // 2, head_dim=HIDDEN // HEADS, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    models = {
        "moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=EXPERT_WIDTH * TOP_K,
                                                  moe_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS,
                                                  num_experts_per_tok=TOP_K, norm_topk_prob=True,
                                                  router_aux_loss_coef=0.001)),
        "dense": Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=EXPERT_WIDTH * TOP_K)),
    }
    paths = {}
    for name, model in models.items():
        paths[name] = folder / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def _job(spec: MoEBenchSpec, model: Path, keys: tuple[str, ...], out: Path) -> dict[str, Any]:
    return config_to_dict(load_config(None, [
        f"model.path={model}", f"train.steps={spec.steps}", "train.progress=false", "train.export=false",
        "train.checkpoint_every=0", f"train.out_dir={out}", f"dist.nproc={spec.nproc}",
        f"rl.prompts_per_rank={spec.prompts_per_rank}", f"rl.samples_per_prompt={spec.samples_per_prompt}",
        f"rl.max_new_tokens={spec.max_new_tokens}", "rl.rollout_dtype=bfloat16", *keys]))


def _summary(rows: list[dict[str, Any]], first_peaks: list[float]) -> dict[str, Any]:
    def median(key: str) -> float | None:
        values = [row[key] for row in rows if key in row]
        return statistics.median(values) if values else None

    tokens_per_s = [row["rollout/response_tokens"] / row["time/step_s"] for row in rows]
    return {"tokens_per_s": statistics.median(tokens_per_s), "step_s": median("time/step_s"),
            "peak_bytes": max(first_peaks), "route_agreement": median("moe/route_agreement"),
            "log_prob_diff": median("rollout/log_prob_diff"), "log_prob_diff_max": median("rollout/log_prob_diff_max"),
            "steps": len(rows)}


def run_moe_bench(spec: MoEBenchSpec) -> int:
    out = Path(spec.out_dir)
    paths = write_models(out / "models")
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
    peaks: dict[str, list[float]] = {name: [] for name in ROWS}
    for round_ in range(spec.rounds):
        for index, (name, (model, keys)) in enumerate(ROWS.items()):
            job_dir = out / "jobs" / f"{index}_round{round_}"
            shutil.rmtree(job_dir, ignore_errors=True)
            print(f"syncwise bench moe: round {round_ + 1}/{spec.rounds}: {name}", flush=True)
            result = launch_local(train_worker, spec.nproc, _job(spec, paths[model], keys, job_dir))
            if result.exit_code != 0:
                return result.exit_code
            steps = read_jsonl(job_dir / "metrics.jsonl")
            peaks[name] += [step["memory/peak_bytes"] for step in steps if step.get("memory/peak_measured")]
            measured[name] += steps[1:]
    results = {name: _summary(rows, peaks[name]) for name, rows in measured.items()}
    write_report(out, "bench_moe", spec, {"result": results}, format_result(results, spec))
    return 0


def format_result(results: dict[str, Any], spec: MoEBenchSpec) -> str:
    base = next(iter(results.values()))
    lines = [f"GRPO on the built-in task, {spec.nproc} ranks, {spec.prompts_per_rank} x {spec.samples_per_prompt} "
             f"samples a rank, up to {spec.max_new_tokens} new tokens, a bfloat16 sampler beside fp32 training; "
             f"medians over {base['steps']} steps a row, {spec.rounds} interleaved round(s)", "",
             "| row | tokens/s | vs dense | step s | peak per rank | vs dense | route agreement | log-prob gap "
             "(mean / max) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        agreement = fmt(r["route_agreement"], 4, "-")
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                     f"{r['step_s']:.3f} | {r['peak_bytes'] / 2**20:.1f} MiB | "
                     f"{r['peak_bytes'] / base['peak_bytes']:.2f}x | {agreement} | "
                     f"{fmt(r['log_prob_diff'], 5)} / {fmt(r['log_prob_diff_max'], 4)} |")
    return "\n".join(lines)


def run(args) -> int:
    """``syncwise bench --workload moe``: the three rows, launched here job by job."""
    from . import out_dir

    out = out_dir(args, "bench_moe")
    spec = MoEBenchSpec.quick(out) if args.quick else MoEBenchSpec(out_dir=out)
    if args.repeats is not None:
        spec.rounds = args.repeats
    spec.nproc = args.nproc
    return run_moe_bench(spec)
