"""The fused LM head against materialised logits on real gloo ranks: the same gradients, log-probs and
collectives, for every strategy, packed and padded, SFT and the policy losses with entropy, KL and temperature."""

from __future__ import annotations

from scenarios import engine_config, full_grads
from scenarios_batching import skewed_batch
from syncwise.engine import Engine
from syncwise.losses import make_sft_loss
from syncwise.models import build_model
from syncwise.rl.algorithm.losses import PolicyLossConfig, make_policy_loss
from syncwise.sync.counting import count_collectives

TEMPERATURE = 0.7


def _loss(kind: str):
    if kind == "sft":
        return make_sft_loss("token-mean")
    return make_policy_loss(PolicyLossConfig(kind=kind, entropy_coef=0.01, kl_coef=0.05), temperature=TEMPERATURE)


ALL_KINDS = ("sft", "ppo", "gspo", "pg", "cispo")


def kinds_of(case: str) -> tuple[str, ...]:
    """Every loss on the main case; SFT and PPO (entropy, KL, temperature) on the others."""
    return ALL_KINDS if case == "fsdp2_deferred" else ("sft", "ppo")


# name -> (strategy, mode, extra config, model overrides)
HEAD_CASES = {
    "fsdp2_deferred": ("fsdp2", "deferred", (), {}),
    "fsdp2_per_microbatch": ("fsdp2", "per_microbatch", (), {}),
    "fsdp2_deferred_unsharded": ("fsdp2", "deferred_unsharded", (), {}),
    "fsdp2_tied": ("fsdp2", "deferred", (), {"tie_word_embeddings": True}),
    "fsdp2_bf16": ("fsdp2", "deferred", ("model.param_dtype=bfloat16", "model.reduce_dtype=float32"), {}),
    "fsdp2_checkpointed": ("fsdp2", "deferred", ("engine.activation_checkpointing=true",), {}),
    "fsdp1_deferred": ("fsdp1", "deferred", (), {}),
    "ddp_deferred": ("ddp", "deferred", (), {}),
}


def head_suite(info, cases: list[str]) -> dict:
    """Each case, loss and layout with the fused head on and off; an uneven batch (rank 1 has fewer
    samples, so it runs an empty micro-batch) under a token cap."""
    out: dict = {}
    batch = skewed_batch(info.rank, 9 if info.rank == 0 else 4)
    batch["ref_log_probs"] = batch["old_log_probs"] + 0.05
    for case in cases:
        strategy, mode, extra, overrides = HEAD_CASES[case]
        for kind in kinds_of(case):
            for packing in ("true", "false"):
                for fused in ("true", "false"):
                    cfg = engine_config(strategy, mode, f"engine.packing={packing}", f"engine.fused_lm_head={fused}",
                                        "engine.max_tokens_per_micro_batch=40", "engine.logprob_chunk_size=16",
                                        *extra)
                    model = build_model(cfg.model, **overrides)
                    tied = model.lm_head.weight is model.model.embed_tokens.weight
                    engine = Engine(cfg, model, info)
                    with count_collectives() as counts:
                        result = engine.forward_backward_batch(batch, _loss(kind))
                    log_probs = engine.forward_batch(batch, temperature=TEMPERATURE).outputs["log_probs"]
                    out[(case, kind, packing, fused)] = {
                        "grads": full_grads(engine), "counts": dict(counts.counts), "fused": engine.features.fused_head,
                        "tied": tied, "metrics": result.metrics, "log_probs": log_probs,
                        "microbatches": result.num_microbatches,
                    }
    return out
