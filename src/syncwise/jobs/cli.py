"""``syncwise`` command line: ``train`` (GRPO), ``sft``, ``bench`` (modes side by side), ``plan`` (costs).

Run directly, it spawns ``dist.nproc`` local ranks itself; under ``torchrun`` it runs as the rank torchrun
made (``torchrun --nproc-per-node 2 -m syncwise sft ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from ..config import ROLLOUT_ENGINES, ConfigError, config_to_dict, load_job_config
from ..config.hub import resolve_hub_ids, resolve_model_folder
from ..config.reference import sections
from ..runtime.launcher import DEBUG_ENV, launch
from ..runtime.rank_server import Gate, Worker
from ..runtime.run_folder import RunFolderLock, RunFolderRefused
from .bench import WORKLOADS, run_workload


def _split_args(values: list[str]) -> tuple[str | None, list[str]]:
    """An optional leading YAML path, then key=value overrides."""
    path = None
    if values and "=" not in values[0]:
        path, values = values[0], values[1:]
    return path, values


def _run_job(worker_path: str, args: argparse.Namespace, job: str) -> int:
    """Load and check the config, then run the job (``worker_path``, ``module:function``, is imported by its
    ranks: a config error is answered without torch), what it was given checked beside the ranks. Exit
    status: 0, 2 for a mistake found before any rank started, 1 for an error in a rank, 130 / 143 after Ctrl-C /
    SIGTERM."""
    from .preflight import PreflightError

    path, overrides = _split_args(args.args)
    try:
        config, differences = load_job_config(job, path, overrides)
        if os.environ.get("RANK", "0") == "0" and differences:
            print(f"syncwise {job}: beside the defaults: {'; '.join(differences)}", flush=True)
        resolve_hub_ids(config, job, say=os.environ.get("RANK", "0") == "0")
        payload = config_to_dict(config)
        section = job if job in ("sft", "dpo") else "train"
        key, folder = f"{section}.out_dir", getattr(config, section).out_dir
        # one job a run folder, held by the launcher (under torchrun: rank 0) until it exits
        with RunFolderLock(folder, key) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext():
            return launch(Worker(worker_path), config.dist.nproc, payload,
                          gate=Gate(Worker("syncwise.jobs.preflight:check_job"), (payload, job)))
    except (ConfigError, PreflightError, RunFolderRefused) as exc:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank checks; one says it
            kind = "config error" if isinstance(exc, ConfigError) else "error"
            print(f"syncwise: {kind}: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """The command line; its exit status. A Ctrl-C before the job's ranks exist (while the config is read or
    torch is imported) is one line and 130, as after them."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("syncwise: stopped by SIGINT before the job started; nothing was trained or saved", file=sys.stderr)
        return 128 + 2


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse takes a positional list in one run: keys after an option (`serve model.path=DIR --port 8000
    # rl.temperature=0.7`) come back unparsed, and go to the command's keys; anything else is argparse's error
    if extra:
        if not hasattr(args, "args") or not all("=" in a and not a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.args = [*args.args, *extra]
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # the ranks inherit it
    if args.command == "plan":
        return _run_plan(args)
    if args.command == "train":
        return _run_job("syncwise.rl.job:train_worker", args, "train")
    if args.command == "dpo":
        return _run_job("syncwise.jobs.dpo:dpo_worker", args, "dpo")
    if args.command == "sft":
        if args.write_example_data:
            return _write_example_data(args.write_example_data, args.task)
        return _run_job("syncwise.jobs.sft:sft_worker", args, "sft")
    if args.command == "bench":
        return run_workload(args)
    if args.command == "config":
        return _print_config(args)
    if args.command == "show":
        return _show(args)
    if args.command == "serve":
        return _serve(args)
    return 1  # pragma: no cover - argparse rejects unknown commands


def build_parser() -> argparse.ArgumentParser:
    keys_help = (f"a job's keys are section.key=value, in the sections {', '.join(sections())}; `syncwise config "
                 "[train|sft|dpo]` prints every key with its doc and default")
    parser = argparse.ArgumentParser(prog="syncwise", description=__doc__.splitlines()[0], epilog=keys_help)
    parser.add_argument("--debug", action="store_true", help="print the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="GRPO job (default: the built-in task with its recipe, configs/grpo.yaml)",
                           epilog=keys_help)
    train.add_argument("args", nargs="*", help="[config.yaml] [section.key=value ...]")
    sft = sub.add_parser("sft", help="supervised fine-tuning on a dataset or a built-in task (sft.task)",
                         epilog=keys_help)
    sft.add_argument("args", nargs="*", help="[config.yaml] [section.key=value ...]")
    sft.add_argument("--write-example-data", metavar="DIR",
                     help="write a built-in chat task as a user brings data (DIR/train.jsonl, DIR/eval.jsonl, "
                          "DIR/prompts.jsonl, DIR/model with its tokenizer and chat template) and exit")
    sft.add_argument("--task", choices=("arith_chat", "arith_tools", "arith_python", "guess_number"),
                     default="arith_chat",
                     help="with --write-example-data: arith_chat (word problems), arith_tools (the calculator, "
                          "and the same problems without it), arith_python (the python tool) or guess_number "
                          "(games of the built-in environment syncwise.environments:GuessNumber)")
    dpo = sub.add_parser("dpo", help="preference training (DPO, IPO, hinge, robust, SimPO) on TRL's preference data",
                         epilog=keys_help)
    dpo.add_argument("args", nargs="*", help="[config.yaml] model.path=DIR dpo.dataset=PAIRS [section.key=value ...]")
    config = sub.add_parser("config", help="the resolved config of a job as YAML, every key with its doc and default",
                            epilog=keys_help)
    config.add_argument("job", choices=tuple(JOB_SECTIONS), help="the job whose config: train, sft or dpo")
    config.add_argument("args", nargs="*", help="[config.yaml] [section.key=value ...]")
    serve = sub.add_parser("serve", help="an OpenAI-compatible endpoint on a model folder (an export): evaluate "
                                         "it with the agent code that trained it", epilog=keys_help)
    serve.add_argument("args", nargs="*", help="[config.yaml] model.path=DIR [section.key=value ...]")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: a free one)")
    show = sub.add_parser("show", help="a step's best and worst samples from a job's completions table")
    show.add_argument("run", help="the job's output folder (train.out_dir)")
    show.add_argument("--step", type=int, help="the step (default: the last logged)")
    show.add_argument("--best", type=int, default=2, help="how many of the highest rewards (default 2)")
    show.add_argument("--worst", type=int, default=2, help="how many of the lowest rewards (default 2)")
    bench = sub.add_parser("bench", help="time, count and measure every sync mode side by side")
    bench.add_argument("--workload", choices=tuple(WORKLOADS), default="modes",
                       help="; ".join(f"{name}: {workload.summary}" for name, workload in WORKLOADS.items()))
    bench.add_argument("--quick", action="store_true", help="the small 2-minute version")
    bench.add_argument("--nproc", type=int, default=2, help="local ranks (ignored under torchrun)")
    bench.add_argument("--out", default="runs/bench", help="folder for bench.json and bench.md")
    bench.add_argument("--presets", nargs="+", help="model presets (default qwen2-tiny qwen2-20m; grpo: one, "
                                                    "default the job's)")
    bench.add_argument("--configs", nargs="+", help="grpo workload: configurations by name (default: all), "
                                                    "e.g. 'compact sampler, balanced' 'vLLM, balanced'")
    bench.add_argument("--job", nargs="+", metavar="KEY=VALUE",
                       help="grpo workload: your own job's keys in every configuration (rl.dataset=..., "
                            "rl.environment=...); with model.path=... the warm start is skipped; regression "
                            "workload: the job both trees run")
    bench.add_argument("--variant", nargs="+", action="append", metavar="NAME KEY=VALUE",
                       help="grpo workload: a row of your own, the balanced compact sampler's with these keys "
                            "(repeatable; e.g. --variant tools 'rl.tools=[t.py:add]' --variant agent rl.agent=a.py:f)")
    bench.add_argument("--against", help="regression workload: the earlier commit (default the pinned 76f4f05)")
    bench.add_argument("--against-tree", help="regression workload: a checkout of the earlier commit instead")
    bench.add_argument("--microbatches", nargs="+", type=int, help="micro-batches per step (default 2 4 8)")
    bench.add_argument("--modes", nargs="+", help="engine sync modes (default: all but replica_deferred, + auto)")
    bench.add_argument("--no-baselines", action="store_true", help="skip the raw FSDP2 loop and the compute floor")
    bench.add_argument("--lora-rank", type=int, help="modes workload: LoRA rows with adapters of this rank "
                                                      "(default 8; 0: none)")
    bench.add_argument("--lora-modes", nargs="+", help="modes workload: sync modes of the LoRA rows")
    bench.add_argument("--trl-python", metavar="PYTHON",
                       help="dpo workload: a Python with trl installed, to run TRL's DPOTrainer beside syncwise dpo")
    bench.add_argument("--repeats", type=int, help="timed steps per configuration")
    bench.add_argument("--warmup", type=int, help="untimed rounds first")
    bench.add_argument("--seq-len", type=int, help="tokens per sample (default 64)")
    bench.add_argument("--sequences", type=int, help="rl workload: sequences per rank (default 32); dpo workload: "
                                                     "pairs per step over all ranks (default 16, TRL's 8 a device)")
    bench.add_argument("--profile", action="store_true",
                       help="rl workload: torch.profiler's top operators of one packed step, fused LM head on / off")
    plan = sub.add_parser("plan", help="what each sync mode costs for a model and cluster (no job is run)")
    _add_plan_arguments(plan)
    return parser


