"""Micro-batching and loss-normalisation scenarios on real gloo ranks holding different amounts of data."""

from __future__ import annotations

import torch

from scenarios import engine_config, full_grads, make_batch
from syncwise.engine import Engine
from syncwise.losses import AGG_MODES, Normalizer, make_sft_loss, target_mask
from syncwise.models import build_model
from syncwise.rl.algorithm.losses import PolicyLossConfig, make_policy_loss

VOCAB = 512
SEQ = 24


def skewed_batch(rank: int, size: int) -> dict[str, torch.Tensor]:
    """Long-tailed lengths (most short, a few near SEQ), right-padded, prompt tokens masked out of the loss,
    plus RL fields (old log-probs near the current ones, per-sequence advantages)."""
    gen = torch.Generator().manual_seed(1000 + 17 * rank + size)
    exponential = -torch.log(torch.rand(size, generator=gen)) / 0.25
    lengths = (4 + exponential).clamp(max=SEQ).long()
    lengths = torch.where(torch.rand(size, generator=gen) < 0.2, torch.full_like(lengths, SEQ), lengths)
    input_ids = torch.randint(1, VOCAB, (size, SEQ), generator=gen)
    attention_mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_log_probs": -6.0 + 0.3 * torch.randn(size, SEQ - 1, generator=gen),
        "advantages": torch.randn(size, generator=gen),
    }


def _loss_fn(kind: str, agg: str):
    if kind == "sft":
        return make_sft_loss(agg)
    return make_policy_loss(PolicyLossConfig(kind=kind, agg=agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0))


def reference(world_size: int, sizes: list[int], kind: str, agg: str) -> dict[str, torch.Tensor]:
    """Full-batch gradient over every rank's data, one process, no micro-batches."""
    torch.manual_seed(0)
    cfg = engine_config("none", "deferred")
    model = build_model(cfg.model)
    batches = [skewed_batch(r, sizes[r]) for r in range(world_size)]
    batch = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    per_sequence = target_mask(batch).sum(dim=1)
    norm = Normalizer(
        tokens=float(per_sequence.sum()), sequences=float((per_sequence > 0).sum()), dp_size=1,
        max_target_len=float(per_sequence.max()),
    )
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    _loss_fn(kind, agg)(out, batch, norm).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


CASES = [
    (kind, agg, budget, mode)
    for kind, agg in [("sft", a) for a in AGG_MODES] + [("ppo", "token-mean"), ("gspo", "seq-mean-token-mean")]
    for budget in (0, 40)
    for mode in ("per_microbatch", "deferred")
]
SIZES = [5, 3]  # rank 0 holds 5 samples, rank 1 holds 3


def normalisation_suite(info) -> dict:
    out: dict = {}
    for kind, agg, budget, mode in CASES:
        cfg = engine_config(
            "fsdp2", mode, f"engine.max_tokens_per_micro_batch={budget}", "engine.micro_batch_size=2",
        )
        engine = Engine(cfg, build_model(cfg.model), info)
        result = engine.forward_backward_batch(skewed_batch(info.rank, SIZES[info.rank]), _loss_fn(kind, agg))
        out[(kind, agg, budget, mode)] = {"grads": full_grads(engine), "n": result.num_microbatches}
    if info.rank == 0:
        out["reference"] = {
            (kind, agg): reference(info.world_size, SIZES, kind, agg) for kind, agg, _, _ in CASES
        }
    # One rank with 1 sample, the other with 7: same number of micro-batches, right gradient.
    lopsided = [1, 7]
    for mode in ("per_microbatch", "deferred"):
        cfg = engine_config("fsdp2", mode, "engine.micro_batch_size=2")
        engine = Engine(cfg, build_model(cfg.model), info)
        metrics = engine.train_batch(skewed_batch(info.rank, lopsided[info.rank]), make_sft_loss())
        out[("lopsided", mode)] = metrics
        engine = Engine(cfg, build_model(cfg.model), info)
        result = engine.forward_backward_batch(skewed_batch(info.rank, lopsided[info.rank]), make_sft_loss())
        out[("lopsided_grads", mode)] = (full_grads(engine), result.num_microbatches)
    if info.rank == 0:
        out["lopsided_reference"] = reference(info.world_size, lopsided, "sft", "token-mean")
    return out


