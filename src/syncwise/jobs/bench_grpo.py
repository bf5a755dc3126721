"""``syncwise bench --workload grpo``: whole GRPO steps on the long-tailed ``repeat`` task, phase by phase.

Each configuration is a real ``syncwise train`` job (the default job's model and optimizer, the ``repeat``
task after a short supervised warm start, the same seed, prompts and samples per step) started on fresh
local ranks; the first ``warmup`` steps of each are left out. Rounds are interleaved (A B C, A B C) so a
machine that slows down in between slows every configuration alike. Per configuration, medians over the
measured steps of every round: the step time and each phase of it (``time/*`` of ``metrics.jsonl``), the
sampler's response tokens per second of sampling and per second of the whole step (end to end), the
cross-rank token imbalance before and after balancing, and the mean reward (the same samples per step, so
it should agree within noise). The first configuration -- Hugging Face ``generate``, no balancing and a
forward-only pass for the old log-probs: the path before ``rl.sampler=compact``, ``rl.balance_ranks`` and
the on-policy shortcut -- is the reference the others' speed-up is measured against. Writes
``bench_grpo.json``, ``bench_grpo.md`` and ``grpo_phases.png`` (stacked phases).
"""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import config_to_dict, load_config, packaged_config
from ..metrics import plot_phase_bars, read_jsonl
from ..rl.trainer import PHASES, train_worker
from ..runtime.launcher import launch_local

# name -> overrides; the first is the reference.
GRPO_CONFIGS: dict[str, tuple[str, ...]] = {
    "generate, unbalanced (before)": ("rl.sampler=generate", "rl.balance_ranks=false", "rl.old_log_prob_pass=true"),
    "compact sampler, unbalanced, old log-prob pass": ("rl.sampler=compact", "rl.balance_ranks=false",
                                                       "rl.old_log_prob_pass=true"),
    "compact sampler, unbalanced": ("rl.sampler=compact", "rl.balance_ranks=false"),
    "compact sampler, balanced": ("rl.sampler=compact", "rl.balance_ranks=true"),
    "compact, balanced, skip uniform groups": ("rl.sampler=compact", "rl.balance_ranks=true",
                                               "rl.skip_uniform_groups=true"),
    "compact, balanced, per_microbatch": ("rl.sampler=compact", "rl.balance_ranks=true", "sync.mode=per_microbatch"),
    "compact, balanced, padded": ("rl.sampler=compact", "rl.balance_ranks=true", "engine.packing=false"),
}
QUICK_CONFIGS = ("generate, unbalanced (before)", "compact sampler, balanced", "compact, balanced, skip uniform groups")


@dataclass
class GRPOBenchSpec:
    out_dir: str = "runs/bench_grpo"
    nproc: int = 2
    steps: int = 12  # per job, the first ``warmup`` left out
    warmup: int = 2
    rounds: int = 2
    warm_start_steps: int = 30  # supervised steps first, so responses follow the task's long-tailed counts
    prompts_per_rank: int = 8
    samples_per_prompt: int = 8
    configs: list[str] = field(default_factory=lambda: list(GRPO_CONFIGS))
    extra: list[str] = field(default_factory=list)  # overrides for every job (e.g. model.preset=...)

    @classmethod
    def quick(cls, out_dir: str) -> GRPOBenchSpec:
        return cls(out_dir=out_dir, steps=4, warmup=1, rounds=1, warm_start_steps=5, prompts_per_rank=4,
                   samples_per_prompt=4, configs=list(QUICK_CONFIGS))