def _add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    """``syncwise plan``'s flags (:class:`~syncwise.memory.plan_input.PlanInput`'s fields)."""
    plan.add_argument("model", help="built-in shape (qwen3-4b, llama-3-8b, ...) or a local HF model dir / config.json")
    plan.add_argument("--world-size", type=int, default=8)
    plan.add_argument("--replicas", type=int, default=1, help="HSDP replicas (world size / replicas shards each)")
    plan.add_argument("--microbatches", type=int, default=8, help="micro-batches per optimizer step")
    plan.add_argument("--param-dtype", default="bfloat16")
    plan.add_argument("--reduce-dtype", default="float32")
    plan.add_argument("--device-memory-gib", type=float, default=80.0)
    plan.add_argument("--budget-fraction", type=float, default=0.9, help="of device memory (auto's budget)")
    plan.add_argument("--activation-gib", type=float, default=0.0, help="activation memory per rank (measured)")
    plan.add_argument("--seq-len", type=int, default=0, help="estimate activations from the shapes: tokens/sequence")
    plan.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch (with --seq-len)")
    plan.add_argument("--activation-checkpointing", action="store_true", help="each decoder layer recomputed")
    plan.add_argument("--sequence-parallel", type=int, default=1,
                      help="dist.sequence_parallel: ranks sharing each sequence (with --seq-len: every size's peak)")
    plan.add_argument("--logprob-chunk", type=int, default=1024, help="tokens per log-prob chunk (0: unchunked)")
    plan.add_argument("--fused-lm-head", default="auto", type=lambda v: {"true": True, "false": False}.get(v, v),
                      help="engine.fused_lm_head: auto (chosen with the mode, the default), true or false")
    plan.add_argument("--no-fused-lm-head", dest="fused_lm_head", action="store_false",
                      help="engine.fused_lm_head=false: the [tokens, vocabulary] logits and their gradient exist")
    plan.add_argument("--auto-cap", action="store_true",
                      help="engine.max_tokens_per_micro_batch=auto: the step's --microbatches x --micro-batch-size "
                           "sequences of --seq-len split under the cap auto chooses with the mode")
    plan.add_argument("--compute-tflops", type=float, default=400.0,
                      help="dense matmul TFLOP/s per rank: what the fused head's extra compute costs (auto)")
    plan.add_argument("--lora-rank", type=int, default=0,
                      help="LoRA adapters of this rank on every linear projection (0: the whole model trains)")
    plan.add_argument("--rollout-sequences", type=int, default=0,
                      help="GRPO: sequences each rank samples at once (prompts x samples; 0: no rollout copy)")
    plan.add_argument("--rollout-prompt-len", type=int, default=0, help="GRPO: prompt tokens per sequence")
    plan.add_argument("--rollout-new-tokens", type=int, default=0, help="GRPO: rl.max_new_tokens")
    plan.add_argument("--rollout-dtype", default="float32", help="GRPO: the rollout copy's dtype")
    plan.add_argument("--rollout-sampler", default="compact",
                      help=f"GRPO: rl.rollout_engine ({', '.join(ROLLOUT_ENGINES)})")
    plan.add_argument("--rollout-ranks", type=int, default=0,
                      help="GRPO: dist.rollout_ranks -- the last of --world-size ranks only sample (a plan per role)")
    plan.add_argument("--critic", action="store_true",
                      help="PPO: a value model beside the policy (both models' bytes per mode, auto's pair)")
    plan.add_argument("--bandwidth-gbps", type=float, default=100.0, help="GB/s per rank in a shard group")
    plan.add_argument("--replica-bandwidth-gbps", type=float, help="GB/s across replicas (HSDP)")
    plan.add_argument("--latency-us", type=float, default=10.0)
    plan.add_argument("--calibrate", action="store_true",
                      help="measure latency and bandwidth with a sweep of collectives on --nproc local ranks")
    plan.add_argument("--nproc", type=int, default=2, help="local ranks for --calibrate")
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _write_example_data(folder: str, task: str = "arith_chat") -> int:
    from ..sft.tasks import write_example_data

    out = write_example_data(folder, task=task)
    extra = ""
    if task == "arith_tools":
        extra = (f"; {out / 'train_no_tools.jsonl'}, {out / 'eval_no_tools.jsonl'} and "
                 f"{out / 'prompts_no_tools.jsonl'} are the same problems without the tool")
    elif task == "arith_chat":
        extra = f"; {out / 'pairs.jsonl'} and {out / 'eval_pairs.jsonl'} are preference pairs for syncwise dpo"
    print(f"syncwise sft: wrote {out / 'train.jsonl'}, {out / 'eval.jsonl'} (chat messages), {out / 'prompts.jsonl'} "
          f"(prompts and answers for GRPO) and {out / 'model'} (an untrained model with its tokenizer and chat "
          f"template){extra}; train on them with\n"
          f"  syncwise sft model.path={out / 'model'} sft.dataset={out / 'train.jsonl'} "
          f"sft.eval_dataset={out / 'eval.jsonl'}", flush=True)
    return 0