PACKING_KINDS = ["sft", "ppo", "gspo", "pg", "cispo"]
ROLLOUT_IS_CASES = [(level, agg) for level in ("token", "sequence") for agg in ("token-mean", "seq-mean-token-mean")]


def _rl_loss(kind: str, agg: str):
    if kind == "sft":
        return make_sft_loss(agg)
    # Entropy and KL too: they read the logits and a per-target tensor (ref_log_probs) through the packing.
    return make_policy_loss(PolicyLossConfig(kind=kind, agg=agg, clip_low=0.2, clip_high=0.28, entropy_coef=0.01,
                                             kl_coef=0.05))


def packing_suite(info) -> dict:
    """Packed vs padded micro-batches on the same data: gradients, per-sample log-probs, the token cap."""
    out: dict = {}
    batch = skewed_batch(info.rank, SIZES[info.rank])
    batch["ref_log_probs"] = batch["old_log_probs"] + 0.05
    noise = torch.Generator().manual_seed(7 + info.rank)
    batch["rollout_log_probs"] = batch["old_log_probs"] + 0.3 * torch.randn(batch["old_log_probs"].shape,
                                                                            generator=noise)
    for kind in PACKING_KINDS:
        for agg in AGG_MODES:
            for packing in ("true", "false"):
                cfg = engine_config("fsdp2", "deferred", f"engine.packing={packing}",
                                    "engine.max_tokens_per_micro_batch=40")
                engine = Engine(cfg, build_model(cfg.model), info)
                result = engine.forward_backward_batch(batch, _rl_loss(kind, agg))
                out[(kind, agg, packing)] = {"grads": full_grads(engine), "loss": result.metrics["loss"],
                                             "log_probs": result.outputs.get("log_probs")}
    for level, agg in ROLLOUT_IS_CASES:  # the sampler's log-probs pack like the old ones (per target)
        for packing in ("true", "false"):
            cfg = engine_config("fsdp2", "deferred", f"engine.packing={packing}",
                                "engine.max_tokens_per_micro_batch=40")
            engine = Engine(cfg, build_model(cfg.model), info)
            loss_fn = make_policy_loss(PolicyLossConfig(kind="ppo", agg=agg, rollout_is=level, rollout_is_cap=1.5))
            result = engine.forward_backward_batch(batch, loss_fn)
            out[("is", level, agg, packing)] = {"grads": full_grads(engine), "metrics": result.metrics}
    for packing in ("true", "false"):
        cfg = engine_config("fsdp2", "deferred", f"engine.packing={packing}", "engine.max_tokens_per_micro_batch=40")
        engine = Engine(cfg, build_model(cfg.model), info)
        out[("eval", packing)] = engine.eval_batch(batch).outputs["log_probs"]
        out[("step", packing)] = engine.train_batch(batch, make_sft_loss())
    out["shared"] = shared_prefix_runs(info)
    long = make_batch(seed=60 + info.rank, size=8, seq_len=128)  # activations worth checkpointing
    long["advantages"] = torch.randn(8, generator=torch.Generator().manual_seed(info.rank))
    long["ref_log_probs"] = torch.full((8, 127), -6.0)
    out["checkpointing"] = activation_checkpointing(info, long)
    return out


def activation_checkpointing(info, batch: dict) -> dict:
    """Every sync mode, packed, with and without activation checkpointing: gradients, collectives (strict)
    and the measured peak of one accumulation."""
    from syncwise.memory.meter import PeakMeter

    out = {}
    for mode in ("per_microbatch", "deferred", "deferred_unsharded"):
        for ac in ("false", "true"):
            cfg = engine_config("fsdp2", mode, f"engine.activation_checkpointing={ac}", "sync.strict=true",
                                "engine.micro_batch_size=4")
            engine = Engine(cfg, build_model(cfg.model), info)
            metrics = engine.train_batch(batch, _rl_loss("ppo", "token-mean"))  # raises on a collective mismatch
            engine.optimizer.zero_grad(set_to_none=True)
            meter = PeakMeter(engine.model, engine.optimizer, engine.info.device)
            with meter:
                engine._peak_meter = meter
                engine.forward_backward_batch(batch, _rl_loss("ppo", "token-mean"))
                engine._peak_meter = None
            out[(mode, ac)] = {"grads": full_grads(engine), "peak": meter.peak, "metrics": metrics}
    return out


