"""The built-in SFT job: a synthetic sequence task a tiny model learns in seconds, trained through the engine.

Each sample is an arithmetic progression modulo a small alphabet (``a, a+d, a+2d, ...``) of random length,
right-padded. The first two tokens fix ``a`` and ``d``, so only later tokens carry loss: a model that
learns the rule drives the loss towards zero, which makes a broken gradient path easy to see.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from ..config import Config, SFTConfig, config_to_dict, load_config_dict
from ..engine import Engine
from ..losses import sft_loss
from ..metrics import JsonlLogger, format_step
from ..runtime.distributed import DistInfo, init_distributed, run_rank
from ..runtime.signals import stopped

PAD_ID = 0
ALPHABET = 64  # progressions live in token ids 1..64


def progression_batch(cfg: SFTConfig, step: int, rank: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """This rank's share of step ``step``: ``cfg.batch_size`` samples, deterministic in (seed, step, rank)."""
    alphabet = min(ALPHABET, vocab_size - 1)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
    n = cfg.batch_size
    lengths = torch.randint(cfg.min_len, cfg.max_len + 1, (n,), generator=gen)
    start = torch.randint(0, alphabet, (n, 1), generator=gen)
    stride = torch.randint(1, 5, (n, 1), generator=gen)
    positions = torch.arange(cfg.max_len).unsqueeze(0)
    tokens = (start + stride * positions) % alphabet + 1
    attention_mask = (positions < lengths.unsqueeze(1)).long()
    input_ids = torch.where(attention_mask.bool(), tokens, torch.full_like(tokens, PAD_ID))
    loss_mask = attention_mask.clone()
    loss_mask[:, :2] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def run_sft(config: Config, info: DistInfo | None = None) -> list[dict[str, Any]]:
    """Train ``config.sft.steps`` steps; rank 0 prints each step and appends it to ``metrics.jsonl``."""
    info = info or init_distributed(config.dist.backend, config.dist.timeout_s)
    engine = Engine(config, info=info)
    vocab_size = engine.features.hf_config.vocab_size
    out_dir = Path(config.sft.out_dir)
    logger = None
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config)))
        logger = JsonlLogger(out_dir / "metrics.jsonl")
        print(
            f"syncwise sft: {config.engine.strategy} on {info.world_size} rank(s), sync.mode="
            f"{config.sync.mode}, micro_batch_size={config.engine.micro_batch_size}, "
            f"{engine.wrapped.num_units} FSDP units",
            flush=True,
        )
    history = []
    for step in range(config.sft.steps):
        batch = progression_batch(config.sft, step, info.rank, vocab_size)
        metrics = engine.train_batch(batch, sft_loss)
        history.append(metrics)
        if logger is not None:
            logger.log(metrics)
            if step % config.sft.log_every == 0 or step == config.sft.steps - 1:
                print(format_step(metrics, config.sft.steps), flush=True)
        if metrics["stop/signal"]:  # agreed by every rank
            if logger is not None:
                logger.close()
            raise stopped(metrics["stop/signal"], step + 1, config.sft.steps, f"metrics in {out_dir / 'metrics.jsonl'}")
    if logger is not None:
        logger.close()
        first, last = history[0]["loss"], history[-1]["loss"]
        print(f"loss {first:.4f} -> {last:.4f}; metrics in {out_dir / 'metrics.jsonl'}", flush=True)
    return history


def sft_worker(config_dict: dict[str, Any]) -> None:
    """Entry point of one rank (picklable, for the local launcher)."""
    config = load_config_dict(config_dict)
    run_rank(lambda info: run_sft(config, info), backend=config.dist.backend, timeout_s=config.dist.timeout_s)