# The sections a job's config shows (the other job's own are left out)
JOB_SECTIONS = {"train": ("model", "engine", "sync", "optim", "dist", "rl", "critic", "train"),
                "sft": ("model", "engine", "sync", "optim", "dist", "sft"),
                "dpo": ("model", "engine", "sync", "optim", "dist", "dpo")}


def _print_config(args: argparse.Namespace) -> int:
    """``syncwise config [train|sft|dpo] [config.yaml] [overrides]``: what the job would run with."""
    from ..config.reference import describe

    path, overrides = _split_args(args.args)
    try:
        config, differences = load_job_config(args.job, path, overrides, runnable=False)
    except ConfigError as exc:
        print(f"syncwise: config error: {exc}", file=sys.stderr)
        return 2
    print(describe(config, args.job, JOB_SECTIONS[args.job]))
    if differences:
        print(f"# beside the defaults: {'; '.join(differences)}")
    if args.job == "train" and (missing := config.rl.missing_scorer()):
        print(f"# before syncwise train can run it: {missing}")
    return 0


def _show(args: argparse.Namespace) -> int:
    """``syncwise show RUN [--step N]``: the step's samples, best and worst, from ``RUN/completions``."""
    from ..logs.completions import view

    try:
        print(view(args.run, args.step, args.best, args.worst))
    except (ValueError, OSError) as exc:
        print(f"syncwise show: {exc}", file=sys.stderr)
        return 2
    return 0