def grpo_batch(rank: int) -> dict[str, torch.Tensor]:
    """GRPO's layout: left-padded prompts, then responses (right-padded); 2 prompts x 3 samples that begin
    with one 17-token system prompt (at least MIN_SHARED in common), and one row of its own; responses the only
    targets."""
    gen = torch.Generator().manual_seed(300 + rank)
    system = torch.randint(1, VOCAB, (17,), generator=gen)
    prompts = [torch.cat([system, torch.randint(1, VOCAB, (n,), generator=gen)]) for n in (5, 7)]
    prompts = [p for p in prompts for _ in range(3)] + [torch.randint(1, VOCAB, (9,), generator=gen)]
    responses = [torch.randint(1, VOCAB, (int(n),), generator=gen) for n in torch.randint(2, 9, (7,), generator=gen)]
    width = max(len(p) for p in prompts) + max(len(r) for r in responses)
    rows, masks, losses = [], [], []
    for prompt, response in zip(prompts, responses, strict=True):
        pad = max(len(p) for p in prompts) - len(prompt)
        tail = width - pad - len(prompt) - len(response)
        rows.append(torch.cat([torch.zeros(pad, dtype=torch.long), prompt, response,
                               torch.zeros(tail, dtype=torch.long)]))
        masks.append(torch.cat([torch.zeros(pad), torch.ones(len(prompt) + len(response)), torch.zeros(tail)]))
        losses.append(torch.cat([torch.zeros(pad + len(prompt)), torch.ones(len(response)), torch.zeros(tail)]))
    old = -6.0 + 0.3 * torch.randn(7, width - 1, generator=gen)
    return {"input_ids": torch.stack(rows), "attention_mask": torch.stack(masks).long(),
            "loss_mask": torch.stack(losses).long(), "old_log_probs": old, "ref_log_probs": old + 0.05,
            "rollout_log_probs": old + 0.3 * torch.randn(old.shape, generator=gen),
            "advantages": torch.randn(7, generator=gen)}


SHARED_SPLITS = {"two rows a micro-batch": "engine.micro_batch_size=2",
                 "token cap 80": "engine.max_tokens_per_micro_batch=80",
                 "token cap 200": "engine.max_tokens_per_micro_batch=200"}


def shared_prefix_runs(info) -> dict:
    """A GRPO-shaped batch with shared prefixes on and off (packed both), and padded: gradients, loss,
    log-probs and the tokens computed, under each split."""
    out: dict = {}
    batch = grpo_batch(info.rank)
    for split, key in SHARED_SPLITS.items():
        for kind, agg in (("ppo", "token-mean"), ("gspo", "seq-mean-token-mean")):
            for share, packing in (("true", "true"), ("false", "true"), ("false", "false")):
                cfg = engine_config("fsdp2", "deferred", f"engine.packing={packing}", f"engine.share_prefixes={share}",
                                    key, "sync.strict=true")
                engine = Engine(cfg, build_model(cfg.model), info)
                result = engine.forward_backward_batch(batch, make_policy_loss(PolicyLossConfig(
                    kind=kind, agg=agg, rollout_is="token", rollout_is_cap=1.5, entropy_coef=0.01, kl_coef=0.05)))
                out[(split, kind, share, packing)] = {
                    "grads": full_grads(engine), "loss": result.metrics["loss"], "metrics": result.metrics,
                    "log_probs": engine.forward_batch(batch).outputs["log_probs"],
                    "shares": engine.features.share_prefixes}
    return out
