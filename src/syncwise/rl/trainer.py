"""``syncwise train``: GRPO end to end -- rollouts, rewards, group advantages, the actor update through the
engine, checkpoints, logs, plots and a Hugging Face export.

One step on every rank::

    rows = prompts for (step, rank)          deterministic: a resumed run sees the same prompts
    rollout.sync_weights(); generate         samples_per_prompt responses per prompt, local, no collectives
    rewards -> group advantages              GRPO / Dr.GRPO / RLOO within each prompt's group
    [ref log-probs]                          forward-only pass of a frozen reference (rl.kl_coef > 0)
    engine.train_batch(batch, policy loss)   micro-batched, sync mode from config (auto by default)
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from ..checkpoint import CheckpointManager, export_hf
from ..config import Config, config_to_dict, load_config_dict
from ..distributed import DistInfo, init_distributed, run_rank
from ..engine import Engine
from ..metrics import JsonlLogger, TensorBoardLogger, plot_curves
from ..models import build_model
from .advantages import grpo_advantages, rloo_advantages
from .losses import PolicyLossConfig, make_policy_loss
from .rollout import Rollout
from .tasks import builtin_tokenizer, prompt_source


class TrainingStopped(RuntimeError):
    """Training could not go on (e.g. too many non-finite steps in a row); a checkpoint was written."""


def load_tokenizer(config: Config):
    from transformers import AutoTokenizer

    path = config.rl.tokenizer or config.model.path
    if path:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    return builtin_tokenizer()


def advantages_for(rewards: torch.Tensor, config: Config) -> torch.Tensor:
    n = config.rl.samples_per_prompt
    if config.rl.advantage == "rloo":
        return rloo_advantages(rewards, n)
    return grpo_advantages(rewards, n, norm_by_std=config.rl.advantage == "grpo")


def _global_stats(rewards: torch.Tensor, lengths: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Reward and response-length statistics over every rank's samples (one small all-reduce)."""
    local = torch.tensor(
        [rewards.sum(), (rewards**2).sum(), float(len(rewards)), lengths.float().sum(), (rewards >= 1).sum()],
        dtype=torch.float64, device=device,
    )
    if dist.is_initialized():
        dist.all_reduce(local)
    total, squares, count, length, solved = local.tolist()
    mean = total / count
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(squares / count - mean * mean, 0.0)),
        "reward/solved_fraction": solved / count,
        "response/length_mean": length / count,
    }


def run_grpo(config: Config, info: DistInfo | None = None) -> list[dict[str, Any]]:
    """Train; rank 0 returns (and logs) every step's metrics."""
    info = info or init_distributed(config.dist.backend, config.dist.timeout_s)
    train, rl = config.train, config.rl
    out_dir = Path(train.out_dir)
    torch.manual_seed(train.seed * 1000 + info.rank)
    random.seed(train.seed * 1000 + info.rank)

    tokenizer = load_tokenizer(config)
    source = prompt_source(rl.task, rl.dataset, rl.reward_fn)
    overrides = {} if config.model.path else {"vocab_size": len(tokenizer)}
    engine = Engine(config, build_model(config.model, **overrides), info, total_steps=train.steps)
    reference = None
    if rl.kl_coef > 0:
        reference = Engine(config, build_model(config.model, **overrides), info, trainable=False)
    rollout = Rollout(engine, tokenizer, rl)
    loss_fn = make_policy_loss(PolicyLossConfig(
        kind=rl.loss, clip_low=rl.clip_low, clip_high=rl.clip_high, agg=rl.loss_agg,
        entropy_coef=rl.entropy_coef, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator,
    ))
    checkpoints = CheckpointManager(out_dir / "checkpoints")
    start = 0
    resume_from = checkpoints.resolve(train.resume)
    if resume_from is not None:
        start = int(checkpoints.load(resume_from, engine)["step"])

    loggers: list[Any] = []
    bar = None
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config)))
        loggers.append(JsonlLogger(out_dir / "metrics.jsonl"))
        if train.logger == "tensorboard":
            loggers.append(TensorBoardLogger(out_dir / "tensorboard"))
        print(
            f"syncwise train: GRPO on {rl.dataset or 'task ' + rl.task}, {config.engine.strategy} on "
            f"{info.world_size} rank(s), {rl.prompts_per_rank} prompts x {rl.samples_per_prompt} samples per "
            f"rank, sync.mode={config.sync.mode}"
            + (f", resumed from {resume_from} at step {start}" if resume_from else ""),
            flush=True,
        )
        if train.progress:
            from tqdm import tqdm

            bar = tqdm(total=train.steps, initial=start, desc="grpo", dynamic_ncols=True)

    history: list[dict[str, Any]] = []
    consecutive_skips = 0
    for step in range(start, train.steps):
        started = time.perf_counter()
        rows = source.batch(step, info.rank, info.world_size, rl.prompts_per_rank)
        rollout.sync_weights()
        batch, sampled = rollout.generate(rows, source)
        batch["advantages"] = advantages_for(sampled["rewards"], config)
        if reference is not None:
            batch["ref_log_probs"] = reference.eval_batch(batch).outputs["log_probs"]
        metrics = engine.train_batch(batch, loss_fn)
        metrics.update(_global_stats(sampled["rewards"], sampled["response_lengths"], info.device))
        metrics["train/step"] = step + 1
        metrics["time/step_s"] = time.perf_counter() - started
        consecutive_skips = consecutive_skips + 1 if metrics["train/skipped"] else 0
        if info.is_main:
            for logger in loggers:
                logger.log(metrics)
            history.append(metrics)
            if bar is not None:
                bar.set_postfix_str(
                    f"reward {metrics['reward/mean']:.3f} loss {metrics['loss']:.4f} "
                    f"gn {metrics['train/grad_norm']:.2f} AG {metrics['comm/all_gather_count']} "
                    f"RS {metrics['comm/reduce_scatter_count']} AR {metrics['comm/all_reduce_count']} "
                    f"{metrics['sync/mode']}"
                )
                bar.update(1)
        done = step + 1
        if consecutive_skips >= train.max_consecutive_skips:
            path = checkpoints.save(done, engine, {"step": done})
            raise TrainingStopped(
                f"{consecutive_skips} consecutive steps had a non-finite gradient norm (last at step {done}); "
                f"stopped, checkpoint at {path}"
            )
        if (train.checkpoint_every and done % train.checkpoint_every == 0) or done == train.steps:
            checkpoints.save(done, engine, {"step": done})
    if bar is not None:
        bar.close()
    if train.export:
        export_hf(engine, tokenizer, out_dir / "export")
    if info.is_main:
        for logger in loggers:
            logger.close()
        if history:
            plot_curves(history, out_dir / "curves.png")
            _print_summary(history, out_dir)
    return history


def _print_summary(history: list[dict[str, Any]], out_dir: Path) -> None:
    window = min(10, len(history))
    first = sum(m["reward/mean"] for m in history[:window]) / window
    last = sum(m["reward/mean"] for m in history[-window:]) / window
    print(
        f"mean reward: first {window} steps {first:.3f}, last {window} steps {last:.3f}; "
        f"metrics {out_dir / 'metrics.jsonl'}, plot {out_dir / 'curves.png'}",
        flush=True,
    )


def train_worker(config_dict: dict[str, Any]) -> None:
    """Entry point of one rank (picklable, for the local launcher and torchrun)."""
    config = load_config_dict(config_dict)
    run_rank(lambda info: run_grpo(config, info), backend=config.dist.backend, timeout_s=config.dist.timeout_s)