def _serve(args: argparse.Namespace) -> int:
    """``syncwise serve model.path=DIR``: until Ctrl-C (exit 130)."""
    path, overrides = _split_args(args.args)
    try:
        config, _ = load_job_config("serve", path, overrides)
        config.model.path = resolve_model_folder(config.model.path, "model.path")
        if not config.model.path:
            raise ConfigError("model.path: syncwise serve needs a model folder (a job's export, or save_pretrained's)")
        if not Path(config.model.path).is_dir():
            raise ConfigError(f"model.path: no such folder: {config.model.path} (syncwise serve takes a model "
                              "folder: a job's export, or save_pretrained's)")
    except ConfigError as exc:
        print(f"syncwise: config error: {exc}", file=sys.stderr)
        return 2
    from ..rl.serve import serve

    try:
        serve(config, args.host, args.port, ready=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print("syncwise serve: stopped", file=sys.stderr)
        return 130
    except (OSError, ValueError) as exc:
        print(f"syncwise serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from ..memory.plan_input import PlanInput  # torch-free: a bad argument is answered at once

    fields = {k: v for k, v in vars(args).items() if k not in ("command", "json", "debug", "calibrate", "nproc")}
    try:
        inp = PlanInput(**fields)
        inp.validate()
        from ..memory.plan import format_plan, load_hf_config, make_plan, plan_to_json

        hf_config = load_hf_config(inp.model)  # a wrong model name fails before any sweep
        if args.calibrate and args.nproc < 2:
            raise ValueError(f"--calibrate needs --nproc >= 2, got {args.nproc}")
        links = None
        if args.calibrate:
            from ..memory.calibrate import calibrate_here

            links, _ = calibrate_here(args.nproc)
        plan = make_plan(inp, hf_config=hf_config, links=links)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"syncwise plan: {exc}", file=sys.stderr)
        return 2
    print(plan_to_json(plan) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
