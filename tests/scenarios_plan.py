"""The engine's measured memory peaks, to hold `syncwise plan`'s predictions against (test_plan.py)."""

from __future__ import annotations

import torch

from syncwise.config import load_config
from syncwise.engine import Engine
from syncwise.losses import sft_loss
from syncwise.models import build_model, preset_config

# (preset, tokens per sequence, sequences per micro-batch, activation checkpointing, fused LM head)
PEAK_SHAPES = [("qwen2-test", 128, 2, False, True), ("qwen2-test", 128, 2, False, False),
               ("qwen2-tiny", 64, 2, False, True), ("llama-test", 96, 2, True, True),
               ("qwen3-moe-test", 128, 2, False, True)]  # a mixture of experts: its k experts' activations
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


# (preset, tokens per sequence, sequences per micro-batch): PPO's actor and critic side by side
PPO_PEAK_SHAPES = [("qwen2-test", 128, 2), ("qwen2-tiny", 64, 2)]


def measured_ppo_peaks(info) -> list[dict]:
    """Each shape's actor and critic, built side by side in one process and stepped in turn (per_microbatch,
    fp32): each step's measured peak plus what the other model holds at that moment (its parameters and
    AdamW state, measured from its tensors) -- the peak with both models in memory."""
    from dataclasses import replace

    from syncwise.rl.algorithm.losses import ValueLossConfig, make_value_loss

    out = []
    for preset, seq_len, size in PPO_PEAK_SHAPES:
        cfg = load_config(None, [
            f"model.preset={preset}", "sync.mode=per_microbatch", f"engine.micro_batch_size={size}",
            "sync.peak_every=1", "rl.algorithm=ppo",
        ])
        actor = Engine(cfg, build_model(cfg.model), info)
        critic_cfg = cfg.critic_config()
        critic = Engine(critic_cfg, build_model(replace(critic_cfg.model, dropout="off"), value_head=True), info)
        vocab = preset_config(preset).vocab_size
        generator = torch.Generator().manual_seed(info.rank)
        ids = torch.randint(1, vocab, (MICROBATCHES * size, seq_len), generator=generator)
        targets = torch.randn(ids.shape[0], seq_len - 1, generator=generator)
        value_batch = {"input_ids": ids, "returns": targets, "values": targets * 0.5}
        value_loss = make_value_loss(ValueLossConfig(clip=0.5))
        for _ in range(2):  # the second steps: both optimizers' state exists
            actor_metrics = actor.train_batch({"input_ids": ids}, sft_loss)
            actor_held = critic.resident_bytes()
            critic_metrics = critic.train_batch(value_batch, value_loss)
            critic_held = actor.resident_bytes()
        out.append({"shape": (preset, seq_len, size),
                    "actor": actor_metrics["memory/peak_bytes"] + actor_held,
                    "critic": critic_metrics["memory/peak_bytes"] + critic_held})
    return out
