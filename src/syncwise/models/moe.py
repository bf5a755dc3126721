"""What of a mixture-of-experts model works per token. transformers 5 stores a MoE layer's experts fused, one
module holding every expert's weights as 3-D tensors (Qwen3-MoE's and Mixtral's ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I)), beside a router whose ``weight`` (E, H) scores the experts; each token goes through
``num_experts_per_tok`` (k) of the E. So every expert's parameters are held, trained and stored, but a token's
matmuls use k / E of them: its useful FLOPs and the active-parameter count take the experts at that share."""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn


def experts_per_token(hf_config) -> tuple[int, int] | None:
    """(k, E): the experts each token goes through and the experts of a layer, or None for a dense model."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return None
    return int(top_k), int(experts)


def is_fused_experts(module: nn.Module) -> bool:
    """A module holding a MoE layer's experts as 3-D weights, one slice per expert (its own parameters only)."""
    own = list(module.parameters(recurse=False))
    return bool(own) and isinstance(getattr(module, "num_experts", None), int) and all(p.dim() == 3 for p in own)


def is_router(module: nn.Module) -> bool:
    """A MoE router that is not an ``nn.Linear`` (transformers 5's ``*TopKRouter``: a (E, H) ``weight`` it
    multiplies each token by)."""
    weight = getattr(module, "weight", None)
    return (not isinstance(module, nn.Linear) and hasattr(module, "top_k") and isinstance(weight, nn.Parameter)
            and weight.dim() == 2)


def active_parameters(shapes: Iterable[tuple[int, ...]], hf_config) -> int:
    """Of a model whose parameters have ``shapes``: those a token's forward uses -- all of a dense model's; a
    MoE layer's fused experts (3-D, one slice per expert) at k / E."""
    shapes = list(shapes)
    total = sum(math.prod(shape) for shape in shapes)
    routed = experts_per_token(hf_config)
    if routed is None:
        return total
    top_k, experts = routed
    held = sum(math.prod(shape) for shape in shapes if len(shape) == 3 and shape[0] == experts)
    return total - held + held // experts * top_k
