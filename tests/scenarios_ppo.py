"""PPO's critic on every rank of a real process group (W=2 FSDP2): values through the engine, GAE and the
whitening across ranks, and the value loss's gradients in every sync mode."""

from __future__ import annotations

from dataclasses import replace

import torch

from scenarios import engine_config, full_grads, make_batch
from syncwise.engine import Engine
from syncwise.losses import Normalizer, target_mask
from syncwise.models import build_model, value_head_of
from syncwise.rl.algorithm.losses import ValueLossConfig, make_value_loss
from syncwise.rl.algorithm.ppo import ppo_advantages, value_outputs

CRITIC_MODES = {
    "per_microbatch": ("per_microbatch", ()),
    "deferred": ("deferred", ()),
    "deferred_unsharded": ("deferred_unsharded", ()),
    "partial_1": ("partial", ("sync.deferred_units=1",)),
}
VALUE_LOSS = ValueLossConfig(clip=0.5)


def value_model(cfg):
    """The critic qwen2-test builds, its zero head replaced by a seeded random one (so that the decoder gets a
    gradient in the first step, and the values are not all zero); dropout off, as the trainer builds it (the
    token-classification head brings a dropout of 0.1)."""
    model = build_model(replace(cfg.model, dropout="off"), value_head=True)
    head = value_head_of(model)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(11)) * 0.5)
    return model


def ppo_batch(seed: int, size: int = 6, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """A padded batch whose loss mask covers a response after a prompt of 3 tokens, with sequence rewards and
    (for the value loss) old values and returns."""
    batch = make_batch(seed, size, seq_len)
    gen = torch.Generator().manual_seed(seed + 1)
    batch["rewards"] = torch.rand(size, generator=gen)
    batch["values"] = torch.randn(size, seq_len - 1, generator=gen) * 0.5
    batch["returns"] = torch.randn(size, seq_len - 1, generator=gen)
    return batch


def gae_case(info) -> dict:
    """Values from the critic's engine (packed, 2 sequences per micro-batch, this rank's share of the batch),
    then token rewards, GAE and the whitening over both ranks (``ppo_advantages``)."""
    cfg = engine_config("fsdp2", "per_microbatch", "rl.algorithm=ppo", "rl.gamma=0.95", "rl.lam=0.9")
    engine = Engine(cfg, value_model(cfg), info)
    batch = ppo_batch(seed=500 + info.rank)
    batch["values"] = engine.forward_batch(batch, value_outputs).outputs["values"]
    advantages, returns, metrics = ppo_advantages(batch, cfg, info)
    return {"batch": batch, "advantages": advantages, "returns": returns, "metrics": metrics}


def critic_step(info, mode: str, *extra: str) -> dict:
    """The value loss over 3 micro-batches in ``mode``: the gradients before the step, then a full step
    (counted and checked against the mode's formula)."""
    cfg = engine_config("fsdp2", mode, *extra)
    engine = Engine(cfg, value_model(cfg), info)
    loss_fn = make_value_loss(VALUE_LOSS)
    batch = ppo_batch(seed=600 + info.rank)
    engine.forward_backward_batch(batch, loss_fn)
    grads = full_grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.train_batch(batch, loss_fn)
    return {"grads": grads, "metrics": metrics, "value_head": engine.features.value_head,
            "fused_head": engine.features.fused_head, "packing": engine.features.packing}


def full_batch_value_grads(world_size: int) -> dict[str, torch.Tensor]:
    """The value loss's gradients over every rank's batch at once, in one plain process."""
    cfg = engine_config("none", "deferred")
    model = value_model(cfg)
    batches = [ppo_batch(seed=600 + r) for r in range(world_size)]
    batch = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    mask = target_mask(batch)
    norm = Normalizer(tokens=float(mask.sum()), sequences=float((mask.sum(1) > 0).sum()), dp_size=1)
    make_value_loss(VALUE_LOSS)(out, batch, norm).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def plain_values(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The values of every rank's batch in one plain forward (no FSDP, no packing)."""
    cfg = engine_config("none", "deferred")
    model = value_model(cfg).eval()
    batch = {k: torch.cat([b[k] for b in batches]) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return model(**batch).logits[:, :-1, 0]


def ppo_suite(info) -> dict:
    out: dict = {"gae": gae_case(info)}
    for name, (mode, extra) in CRITIC_MODES.items():
        out[("critic", name)] = critic_step(info, mode, *extra)
    if info.rank == 0:
        out["reference_grads"] = full_batch_value_grads(info.world_size)
    return out


def critic_auto_with_held_bytes(info) -> dict:
    """The critic's auto, first with an ample budget, then with a budget that fits deferred_unsharded
    without the bytes held outside it but not with them -- and rank 0 alone holding those (the actor, the
    copy): the budget is agreed over ranks, so both ranks step down to the same mode."""
    loss_fn = make_value_loss(VALUE_LOSS)
    batch = ppo_batch(seed=700 + info.rank)

    def run(budget: float, held: int) -> tuple[str, int, int]:
        """(the mode of the second step, the first step's peak, deferred_unsharded's predicted extra)"""
        cfg = engine_config("fsdp2", "auto", f"sync.memory_budget={budget}")
        engine = Engine(cfg, value_model(cfg), info)
        engine.governor.hold_outside(held)
        rows = [engine.train_batch(batch, loss_fn) for _ in range(2)]
        extra = engine.memory_model.extra_bytes("deferred_unsharded", rows[0]["train/num_microbatches"])
        return rows[-1]["sync/mode"], rows[0]["memory/peak_bytes"], extra

    ample_mode, peak, extra = run(2**40, 0)
    # margins of a whole deferred_unsharded extra (~1.7 MB) either way: far above what the CPU tracker's peak
    # can vary by between runs (a reduce-scatter buffer freed by gloo's thread a moment late, 0.5 MB)
    budget = peak + 2 * extra
    free_mode, _, _ = run(budget, 0)
    held_mode, _, _ = run(budget, 3 * extra // 2 if info.rank == 0 else 0)  # leaves rank 0 half an extra
    return {"ample": ample_mode, "free": free_mode, "held": held_mode}
