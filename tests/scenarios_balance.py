"""Run on 2 gloo ranks by test_balance.py: samples moved between ranks (``rl.balance_ranks``) and groups
without signal left out (``rl.skip_uniform_groups``), with the gradients they give."""

from __future__ import annotations

import torch

from scenarios import VOCAB, engine_config, full_grads
from syncwise.config import PolicyLossConfig
from syncwise.engine import Engine
from syncwise.models import build_model
from syncwise.rl.algorithm.advantages import grpo_advantages, uniform_groups
from syncwise.rl.algorithm.balance import balance_ranks, select_trained_rows, take_rows
from syncwise.rl.algorithm.losses import make_policy_loss

GROUP = 4
TIMEOUT_S = 120.0


def rollout_batch(rank: int, groups: int, seed: int, uniform: set[int] = frozenset()) -> tuple[dict, torch.Tensor]:
    """A right-padded batch as the rollout returns it, skewed on purpose: rank 0's responses are long
    (20-120 tokens, a long tail), rank 1's short (2-12). Rewards in {0, 0.5, 1}; groups in ``uniform`` get
    one reward for all their samples, the others at least two different ones.
    Returns (batch with GRPO advantages and sampler log-probs, rewards)."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    size = groups * GROUP
    if rank == 0:
        tail = -25.0 * torch.log(torch.rand(size, generator=gen))  # exponential, mean 25
        responses = (20 + tail.clamp(max=100)).long()
    else:
        responses = torch.randint(2, 13, (size,), generator=gen)
    lengths = 4 + responses  # a 4-token prompt
    width = int(lengths.max())
    positions = torch.arange(width)[None]
    attention = (positions < lengths[:, None]).long()
    loss_mask = attention * (positions >= 4).long()
    rewards = torch.randint(0, 3, (size,), generator=gen).double() / 2
    for g in range(groups):
        if g in uniform:
            rewards[g * GROUP : (g + 1) * GROUP] = rewards[g * GROUP]
        else:  # signal: at least two rewards differ
            rewards[g * GROUP : g * GROUP + 2] = torch.tensor([0.0, 1.0])
    batch = {
        "input_ids": torch.randint(1, VOCAB, (size, width), generator=gen) * attention,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "advantages": grpo_advantages(rewards, GROUP, norm_by_std=True).float(),
        "rollout_log_probs": -torch.rand(size, width - 1, generator=gen) * loss_mask[:, 1:],
    }
    return batch, rewards


def _grads(engine: Engine, batch: dict, loss) -> dict[str, torch.Tensor]:
    engine.optimizer.zero_grad(set_to_none=True)
    engine.forward_backward_batch(batch, loss)
    grads = full_grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)
    return grads


def balance_suite(info) -> dict:
    torch.manual_seed(0)
    cfg = engine_config("fsdp2", "deferred", "engine.micro_batch_size=4")
    engine = Engine(cfg, build_model(cfg.model), info)
    loss = make_policy_loss(PolicyLossConfig())  # PPO clip, token-mean over the global batch
    out = {}

    batch, _ = rollout_batch(info.rank, groups=8, seed=1)
    balanced, balance = balance_ranks(batch, pad_id=0, min_rows=1, timeout_s=TIMEOUT_S)
    out["balance"] = {"batch": batch, "balanced": balanced, "stats": balance,
                      "grads": _grads(engine, batch, loss), "balanced_grads": _grads(engine, balanced, loss)}
    # Fewer rows per rank than asked for: nothing moves.
    _, refused = balance_ranks(batch, pad_id=0, min_rows=10_000, timeout_s=TIMEOUT_S)
    out["refused"] = refused
    # Already balanced: nothing moves.
    out["again"] = balance_ranks(balanced, pad_id=0, min_rows=1, timeout_s=TIMEOUT_S)[1]
    # A gain below rl.balance_min_gain: nothing moves, and the batch is this rank's own.
    kept, out["small_gain"] = balance_ranks(batch, pad_id=0, min_rows=1, timeout_s=TIMEOUT_S,
                                            min_gain=out["balance"]["stats"].before - 1.0 + 0.01)
    out["small_gain_kept"] = kept is batch

    # Uniform groups: rank 0 has signal in half its groups, rank 1 in none (it keeps one masked row).
    uniform = {0, 2, 4, 6} if info.rank == 0 else set(range(8))
    batch, rewards = rollout_batch(info.rank, groups=8, seed=2, uniform=uniform)
    uniform_mask = uniform_groups(rewards, GROUP)
    selection = select_trained_rows(uniform_mask, GROUP, min_rows=1, device=info.device, timeout_s=TIMEOUT_S)
    selected = take_rows(batch, selection)
    out["skip"] = {"batch": batch, "selected": selected, "rows": selection.rows, "masked": selection.masked,
                   "uniform_groups": int(uniform_mask.sum()), "groups": len(uniform_mask),
                   "grads": _grads(engine, batch, loss), "selected_grads": _grads(engine, selected, loss)}
    # Every group of every rank uniform: every row trains, as without the option.
    batch, rewards = rollout_batch(info.rank, groups=2, seed=3, uniform={0, 1})
    everything = select_trained_rows(uniform_groups(rewards, GROUP), GROUP, min_rows=1, device=info.device,
                                     timeout_s=TIMEOUT_S)
    out["all_uniform"] = {"rows": everything.rows, "masked": everything.masked}
    return out
