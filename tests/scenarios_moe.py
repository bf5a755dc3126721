"""Run on 2 gloo ranks by test_moe.py: a Qwen3-MoE's gradients under replayed routes, with its routers'
load-balancing loss, through the engine -- FSDP2,
every sync mode, packed and padded micro-batches, activation checkpointing's recompute -- for the test process to
compare with a single-process reference that replays by hand."""

from __future__ import annotations

from scenarios import full_grads
from syncwise.config import load_config
from syncwise.engine import Engine
from syncwise.losses import make_sft_loss
from syncwise.models import build_model
from syncwise.models.moe import LOAD

AUX_COEF = 0.05  # the routers' load-balancing loss, weighted well above a real model's (0.001) to be seen
# (sync mode, extra keys): each a case the engine's split, packing or recompute could get the routes wrong in
REPLAY_CASES = {
    "per_microbatch": ("per_microbatch", ()),
    "deferred packed": ("deferred", ("engine.packing=true",)),
    "deferred padded": ("deferred", ("engine.packing=false",)),
    "deferred_unsharded checkpointed": ("deferred_unsharded", ("engine.activation_checkpointing=true",)),
}


def replay_suite(info, model_dir: str, batch: dict) -> dict:
    """Each case's full gradient of the token-mean SFT loss plus the load-balancing loss on this rank's rows of
    ``batch`` (with its ``routed_experts``; one sequence a micro-batch), how many replayed choices the live routers
    shared, each expert's load and the balancing loss's share."""
    mine = {key: value[info.rank::info.world_size] for key, value in batch.items()}
    out = {}
    for name, (mode, extra) in REPLAY_CASES.items():
        config = load_config(None, [f"model.path={model_dir}", "engine.strategy=fsdp2", f"sync.mode={mode}",
                                    "engine.micro_batch_size=1", "engine.max_tokens_per_micro_batch=0",
                                    "engine.fused_lm_head=false", "optim.name=sgd", "optim.lr=0", *extra])
        engine = Engine(config, build_model(config.model), info)
        engine.router_aux_coef = AUX_COEF
        result = engine.forward_backward_batch(mine, make_sft_loss("token-mean"))
        out[name] = {"grads": full_grads(engine), "matches": result.metrics["moe/route_matches"],
                     "choices": result.metrics["moe/route_choices"],
                     "load": {k: v for k, v in result.metrics.items() if k.startswith(LOAD)},
                     "aux": result.metrics["moe/aux_loss"]}
    return out


def few_experts_model():
    """A Qwen3-MoE of one expert a layer (top-1): fewer experts than the 2 ranks that shard it."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=1, num_experts_per_tok=1, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).float()


def few_experts_suite(info, batches: list[dict]) -> dict:
    """The engine (FSDP2, deferred) on :func:`few_experts_model` with this rank's rows: the fused experts'
    placement and local shape, and every gradient of the token-mean SFT loss."""
    config = load_config(None, ["engine.strategy=fsdp2", "sync.mode=deferred", "engine.micro_batch_size=2",
                                "optim.name=sgd", "optim.lr=0", "engine.fused_lm_head=false"])
    engine = Engine(config, few_experts_model(), info)
    experts = next(p for n, p in engine.model.named_parameters() if n.endswith("gate_up_proj"))
    engine.forward_backward_batch(batches[info.rank], make_sft_loss("token-mean"))
    return {"sharded_dims": [getattr(p, "dim", None) for p in experts.placements],
            "local": tuple(experts.to_local().shape),
            "grads": full_grads(engine)}
