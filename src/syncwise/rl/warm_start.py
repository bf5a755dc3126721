"""``rl.warm_start_steps``: supervised steps on the task's answers before RL, and the models RL then starts
from. The warm-started policy is what RL starts from, so after the steps:

- the frozen KL reference is set to it (``rl.loss.kl_coef``, ``rl.kl_in_reward``): the KL pulls toward the
  policy RL began with, not toward the model before the warm start;
- with LoRA (whose reference is the base model with the adapters switched off) the warm-started adapters are
  merged into the base and restart at zero (B = 0: the same function), so the base *is* the policy RL starts
  from;
- a critic of the policy's own weights starts its decoder from it (as one built from an SFT checkpoint would).

Each model whose frozen weights changed this way keeps them in its checkpoints (a LoRA base with
``Engine.checkpoint_frozen``; the frozen reference as one more engine of the checkpoint), so a resumed job --
which rebuilds every model from ``model.path`` / the preset and skips the warm start -- continues exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import Config
from ..engine import Engine
from ..engine.weights import load_plain_weights
from ..losses import sft_loss
from .rollout.front import response_batch


def warm_start_batch(rows: list[dict[str, Any]], source, tokenizer) -> dict[str, torch.Tensor]:
    """Prompts with the task's correct responses; loss on the response and its end-of-sequence token."""
    sequences, masks = [], []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        response = tokenizer(source.demonstration(row))["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(torch.tensor(prompt + response))
        masks.append(torch.tensor([0] * len(prompt) + [1] * len(response)))
    return response_batch(sequences, masks, tokenizer.pad_token_id)


def warm_start_step(engine: Engine, rows: list[dict[str, Any]], source, tokenizer) -> dict[str, Any]:
    """One supervised step through the policy's engine; its metrics."""
    return engine.train_batch(warm_start_batch(rows, source, tokenizer), sft_loss)


def critic_from_policy(config: Config) -> bool:
    """A PPO critic built from the policy's own weights (no ``critic.model.path`` / ``preset`` of its own)."""
    return config.rl.algorithm == "ppo" and not {"path", "preset"} & set(config.critic.model)


def keep_changed_bases(config: Config, actor: Engine, critic: Engine | None, uses_reference: bool) -> None:
    """Before any checkpoint is written or read: which LoRA bases the warm start changes, so their
    checkpoints hold them (alike in the job that warm-starts and in the job that resumes it)."""
    if not config.rl.warm_start_steps:
        return
    actor.checkpoint_frozen = actor.features.lora and uses_reference
    if critic is not None:
        critic.checkpoint_frozen = critic.features.lora and critic_from_policy(config)


def start_from_policy(config: Config, actor: Engine, reference: Engine | None, critic: Engine | None,
                      uses_reference: bool) -> list[str]:
    """Collective, after the warm start: the reference, a LoRA actor's base and a critic of the policy's weights
    set to the warm-started policy (the module docstring); returns a phrase for each, for the job's line."""
    policy = actor.full_model_state()  # plain names, LoRA merged: the policy RL starts from
    notes = []
    if reference is not None:
        notes.append(f"the KL reference is it ({load_plain_weights(reference.model, policy)} tensors)")
    elif uses_reference and actor.features.lora:
        copied = load_plain_weights(actor.model, policy, zero_adapters=True)
        actor.optimizer.state.clear()  # the adapters start again, at zero, on the new base
        notes.append(f"its LoRA adapters are merged into the base, the KL reference ({copied} tensors), and "
                     "restart at zero")
    if critic is not None and critic_from_policy(config):
        notes.append(f"the critic's decoder starts from it ({load_plain_weights(critic.model, policy)} tensors)")
    return notes
