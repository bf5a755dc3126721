"""``syncwise bench --workload regression``: the current tree against a pinned earlier commit on the same GRPO job,
phase by phase, per token -- so a slowdown is seen the day it lands (issue 71: the step had grown 10-18% slower
since :data:`PINNED` unnoticed).

Both trees run the same job in the same environment (this Python, its torch and transformers): the earlier one
from a ``git worktree`` of ``--against`` (default :data:`PINNED`; or ``--against-tree`` a checkout), its
``src`` first on the path. Runs alternate A B B A in every round (``--repeats``, default 2), so a machine that
slows down in between slows both alike. Per run: the medians over the steps after ``--warmup`` (default 3) of
each phase (``time/*``), divided by the median response length (the trees may sample responses of different
lengths: the cost per token is what compares), and the sampled tokens per second of the rollout. The ratio is
current / earlier per phase (above 1: slower now), each round's beside the pooled one, so a difference inside
the rounds' spread reads as noise.

Per token is a fair measure only roughly: a batch decodes until its longest response ends, so responses of other
lengths cost other amounts per token (issue 71's "slowdown" was that: 76f4f05 drew its samples from the job's
generator, today's trees from per-call seeds, so the two sampled different responses -- 7.8% longer, more of them
at the length cap). The report says whether both trees sampled the very same responses at every measured step
(``same_responses``); where they did, the work was identical and the ratio of each phase's total seconds
(``totals``) compares the code alone.

The default job is issue 71's: the SFT example's model fine-tuned one epoch (prepared once under ``--out``), then
30 GRPO steps of 4 prompts x 8 samples a rank, 64 new tokens, lr 1e-4. ``--job KEY=VALUE ...`` runs yours instead
(its keys must exist in both trees).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import write_report

PINNED = "76f4f05"  # the engine as it was when its GRPO step was first measured against TRL's
JOB = ("rl.reward_fn=syncwise.rewards:final_number", "rl.prompts_per_rank=4", "rl.samples_per_prompt=8",
       "rl.max_new_tokens=64", "rl.temperature=1.0", "rl.loss.kl_coef=0", "rl.mini_batches=1", "rl.epochs=1",
       "optim.lr=1e-4", "optim.warmup_steps=0", "optim.grad_clip=1.0", "engine.micro_batch_size=8",
       "train.steps=30", "train.seed=0", "train.checkpoint_every=0", "train.export=false")
PHASES = ("step", "rollout", "update")  # reported first; every other time/* after them
CURRENT = Path(__file__).resolve().parents[3]  # this tree's src/


@dataclass
class RegressionSpec:
    out_dir: str
    against: str = PINNED
    against_tree: str | None = None
    job: list[str] = field(default_factory=list)
    rounds: int = 2
    warmup: int = 3
    nproc: int = 2


def run(args) -> int:
    from . import out_dir

    spec = RegressionSpec(out_dir=out_dir(args, "bench_regression"), job=list(args.job or []), nproc=args.nproc)
    spec.against = args.against or PINNED
    spec.against_tree = args.against_tree
    if args.repeats is not None:
        spec.rounds = args.repeats
    if args.warmup is not None:
        spec.warmup = args.warmup
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="syncwise-earlier-") as folder:
        earlier = Path(spec.against_tree) / "src" if spec.against_tree else _worktree(spec.against, Path(folder))
        job = spec.job or [*JOB, *_default_data(out)]
        runs: dict[str, list[dict[str, float]]] = {"earlier": [], "current": []}
        for r in range(spec.rounds):
            for i, which in enumerate(("earlier", "current", "current", "earlier")):
                tree = earlier if which == "earlier" else CURRENT
                runs[which].append(_run(tree, job, out / f"round{r}_{i}_{which}", spec))
        if not spec.against_tree:
            _drop_worktree(Path(folder) / "tree")
    same = all(r["responses"] == runs["earlier"][0]["responses"] for rs in runs.values() for r in rs)
    results = _compare(runs)
    totals = {key: statistics.mean(r["totals"][key] for r in runs["current"])
              / max(statistics.mean(r["totals"][key] for r in runs["earlier"]), 1e-12)
              for key in runs["current"][0]["totals"] if key in runs["earlier"][0]["totals"]}
    said = ("same responses in both trees at every measured step: the work was identical; each phase's total "
            "seconds, current / earlier: " + ", ".join(f"{k} {v:.3f}" for k, v in totals.items() if k in PHASES)
            if same else
            "the trees sampled different responses (their sampling seeds or numerics differ): a per-token ratio "
            "also carries the change of work -- other lengths, more or fewer at the length cap")
    write_report(out, "bench_regression", spec,
                 {"runs": runs, "ratios": results, "same_responses": same, "totals": totals if same else None},
                 _table(results), [f"earlier: {spec.against_tree or spec.against}; current: {CURRENT.parent}; "
                                   f"{spec.rounds} round(s) of A B B A; per token = over the median response "
                                   "length; ratio = current / earlier (above 1: slower now)", said])
    return 0


def _repo_root() -> Path:
    here = Path(__file__).resolve().parent
    proc = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit("syncwise bench --workload regression: this syncwise is no git checkout; give "
                         "--against-tree PATH (a checkout of the earlier commit)")
    return Path(proc.stdout.strip())


def _worktree(ref: str, folder: Path) -> Path:
    """A detached checkout of ``ref`` in ``folder/tree``; its ``src``."""
    proc = subprocess.run(["git", "-C", str(_repo_root()), "worktree", "add", "--detach", str(folder / "tree"), ref],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"syncwise bench --workload regression: --against {ref}: {proc.stderr.strip()}")
    return folder / "tree" / "src"


def _drop_worktree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(_repo_root()), "worktree", "remove", "--force", str(tree)],
                   capture_output=True)


def _syncwise(src: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "syncwise", *args], cwd=cwd, env=env, capture_output=True, text=True)


def _default_data(out: Path) -> list[str]:
    """Issue 71's model and prompts, made once under ``out``: the SFT example's data, its model fine-tuned one
    epoch by this tree."""
    export = out / "sft" / "export"
    if not (export / "config.json").is_file():
        for args in (["sft", "--write-example-data", str(out / "data")],
                     ["sft", f"model.path={out / 'data' / 'model'}", f"sft.dataset={out / 'data' / 'train.jsonl'}",
                      "sft.epochs=1", f"sft.out_dir={out / 'sft'}", "sft.progress=false"]):
            proc = _syncwise(CURRENT, args, out)
            if proc.returncode != 0:
                raise SystemExit(f"syncwise bench --workload regression: preparing the job failed: "
                                 f"{proc.stderr.strip().splitlines()[-1:]}")
    return [f"model.path={export}", f"rl.dataset={out / 'data' / 'prompts.jsonl'}"]


def _run(src: Path, job: list[str], out: Path, spec: RegressionSpec) -> dict[str, Any]:
    """One job on the tree at ``src``: per phase, the median seconds per response token over the measured steps;
    ``totals``: each phase's seconds over them; ``responses``: each step's response tokens and mean length."""
    from ...metrics import read_jsonl

    proc = _syncwise(src, ["train", *job, f"dist.nproc={spec.nproc}", f"train.out_dir={out}",
                           "train.progress=false"], out.parent)
    if proc.returncode != 0:
        raise SystemExit(f"syncwise bench --workload regression: the job on {src} failed: "
                         f"{proc.stderr.strip().splitlines()[-3:]}")
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r and r["train/step"] > spec.warmup]
    length = statistics.median(r["response/length_mean"] for r in rows)
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    per_token = {k.removeprefix("time/").removesuffix("_s"): statistics.median(r.get(k, 0.0) for r in rows) / length
                 for k in phases}
    sampled = [r["rollout/response_tokens"] / r["time/rollout_s"] for r in rows
               if r.get("time/rollout_s") and "rollout/response_tokens" in r]
    totals = {k.removeprefix("time/").removesuffix("_s"): sum(r.get(k, 0.0) for r in rows) for k in phases}
    responses = [[r.get("rollout/response_tokens"), r["response/length_mean"]] for r in rows]
    return {**per_token, "response_length": length,
            **({"rollout_tokens_per_s": statistics.median(sampled)} if sampled else {}),
            "totals": totals, "responses": responses}


def _compare(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per phase: each tree's pooled median per token, the ratio, and each round's ratio (A B B A: a round's
    two runs of each tree)."""
    keys = [k for k in runs["current"][0] if k in runs["earlier"][0] and k not in ("totals", "responses")]
    rounds = len(runs["current"]) // 2
    out: dict[str, Any] = {}
    for key in keys:
        earlier = statistics.median(r[key] for r in runs["earlier"])
        current = statistics.median(r[key] for r in runs["current"])
        per_round = [statistics.mean(r[key] for r in runs["current"][2 * i:2 * i + 2])
                     / max(statistics.mean(r[key] for r in runs["earlier"][2 * i:2 * i + 2]), 1e-12)
                     for i in range(rounds)]
        out[key] = {"earlier": earlier, "current": current, "ratio": current / earlier if earlier else None,
                    "rounds": per_round}
    return out


def _table(results: dict[str, Any]) -> str:
    order = [*(p for p in PHASES if p in results), *sorted(k for k in results if k not in PHASES)]
    lines = ["| per token (rollout_tokens_per_s: higher is faster) | earlier | current | current / earlier | "
             "each round |", "|---|---|---|---|---|"]
    for key in order:
        r = results[key]
        scale, unit = (1.0, "") if key in ("response_length", "rollout_tokens_per_s") else (1e3, " ms")
        rounds = " / ".join(f"{x:.3f}" for x in r["rounds"])
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
        lines.append(f"| {key} | {r['earlier'] * scale:.3f}{unit} | {r['current'] * scale:.3f}{unit} | {ratio} | "
                     f"{rounds} |")
    return "\n".join(lines)
