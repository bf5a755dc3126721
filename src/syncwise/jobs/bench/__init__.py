"""``syncwise bench``: one workload per module, each measuring its ratios side by side in one run, with a
hand-written baseline beside every engine figure. :data:`WORKLOADS` is the table ``--workload`` chooses from;
a workload's module is imported only when it runs (torch)."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    summary: str  # for --help
    run: str  # "module:function", the function taking the parsed arguments and returning the exit status


WORKLOADS: dict[str, Workload] = {
    "modes": Workload("every sync mode side by side", "syncwise.jobs.bench.modes:run"),
    "rl": Workload("padded vs packed on long-tailed RL lengths (and a hand-written packed loop)",
                   "syncwise.jobs.bench.rl:run"),
    "loss": Workload("the log-prob path alone against autograd's", "syncwise.jobs.bench.loss:run"),
    "grpo": Workload("whole GRPO steps on the repeat task, phase by phase (--repeats: rounds)",
                     "syncwise.jobs.bench.grpo:run"),
    "regression": Workload("the current tree against a pinned earlier commit (--against, default 76f4f05) on one "
                           "GRPO job, per phase and per token, A B B A (--repeats: rounds)",
                           "syncwise.jobs.bench.regression:run"),
    "sft": Workload("syncwise sft's steps beside train_batch alone on the same batches", "syncwise.jobs.bench.sft:run"),
    "dpo": Workload("syncwise dpo beside TRL's DPOTrainer (--trl-python: a Python with trl) on the same model, pairs "
                    "and loss: pairs/s and peak memory, A B B A (--repeats: rounds)", "syncwise.jobs.bench.dpo:run"),
    "load": Workload("loading model.path: every rank whole on its CPU vs built on the meta device, each rank reading "
                     "its shards (peak host memory per rank, seconds)", "syncwise.jobs.bench.load:run"),
    "long": Workload("SFT steps on long sequences at dist.sequence_parallel N = 1, 2 (4) side by side: per-rank peak "
                     "(measured, predicted), tokens/s, the all-to-alls' share, the longest length fitting a budget",
                     "syncwise.jobs.bench.long:run"),
    "moe": Workload("a tiny mixture of experts through GRPO jobs with and without router replay, beside a dense model "
                    "of the same active size: tokens/s, peak memory, route agreement, the sampler-trainer gap",
                    "syncwise.jobs.bench.moe:run"),
    "gpu": Workload("the one command for a GPU: the CUDA tests, the engine on Qwen2.5-0.5B / -1.5B shapes beside a "
                    "hand-written loop, GRPO steps (--quick on a CPU: its parts, small)",
                    "syncwise.jobs.bench.gpu:run"),
}


def run_workload(args: argparse.Namespace) -> int:
    """The workload ``--workload`` names, run; its exit status."""
    module, _, name = WORKLOADS[args.workload].run.partition(":")
    return getattr(importlib.import_module(module), name)(args)


def out_dir(args: argparse.Namespace, name: str) -> str:
    """``--out``, or where the workload writes by default (``runs/<name>``)."""
    return args.out if args.out != "runs/bench" else f"runs/{name}"
