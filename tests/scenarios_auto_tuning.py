"""``engine.fused_lm_head=auto`` and ``engine.max_tokens_per_micro_batch=auto`` chosen with the sync mode on
real ranks (test_auto_tuning.py): each rank's long-tailed sequences differ, the defaults choose."""

from __future__ import annotations

import torch

from syncwise.config import load_config
from syncwise.engine import Engine
from syncwise.losses import sft_loss
from syncwise.models import build_model, preset_config

PRESET = "qwen2-tiny"
KEYS = ("sync/mode", "engine/fused_lm_head", "engine/max_tokens_per_micro_batch", "train/num_microbatches",
        "memory/peak_bytes", "memory/peak_measured", "memory/predicted_peak_bytes", "memory/budget_bytes",
        "sync/decision", "batch/largest_microbatch_tokens")


def long_tailed_batch(rank: int, sequences: int = 16) -> dict[str, torch.Tensor]:
    """Right-padded rows of log-normal lengths (median 96, 16..512 tokens), different on every rank."""
    gen = torch.Generator().manual_seed(7 + rank)
    lengths = torch.exp(torch.log(torch.tensor(96.0)) + 1.5 * torch.randn(sequences, generator=gen))
    lengths = lengths.round().clamp(16, 512).long()
    width = int(lengths.max())
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(1, preset_config(PRESET).vocab_size, (sequences, width), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask}


def _steps(engine: Engine, batch, count: int) -> list[dict]:
    out = []
    for _ in range(count):
        metrics = engine.train_batch(batch, sft_loss)
        out.append({k: metrics.get(k) for k in KEYS})
    return out


def tuned_runs(info, budgets: list[int]) -> dict:
    """Six steps under each budget (bytes; 0: 90% of the machine) with the defaults, the first budget twice
    (the same job again) and once with ``sync.auto_timing=true``; then, under the first budget with every
    step's peak measured, memory held outside after the decision (a later peak over the budget), which must
    step down."""
    batch = long_tailed_batch(info.rank)
    out: dict = {"runs": {}}
    for budget in budgets:  # the step after the decision is measured
        cfg = load_config(None, [f"model.preset={PRESET}", f"sync.memory_budget={budget}"])
        engine = Engine(cfg, build_model(cfg.model), info)
        out["runs"][budget] = _steps(engine, batch, 6)
    cfg = load_config(None, [f"model.preset={PRESET}", f"sync.memory_budget={budgets[0]}"])
    out["again"] = _steps(Engine(cfg, build_model(cfg.model), info), batch, 6)
    cfg = load_config(None, [f"model.preset={PRESET}", f"sync.memory_budget={budgets[0]}", "sync.auto_timing=true"])
    out["timed"] = _steps(Engine(cfg, build_model(cfg.model), info), batch, 6)  # decide, measure, time 3 caps
    cfg = load_config(None, [f"model.preset={PRESET}", "sync.peak_every=1", f"sync.memory_budget={budgets[0]}"])
    engine = Engine(cfg, build_model(cfg.model), info)
    decided = _steps(engine, batch, 2)
    # memory held outside from now on leaves a budget halfway between the first step's peak and the chosen
    # setting's: the next peak is over it
    halfway = (decided[0]["memory/peak_bytes"] + decided[1]["memory/peak_bytes"]) // 2
    engine.governor.hold_outside(engine.governor.own_budget - halfway)
    out["stepped"] = decided + _steps(engine, batch, 3)
    out["stepped_candidates"] = [s.label for s in engine.governor.auto.candidates]
    return out
