"""``syncwise bench --workload dpo``: ``syncwise dpo`` beside TRL's ``DPOTrainer`` on the same model, pairs, loss
and shape -- the SFT example's preference pairs and model unless ``--job`` names others (``model.path=...
dpo.dataset=...``), ``sigmoid`` at beta 0.1, 16 pairs a step on 2 ranks (``--sequences``), lr 1e-5, fp32 -- one
job after the other, A B B A over ``--repeats`` rounds, each a fresh process. TRL runs as its users run it on CPU
(``torchrun`` and ``use_cpu=True``, ``docs/bench/trl_dpo.py``) in the Python ``--trl-python`` names (an environment
with ``trl``; without it, syncwise's side alone). Pairs per second from each job's median step after its first two,
and the largest resident memory of any of its processes (the ranks'), side by side."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import write_report

TRL_SCRIPT = Path(__file__).resolve().parents[4] / "docs" / "bench" / "trl_dpo.py"
# the largest resident set of the command's processes: wait4's ru_maxrss over the tree it waited for
PEAK_RSS = ("import resource, subprocess, sys\ncode = subprocess.call(sys.argv[1:])\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\nsys.exit(code)\n")


@dataclass
class DPOBenchSpec:
    out_dir: str = "runs/bench_dpo"
    steps: int = 20  # steps a job (the first two not timed)
    pairs_per_step: int = 16  # TRL's default per_device_train_batch_size (8) on 2 ranks
    rounds: int = 2  # A B B A rounds
    nproc: int = 2
    trl_python: str | None = None  # a Python with trl installed
    job: list[str] = field(default_factory=list)  # model.path=..., dpo.dataset=... (default: the example data)

    @classmethod
    def quick(cls, out_dir: str) -> DPOBenchSpec:
        return cls(out_dir=out_dir, steps=6, rounds=1)


def _data(spec: DPOBenchSpec) -> tuple[str, str]:
    """(model folder, pairs file): ``--job``'s, else the SFT example's (written once under the output folder)."""
    given = dict(item.split("=", 1) for item in spec.job)
    if "model.path" in given and "dpo.dataset" in given:
        return given["model.path"], given["dpo.dataset"]
    from ...sft.tasks import write_example_data

    data = write_example_data(Path(spec.out_dir) / "data", train_rows=16, eval_rows=4, prompt_rows=400)
    return given.get("model.path", str(data / "model")), given.get("dpo.dataset", str(data / "pairs.jsonl"))


def _measured(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` (its output to the bench's stderr on failure); the peak resident bytes of its processes."""
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, *command], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed:\n{proc.stderr[-3000:]}")
    return int(proc.stdout.strip().splitlines()[-1])


def _syncwise(spec: DPOBenchSpec, model: str, pairs: str, out: Path) -> dict[str, Any]:
    extra = [item for item in spec.job if not item.startswith(("model.path=", "dpo.dataset="))]
    command = [sys.executable, "-m", "syncwise", "dpo", f"model.path={model}", f"dpo.dataset={pairs}",
               f"dpo.out_dir={out}", f"dpo.steps={spec.steps}", f"dpo.batch_size={spec.pairs_per_step}",
               "dpo.beta=0.1", "dpo.loss_type=sigmoid", "optim.lr=1e-5", "optim.grad_clip=1", "dpo.progress=false",
               "dpo.export=false", "dpo.checkpoint_every=0", f"dist.nproc={spec.nproc}", *extra]
    peak = _measured(command, os.environ.copy())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"step_s": [r["time/step_s"] for r in rows if "time/step_s" in r], "peak_rss_bytes": peak,
            "score_s": [r["time/score_s"] for r in rows if "time/score_s" in r]}


