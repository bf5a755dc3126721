"""The engine's measured memory peaks, to hold `syncwise plan`'s predictions against (test_plan.py)."""

from __future__ import annotations

import torch

from syncwise.config import load_config
from syncwise.engine import Engine
from syncwise.losses import sft_loss
from syncwise.models import build_model, preset_config

# (preset, tokens per sequence, sequences per micro-batch, activation checkpointing, fused LM head)
PEAK_SHAPES = [("qwen2-test", 128, 2, False, True), ("qwen2-test", 128, 2, False, False),
               ("qwen2-tiny", 64, 2, False, True), ("llama-test", 96, 2, True, True)]
MICROBATCHES = 4


def measured_peaks(info) -> list[dict]:
    """Each shape's steady-state peak: the second step (AdamW's state exists by then), per_microbatch, fp32."""
    out = []
    for preset, seq_len, size, checkpointing, fused in PEAK_SHAPES:
        cfg = load_config(None, [
            f"model.preset={preset}", "sync.mode=per_microbatch", f"engine.micro_batch_size={size}",
            f"engine.activation_checkpointing={str(checkpointing).lower()}", "sync.peak_every=1",
            f"engine.fused_lm_head={str(fused).lower()}",
        ])
        engine = Engine(cfg, build_model(cfg.model), info)
        vocab = preset_config(preset).vocab_size
        generator = torch.Generator().manual_seed(info.rank)
        ids = torch.randint(1, vocab, (MICROBATCHES * size, seq_len), generator=generator)
        engine.train_batch({"input_ids": ids}, sft_loss)
        metrics = engine.train_batch({"input_ids": ids}, sft_loss)
        assert metrics["memory/peak_measured"] == 1 and metrics["train/num_microbatches"] == MICROBATCHES
        out.append({"shape": (preset, seq_len, size, checkpointing, fused), "peak": metrics["memory/peak_bytes"]})
    return out
