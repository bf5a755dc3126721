"""``syncwise bench --workload grpo``: whole GRPO steps on the long-tailed ``repeat`` task, phase by phase.

Like is compared with like. One preparatory job warms the default job's model up on the ``repeat`` task
(supervised steps on its answers, so responses follow the task's long-tailed counts) and exports it; every
configuration is then a real ``syncwise train`` job from that export with the learning rate at 0 (every
step still computes its gradient and optimizer step), the same seed and prompts, started on fresh local
ranks. The weights never move, so configurations with the same rollout engine sample *identical* responses
at every step (the table says so: ``same responses``); the engines draw from the same distribution with
different streams, so their responses differ in the draw, not in kind. The headline is the ratio of real
(response) tokens per second end to end, which counts the work actually done; the step-time ratio is
shown beside it. The first ``warmup`` steps of each job are left out; rounds are interleaved (A B C, A B C)
so a machine that slows down in between slows every configuration alike. Per configuration, medians over
the measured steps of every round: the step time and each phase of it (``time/*`` of ``metrics.jsonl``),
response tokens per second of sampling (every token sampled: partial rollouts sample some that train later)
and end to end (the tokens that trained), the decode batch's fill, and the cross-rank token imbalance before
and after balancing. The first configuration -- Hugging Face ``generate``, no balancing and a forward-only pass for
the old log-probs: the path before ``rl.rollout_engine=compact``, ``rl.balance_ranks`` and the on-policy
shortcut -- is the reference. Writes ``bench_grpo.json``, ``bench_grpo.md`` and ``grpo_phases.png``.

``--variant NAME KEY=VALUE ...`` (repeatable) adds rows of your own -- the balanced compact sampler's with those
keys -- measured side by side in the same interleaved rounds (only those, unless ``--configs`` names more): e.g.
``rl.tools=[my_tools.py:add]`` against ``rl.agent=my_agent.py:agent``, the in-process turn loop against the
agent's endpoint on the same task.

``--job KEY=VALUE ...`` benches your own job instead: its keys go into every configuration's (after the row's:
``rl.dataset=...``, ``rl.environment=...``, ``rl.max_turns=5``), and with ``model.path`` among them the
configurations start from that model (an SFT export) and the warm start is skipped -- how the docs' (docs/sft.md)
multi-turn recipes are measured mode against mode.
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import config_to_dict, load_config, packaged_config
from ...config.rollout_engines import ROLLOUT_ENGINES
from ...config.rollout_modes import mode_of
from ...metrics import plot_phase_bars, read_jsonl
from ...rl.job import train_worker
from ...rl.stats import PHASES, drawn_tokens
from ...runtime.launcher import launch_local
from .report import write_report
from .roofline import gemm_rate_worker
from .time_model import fit

# name -> overrides; the first is the reference.
GRPO_CONFIGS: dict[str, tuple[str, ...]] = {
    "generate, unbalanced (before)": ("rl.rollout_engine=generate", "rl.balance_ranks=false",
                                      "rl.old_log_prob_pass=true"),
    "compact sampler, unbalanced, old log-prob pass": ("rl.rollout_engine=compact", "rl.balance_ranks=false",
                                                       "rl.old_log_prob_pass=true"),
    "compact sampler, unbalanced": ("rl.rollout_engine=compact", "rl.balance_ranks=false"),
    "compact sampler, balanced": ("rl.rollout_engine=compact", "rl.balance_ranks=true"),
    "compact, balanced, skip uniform groups": ("rl.rollout_engine=compact", "rl.balance_ranks=true",
                                               "rl.skip_uniform_groups=true"),
    "compact, balanced, 8 per micro-batch": ("rl.rollout_engine=compact", "rl.balance_ranks=true",
                                             "engine.micro_batch_size=8"),  # grpo.yaml's split before auto's cap
    "compact, balanced, per_microbatch": ("rl.rollout_engine=compact", "rl.balance_ranks=true",
                                          "sync.mode=per_microbatch"),
    "compact, balanced, padded": ("rl.rollout_engine=compact", "rl.balance_ranks=true", "engine.packing=false"),
    "vLLM, balanced": ("rl.rollout_engine=vllm", "rl.balance_ranks=true"),
}


def _off_policy_row(engine: str, lag: int = 0, max_staleness: int = 0, rollout_ranks: bool = False
                    ) -> tuple[str, tuple[str, ...]]:
    """A row of an off-policy mode, named from the table of rollout modes (``vLLM, balanced, lag 1, rollout
    ranks``); with rollout ranks, as many as the job has trainers."""
    words = {"compact": "compact", "vllm": "vLLM"}[engine]
    mode = mode_of(lag, max_staleness, rollout_ranks)
    keys = ("rl.max_staleness=" + str(max_staleness)) if max_staleness else f"rl.off_policy_lag={lag}"
    return f"{words}, balanced, {mode.label(lag)}", (f"rl.rollout_engine={engine}", "rl.balance_ranks=true", keys)


# partial rollouts (issue 48): the long tail carried to the next step in rounds, new prompts joining; rollout
# ranks of their own: the same trainers, and as many ranks again that only sample, against the colocated job with
# the same lag (the same batches) -- on a CPU every rank shares the machine's cores -- or drawing partial rollouts
# on (the fast mode): the newest weights between rounds, at most 1 version behind
OFF_POLICY_ROWS = [("compact", 0, 1, False), ("vllm", 0, 1, False), ("compact", 1, 0, False), ("compact", 1, 0, True),
                   ("compact", 0, 1, True), ("vllm", 0, 1, True)]  # engine, lag, max_staleness, rollout ranks
GRPO_CONFIGS.update(_off_policy_row(*row) for row in OFF_POLICY_ROWS)
WITH_ROLLOUT_RANKS = tuple(_off_policy_row(*row)[0] for row in OFF_POLICY_ROWS if row[3])
QUICK_CONFIGS = ("generate, unbalanced (before)", "compact sampler, balanced", "compact, balanced, skip uniform groups",
                 "compact, balanced, partial rollouts")


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
    configs: list[str] = field(default_factory=lambda: _available(list(GRPO_CONFIGS)))
    extra: list[str] = field(default_factory=list)  # overrides for every job (e.g. model.preset=...)
    job: list[str] = field(default_factory=list)  # --job: a user's own job's keys, last; model.path: no warm start

    @property
    def own_model(self) -> str | None:
        """``--job model.path=...``: the model every configuration starts from, without a warm start."""
        paths = [o.partition("=")[2] for o in self.job if o.startswith("model.path=")]
        return paths[-1] if paths else None

    @classmethod
    def quick(cls, out_dir: str) -> GRPOBenchSpec:
        return cls(out_dir=out_dir, steps=4, warmup=1, rounds=1, warm_start_steps=5, prompts_per_rank=4,
                   samples_per_prompt=4, configs=list(QUICK_CONFIGS))


def _available(names: list[str]) -> list[str]:
    """``names`` without the rows whose rollout engine is not installed (vLLM's with ``make VLLM_SPEC=``)."""
    def engine(name: str) -> str:
        chosen = [o.partition("=")[2] for o in GRPO_CONFIGS[name] if o.startswith("rl.rollout_engine=")]
        return chosen[-1] if chosen else "compact"

    return [n for n in names if ROLLOUT_ENGINES[engine(n)].installed()]


def _job_config(spec: GRPOBenchSpec, name: str | None, out: Path, start: Path | None = None) -> dict[str, Any]:
    """A configuration's job from the warmed-up ``start`` export, learning rate 0; or (``name`` None) the
    preparatory job: the warm start and one step, exported."""
    common = [
        "rl.task=repeat", f"rl.prompts_per_rank={spec.prompts_per_rank}",
        f"rl.samples_per_prompt={spec.samples_per_prompt}", "train.progress=false", "train.checkpoint_every=0",
        f"train.out_dir={out}", f"dist.nproc={spec.nproc}",
    ]
    if name is None:
        overrides = [*common, f"rl.warm_start_steps={spec.warm_start_steps}", "train.steps=1", "train.export=true"]
    else:
        overrides = [*common, f"model.path={start}", "rl.warm_start_steps=0", "optim.lr=0", "optim.warmup_steps=0",
                     f"train.steps={spec.steps}", "train.export=false", *GRPO_CONFIGS[name]]
        if _rollout_ranks(spec, name):
            overrides += [f"dist.rollout_ranks={spec.nproc}", f"dist.nproc={_nproc(spec, name)}"]
    return config_to_dict(load_config(packaged_config("grpo.yaml"), [*overrides, *spec.extra, *spec.job],
                                      packaged=True))


def _rollout_ranks(spec: GRPOBenchSpec, name: str | None) -> int:
    """The configuration's rollout ranks of their own: as many as it has trainers (``spec.nproc``), or none."""
    return spec.nproc if name in WITH_ROLLOUT_RANKS else 0


def _nproc(spec: GRPOBenchSpec, name: str | None) -> int:
    return spec.nproc + _rollout_ranks(spec, name)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    step = sum(r["time/step_s"] for r in rows)
    tokens = sum(r["rollout/response_tokens"] for r in rows)
    drawn = sum(drawn_tokens(r) for r in rows)  # partial rollouts: also what trains later
    remote = "rollout_rank/sample_s" in rows[0]  # drawn on rollout ranks: their sampling seconds, not the trainers'
    sampling = [r["rollout_rank/sample_s"] if remote else r["time/rollout_s"] for r in rows]
    return {
        "steps": len(rows),
        "response_tokens": [r["rollout/response_tokens"] for r in rows],  # per step: which work was done
        "step_s": median("time/step_s"),
        "phases_s": {phase: median(f"time/{phase}_s") for phase in PHASES},
        "rollout_tokens_per_s": drawn / sum(sampling),
        "decode_fill": statistics.mean(r["rollout/decode_fill"] for r in rows),
        "decode_steps": statistics.mean(r["rollout/decode_steps"] for r in rows),
        "rollout_s_mean": statistics.mean(sampling),
        # with rollout ranks: how long each waited for weights, per step (the trainers' wait is a phase)
        "rollout_rank_idle_s": median("rollout_rank/idle_s") if remote else None,
        "end_to_end_tokens_per_s": tokens / step,
        "weight_sync_share": sum(r["time/weight_sync_s"] for r in rows) / step,
        "response_length_mean": statistics.mean(r["response/length_mean"] for r in rows),
        "imbalance_before": median("batch/rank_token_imbalance_before"),
        "imbalance_after": median("batch/rank_token_imbalance_after"),
        "reward_mean": statistics.mean(r["reward/mean"] for r in rows),
        "uniform_group_fraction": statistics.mean(r["rollout/uniform_group_fraction"] for r in rows),
        # the update's useful FLOPs (every rank's) per second of the update phase: the roofline's numerator
        "update_useful_flops_per_s": sum(r["perf/update_useful_flops"] for r in rows)
        / sum(r["time/update_s"] for r in rows),
    }


def run(args) -> int:
    """``syncwise bench --workload grpo``: whole ``syncwise train`` jobs, each on its own local ranks."""
    from . import out_dir

    out = out_dir(args, "bench_grpo")
    spec = GRPOBenchSpec.quick(out) if args.quick else GRPOBenchSpec(out_dir=out)
    spec.nproc = args.nproc
    if args.configs:
        spec.configs = args.configs
    for name, *keys in args.variant or []:  # your own rows: the balanced compact sampler's, with these keys
        GRPO_CONFIGS[name] = ("rl.rollout_engine=compact", "rl.balance_ranks=true", *keys)
    if args.variant and not args.configs:
        spec.configs = [name for name, *_ in args.variant]
    if args.presets:  # one model per run: its rows compare engines and settings on it
        if len(args.presets) > 1:
            raise SystemExit("syncwise: error: bench --workload grpo: one --presets model per run")
        spec.extra = [f"model.preset={args.presets[0]}"]
    if args.repeats is not None:
        spec.rounds = args.repeats
    spec.job = list(args.job or [])
    return bench_grpo(spec)


def bench_grpo(spec: GRPOBenchSpec) -> int:
    """Run every configuration ``spec.rounds`` times, interleaved; write the tables and the plot. Returns
    the exit status (that of the first job that did not finish)."""
    unknown = [name for name in spec.configs if name not in GRPO_CONFIGS]
    if unknown:
        raise ValueError(f"bench --workload grpo: unknown configuration(s) {unknown}; known: {list(GRPO_CONFIGS)}")
    out_dir = Path(spec.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in spec.configs}
    model = Path(spec.own_model) if spec.own_model else out_dir / "jobs" / "warm_start" / "export"
    if not spec.own_model:
        start = model.parent
        shutil.rmtree(start, ignore_errors=True)
        print(f"syncwise bench grpo: the warm start ({spec.warm_start_steps} supervised steps), exported", flush=True)
        result = launch_local(train_worker, _nproc(spec, None), _job_config(spec, None, start))
        if result.exit_code != 0:
            return result.exit_code
    for round_ in range(spec.rounds):
        for name in spec.configs:
            job_dir = out_dir / "jobs" / f"{spec.configs.index(name)}_round{round_}"
            shutil.rmtree(job_dir, ignore_errors=True)
            print(f"syncwise bench grpo: round {round_ + 1}/{spec.rounds}: {name}", flush=True)
            result = launch_local(train_worker, _nproc(spec, name), _job_config(spec, name, job_dir, model))
            if result.exit_code != 0:
                return result.exit_code
            measured[name] += read_jsonl(job_dir / "metrics.jsonl")[spec.warmup:]
    results = {name: _summary(rows) for name, rows in measured.items()}
    # the time model's two decode costs, per rollout engine, fitted to all its colocated configurations' steps
    for name, rows in measured.items():
        cost = fit([row for other, rows in measured.items() if _sampler_of(other) == _sampler_of(name)
                    and not _rollout_ranks(spec, other) for row in rows], spec.nproc)
        drawn = statistics.mean(drawn_tokens(r) for r in rows)
        results[name]["rollout_s_model"] = cost.seconds(results[name]["decode_steps"], drawn / spec.nproc)
        results[name]["decode_cost"] = {"per_step_s": cost.per_step_s, "per_token_s": cost.per_token_s}
    # the GEMM rate at the model's shapes, on ranks launched as the jobs' were (all timing at once)
    rate_file = out_dir / "jobs" / "gemm_rate.txt"
    dtype = _job_config(spec, spec.configs[0], out_dir, model)["model"]["param_dtype"]
    result = launch_local(gemm_rate_worker, spec.nproc, str(model), dtype, str(rate_file))
    if result.exit_code != 0:
        return result.exit_code
    rate = float(rate_file.read_text())
    reference = results[spec.configs[0]]
    for name, r in results.items():
        r["speedup"] = r["end_to_end_tokens_per_s"] / reference["end_to_end_tokens_per_s"]  # the headline
        r["step_time_ratio"] = reference["step_s"] / r["step_s"]
        r["gemm_flops_per_s"] = rate
        r["update_fraction_of_gemm_peak"] = r["update_useful_flops_per_s"] / (rate * spec.nproc)
        # identical responses as the first configuration with the same sampler: the same work, step by step
        sampler = _sampler_of(name)
        twin = next(other for other in spec.configs if _sampler_of(other) == sampler)
        r["same_responses_as"] = twin if r["response_tokens"] == results[twin]["response_tokens"] else None
    plot_phase_bars(results, out_dir / "grpo_phases.png", list(PHASES))
    write_report(out_dir, "bench_grpo", spec, {"results": results}, format_results(spec, results),
                 also=[out_dir / "grpo_phases.png"])
    return 0


def _sampler_of(name: str) -> str:
    """The configuration's rollout engine (configurations of one engine sample identical responses)."""
    engines = [o.split("=", 1)[1] for o in GRPO_CONFIGS[name] if o.startswith("rl.rollout_engine=")]
    return engines[0] if engines else "compact"


def format_results(spec: GRPOBenchSpec, results: dict[str, dict[str, Any]]) -> str:
    def fmt(value: float) -> str:
        return f"{value:.3f}"

    job = (f"your job ({' '.join(spec.job)}), from {spec.own_model}" if spec.own_model else
           f"the repeat task{' (' + ' '.join(spec.job) + ')' if spec.job else ''}, {spec.prompts_per_rank} prompts x "
           f"{spec.samples_per_prompt} samples per rank, from a model warmed up by {spec.warm_start_steps} "
           "supervised steps")
    lines = [
        f"GRPO steps on {job}: {spec.nproc} ranks, learning rate 0 (the same weights every step); medians of "
        f"{spec.steps - spec.warmup} steps x {spec.rounds} round(s). Speed-up: end-to-end response tokens/s "
        f"over the first row's",
        "",
        "| configuration | end-to-end tok/s | speed-up | step s | step-time ratio | same responses | "
        + " | ".join(f"{p} s" for p in PHASES) + " | weight sync share | rollout tok/s | decode fill | mean response | "
        "imbalance before -> after | update of GEMM peak | rollout ranks' sampling / idle s |",
        "|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        phases = " | ".join(fmt(r["phases_s"][p]) for p in PHASES)
        idle = r["rollout_rank_idle_s"]
        twin = r["same_responses_as"]
        same = "no" if twin is None else ("(reference)" if twin == name else f"as {spec.configs.index(twin) + 1}")
        lines.append(
            f"| {spec.configs.index(name) + 1}. {name} | {r['end_to_end_tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
            f"{fmt(r['step_s'])} | {r['step_time_ratio']:.2f}x | {same} | {phases} | "
            f"{r['weight_sync_share']:.1%} | {r['rollout_tokens_per_s']:.0f} | {r['decode_fill']:.2f} | "
            f"{r['response_length_mean']:.1f} | "
            f"{fmt(r['imbalance_before'])} -> {fmt(r['imbalance_after'])} | {r['update_fraction_of_gemm_peak']:.1%} | "
            + (f"{fmt(r['rollout_s_mean'])} / {fmt(idle)} |" if idle is not None else "-- |")
        )
    if results:
        lines += ["", "Time model (docs/perf_tuning.md: a decode step's fixed cost + each row's, fitted per rollout "
                      "engine to all its configurations' steps): rollout seconds per step, measured (mean) / the "
                      "model's, and the costs -- "
                      + "; ".join(f"{spec.configs.index(name) + 1}. {r['rollout_s_mean']:.3f} / "
                                  f"{r['rollout_s_model']:.3f} ({r['decode_cost']['per_step_s'] * 1e3:.2f} ms + "
                                  f"{r['decode_cost']['per_token_s'] * 1e6:.0f} us/row)"
                                  for name, r in results.items())]
        rate = next(iter(results.values()))["gemm_flops_per_s"]
        lines += ["", f"Update of GEMM peak: the update's useful FLOPs per second over {rate / 1e9:.1f} GFLOP/s per "
                      "rank (torch.mm at the model's shapes, timed on ranks launched as the jobs', this run)"]
    return "\n".join(lines)