def _job_config(spec: GRPOBenchSpec, name: str, out: Path) -> dict[str, Any]:
    overrides = [
        "rl.task=repeat", f"rl.warm_start_steps={spec.warm_start_steps}", f"train.steps={spec.steps}",
        f"rl.prompts_per_rank={spec.prompts_per_rank}", f"rl.samples_per_prompt={spec.samples_per_prompt}",
        "train.progress=false", "train.export=false", "train.checkpoint_every=0", f"train.out_dir={out}",
        f"dist.nproc={spec.nproc}", *GRPO_CONFIGS[name], *spec.extra,
    ]
    return config_to_dict(load_config(packaged_config("grpo.yaml"), overrides))


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    step = sum(r["time/step_s"] for r in rows)
    tokens = sum(r["rollout/response_tokens"] for r in rows)
    return {
        "steps": len(rows),
        "step_s": median("time/step_s"),
        "phases_s": {phase: median(f"time/{phase}_s") for phase in PHASES},
        "rollout_tokens_per_s": tokens / sum(r["time/rollout_s"] for r in rows),
        "end_to_end_tokens_per_s": tokens / step,
        "response_length_mean": statistics.mean(r["response/length_mean"] for r in rows),
        "imbalance_before": median("batch/rank_token_imbalance_before"),
        "imbalance_after": median("batch/rank_token_imbalance_after"),
        "reward_mean": statistics.mean(r["reward/mean"] for r in rows),
        "uniform_group_fraction": statistics.mean(r["rollout/uniform_group_fraction"] for r in rows),
    }


def bench_grpo(spec: GRPOBenchSpec) -> int:
    """Run every configuration ``spec.rounds`` times, interleaved; write the tables and the plot. Returns
    the exit status (that of the first job that did not finish)."""
    unknown = [name for name in spec.configs if name not in GRPO_CONFIGS]
    if unknown:
        raise ValueError(f"bench --workload grpo: unknown configuration(s) {unknown}; known: {list(GRPO_CONFIGS)}")
    out_dir = Path(spec.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in spec.configs}
    for round_ in range(spec.rounds):
        for name in spec.configs:
            job_dir = out_dir / "jobs" / f"{spec.configs.index(name)}_round{round_}"
            shutil.rmtree(job_dir, ignore_errors=True)
            print(f"syncwise bench grpo: round {round_ + 1}/{spec.rounds}: {name}", flush=True)
            result = launch_local(train_worker, spec.nproc, _job_config(spec, name, job_dir))
            if result.exit_code != 0:
                return result.exit_code
            measured[name] += read_jsonl(job_dir / "metrics.jsonl")[spec.warmup:]
    results = {name: _summary(rows) for name, rows in measured.items()}
    reference = results[spec.configs[0]]
    for r in results.values():
        r["speedup"] = reference["step_s"] / r["step_s"]
    (out_dir / "bench_grpo.json").write_text(json.dumps({"spec": asdict(spec), "results": results}, indent=1))
    table = format_results(spec, results)
    (out_dir / "bench_grpo.md").write_text(table + "\n")
    plot_phase_bars(results, out_dir / "grpo_phases.png", list(PHASES))
    print(table, flush=True)
    return 0


def format_results(spec: GRPOBenchSpec, results: dict[str, dict[str, Any]]) -> str:
    def fmt(value: float) -> str:
        return f"{value:.3f}"

    lines = [
        f"GRPO steps on the repeat task: {spec.nproc} ranks, {spec.prompts_per_rank} prompts x "
        f"{spec.samples_per_prompt} samples per rank, {spec.warm_start_steps} warm-start steps; medians of "
        f"{spec.steps - spec.warmup} steps x {spec.rounds} round(s)",
        "",
        "| configuration | step s | speed-up | " + " | ".join(f"{p} s" for p in PHASES)
        + " | rollout tok/s | end-to-end tok/s | imbalance before -> after | reward |",
        "|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|",
    ]
    for name, r in results.items():
        phases = " | ".join(fmt(r["phases_s"][p]) for p in PHASES)
        lines.append(
            f"| {name} | {fmt(r['step_s'])} | {r['speedup']:.2f}x | {phases} | {r['rollout_tokens_per_s']:.0f} "
            f"| {r['end_to_end_tokens_per_s']:.0f} | {fmt(r['imbalance_before'])} -> {fmt(r['imbalance_after'])} "
            f"| {r['reward_mean']:.3f} |"
        )
    return "\n".join(lines)
