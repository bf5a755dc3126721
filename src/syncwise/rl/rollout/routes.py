"""Router replay (``rl.router_replay``): whether a job's mixture of experts trains through the experts its sampler
chose for each token (R3, arXiv 2510.11370) -- the sampler and the trainer otherwise route some tokens to other
experts (another dtype, another kernel, a near-tie), which turns the importance ratios into noise. The compact
sampler and ``generate`` record each token's experts per layer, they travel with the batch (``routed_experts``:
queued a lag ahead, checkpointed with it, sent from a rollout rank, carried round to round with a partial rollout
-- each token keeping the routes of the forward that fed it), and every
training forward routes by them while the routing weights come from the live router, so the router still learns
(:mod:`syncwise.models.moe`)."""

from __future__ import annotations

from typing import Any

from ...config import Config, ConfigError
from ...models.moe import experts_per_token

REPLAYED_MODELS = ("qwen3_moe", "mixtral")  # softmax-top-k routers (models.moe.SOFTMAX_TOP_K_ROUTERS)


def replays_routes(config: Config, hf_config: Any) -> tuple[bool, str | None]:
    """(whether this job replays its routes, why not where the model is a mixture of experts that will not).
    ``rl.router_replay=true`` where it cannot is a :class:`ConfigError` naming why; ``auto`` replays where it can."""
    rl, wanted = config.rl, config.rl.router_replay
    if wanted is False:
        return False, None
    if experts_per_token(hf_config) is None:
        if wanted is True:
            raise ConfigError(f"rl.router_replay=true: {config.model.path or 'the model'} is not a mixture of experts "
                              "(its config has no num_experts_per_tok)")
        return False, None
    obstacle = None
    if getattr(hf_config, "model_type", None) not in REPLAYED_MODELS:
        obstacle = (f"its routers ({hf_config.model_type}) are not ones replay knows ({', '.join(REPLAYED_MODELS)}: "
                    "softmax over the experts, top k)")
    elif rl.rollout_engine not in ("compact", "generate"):
        obstacle = (f"rl.rollout_engine={rl.rollout_engine} does not say which experts it chose (the compact "
                    "sampler and generate do)")
    elif rl.tools or rl.environment or rl.agent:
        obstacle = "multi-turn rollouts (rl.tools, rl.environment, rl.agent) are not replayed yet"
    if obstacle is None:
        return True, None
    if wanted is True:
        raise ConfigError(f"rl.router_replay=true: {obstacle}; rl.router_replay=false trains without it")
    return False, obstacle