def _trl(spec: DPOBenchSpec, model: str, pairs: str, out: Path) -> dict[str, Any]:
    log = out.with_suffix(".jsonl")
    log.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as torchrun sets it, and syncwise's launcher on 2 cores
    command = [spec.trl_python, "-m", "torch.distributed.run", "--nproc-per-node", str(spec.nproc), str(TRL_SCRIPT),
               model, pairs, str(log), str(spec.steps), str(spec.pairs_per_step)]
    peak = _measured(command, env)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return {"step_s": [r["step_s"] for r in rows if "step_s" in r], "peak_rss_bytes": peak}


def run_dpo_bench(spec: DPOBenchSpec) -> dict[str, Any]:
    model, pairs = _data(spec)
    runs: dict[str, list[dict[str, Any]]] = {"syncwise": [], "TRL": []}
    order = ["syncwise", "TRL"] if spec.trl_python else ["syncwise"]
    for round_ in range(spec.rounds):
        for name in (order if round_ % 2 == 0 else order[::-1]):
            out = Path(spec.out_dir) / "jobs" / f"{name}_{round_}"
            run = _syncwise if name == "syncwise" else _trl
            runs[name].append(run(spec, model, pairs, out))
    result: dict[str, Any] = {"model": model, "pairs": pairs, "per_round": runs}
    for name, done in runs.items():
        if done:
            timed = [s for run in done for s in run["step_s"][2:]]
            result[name] = {"median_step_s": statistics.median(timed),
                            "pairs_per_s": spec.pairs_per_step / statistics.median(timed),
                            "peak_rss_bytes": max(run["peak_rss_bytes"] for run in done)}
    if runs["syncwise"] and runs["syncwise"][0]["score_s"]:
        scored = [s for run in runs["syncwise"] for s in run["score_s"][2:]]
        result["syncwise"]["score_share"] = statistics.median(scored) / result["syncwise"]["median_step_s"]
    return result


def format_result(result: dict[str, Any], spec: DPOBenchSpec) -> str:
    names = [n for n in ("syncwise", "TRL") if n in result]
    lines = [f"DPO on {result['model']} with {result['pairs']}: sigmoid, beta 0.1, {spec.pairs_per_step} pairs a "
             f"step on {spec.nproc} ranks, {spec.steps} steps a job (the first two not timed), {spec.rounds} "
             "round(s) A B B A", "", "| job | median step s | pairs/s | peak RSS of a rank (MiB) |",
             "|---|---|---|---|"]
    lines += [f"| {n} | {result[n]['median_step_s']:.3f} | {result[n]['pairs_per_s']:.2f} | "
              f"{result[n]['peak_rss_bytes'] / 2**20:.0f} |" for n in names]
    if "TRL" in result:
        ours, trl = result["syncwise"], result["TRL"]
        lines += ["", f"syncwise / TRL pairs/s: {ours['pairs_per_s'] / trl['pairs_per_s']:.2f}x; peak RSS "
                      f"{ours['peak_rss_bytes'] / trl['peak_rss_bytes']:.2f}x"]
    if "score_share" in result.get("syncwise", {}):
        lines.append(f"syncwise's reference pass (its forward-only log-probs; and the policy's where a step's pairs "
                     f"were split) is {result['syncwise']['score_share']:.0%} of its step")
    return "\n".join(lines)


def run(args) -> int:
    """``syncwise bench --workload dpo [--trl-python PY] [--job model.path=... dpo.dataset=...]``."""
    from . import out_dir

    out = out_dir(args, "bench_dpo")
    spec = DPOBenchSpec.quick(out) if args.quick else DPOBenchSpec(out_dir=out)
    spec.nproc, spec.trl_python, spec.job = args.nproc, args.trl_python, list(args.job or [])
    spec.pairs_per_step = args.sequences or spec.pairs_per_step
    if args.repeats is not None:
        spec.rounds = args.repeats
    if spec.trl_python and not TRL_SCRIPT.is_file():
        print(f"syncwise bench: --trl-python needs {TRL_SCRIPT} (a source checkout's docs/bench)", file=sys.stderr)
        return 2
    result = run_dpo_bench(spec)
    write_report(spec.out_dir, "bench_dpo", spec, {"result": result}, format_result(result, spec))
    return 0

