"""What of a mixture-of-experts model works per token. transformers 5 stores a MoE layer's experts fused, one
module holding every expert's weights as 3-D tensors (Qwen3-MoE's and Mixtral's ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I)), beside a router whose ``weight`` (E, H) scores the experts; each token goes through
``num_experts_per_tok`` (k) of the E. So every expert's parameters are held, trained and stored, but a token's
matmuls use k / E of them: its useful FLOPs, the active-parameter count and the activations the memory plan counts
take the experts at that share. Here too: the routers' choices recorded (:class:`RouteRecorder`, the sampler) and
replayed with the live router's weights, the experts' load counted (:class:`RouteReplay`, every training forward),
and the load-balancing loss's weight (:func:`router_aux_coef`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from weakref import WeakKeyDictionary

import torch
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


def mlp_width(hf_config, default: int) -> int:
    """A token's MLP intermediates in a decoder layer, what its activations scale with: ``intermediate_size``
    (``default`` without one) for a dense layer; in a MoE layer its k experts' (``moe_intermediate_size`` each,
    Mixtral's ``intermediate_size``) -- the most of any layer where a model has both kinds."""
    dense = int(getattr(hf_config, "intermediate_size", None) or default)
    routed = experts_per_token(hf_config)
    if routed is None:
        return dense
    expert = int(getattr(hf_config, "moe_intermediate_size", None) or dense)
    layers = int(getattr(hf_config, "num_hidden_layers", 1))
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    only_dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    kinds = {"sparse" if i not in only_dense and (i + 1) % step == 0 else "dense" for i in range(layers)}
    return max(routed[0] * expert if kind == "sparse" else dense for kind in kinds)


def routing_width(hf_config) -> int:
    """What a MoE layer keeps per token beyond its experts' intermediates, in elements: the token's copy sent to
    each of its k experts, each expert's output and its weighted share (3 x k x hidden), and the router's logits
    and probabilities (2 x E). 0 for a dense model."""
    routed = experts_per_token(hf_config)
    if routed is None:
        return 0
    top_k, experts = routed
    return 3 * top_k * int(hf_config.hidden_size) + 2 * experts


def router_aux_coef(hf_config, given: float | str, key: str) -> float:
    """The weight of a job's load-balancing loss: ``given``, or for ``auto`` the model config's
    ``router_aux_loss_coef`` (0 for a dense model). A weight on a dense model is a ValueError naming ``key``."""
    if experts_per_token(hf_config) is None:
        if given not in ("auto", 0, 0.0):
            raise ValueError(f"{key}={given}: the model is not a mixture of experts (its config has no "
                             "num_experts_per_tok); it has no router to balance")
        return 0.0
    return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0) if given == "auto" else float(given)


# Routers whose choice is the top k of softmax(router logits), its weights those probabilities (renormalised over
# the k where the router does): what replay recomputes from the live logits.
SOFTMAX_TOP_K_ROUTERS = ("Qwen3MoeTopKRouter", "MixtralTopKRouter")
ROUTES = "routed_experts"  # a batch's [B, T, layers, k] expert ids each token went through when sampled; -1: none


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (empty for a dense model)."""
    return [module for module in model.modules() if is_router(module)]


def replay_refusal(model: nn.Module) -> str | None:
    """Why the model's routing cannot be replayed (a router replay does not know), or None."""
    other = sorted({type(r).__name__ for r in routers(model)} - set(SOFTMAX_TOP_K_ROUTERS))
    if other:
        return (f"its routers ({', '.join(other)}) are not ones replay knows ({', '.join(SOFTMAX_TOP_K_ROUTERS)}: "
                "softmax over the experts, top k)")
    return None


class RouteRecorder:
    """Records each forward's routing: every router's chosen experts (its ``router_indices`` output) of the tokens
    it was given, for the sampler to file per sequence. ``take()`` returns the last forward's [tokens, layers, k]."""

    def __init__(self, model: nn.Module):
        self.layers = routers(model)
        self.top_k = int(self.layers[0].top_k) if self.layers else 0
        self._calls: dict[int, torch.Tensor] = {}
        self._hooks = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.layers)]

    def _hook(self, layer: int):
        def record(module, inputs, output) -> None:
            self._calls[layer] = output[2].detach()
        return record

    def take(self) -> torch.Tensor:
        calls = [self._calls.pop(layer) for layer in range(len(self.layers))]
        return torch.stack(calls, dim=1).to(torch.int16)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


class RouteReplay:
    """Watches (and where given, replays) a MoE model's routing, one forward's tokens at a time. ``routes``
    [tokens, layers, k] (a row of -1s: the router's own choice) routes each token through the experts given for
    it, with the weights from the live router's probabilities at those experts, so the router still learns (R3,
    arXiv 2510.11370); it counts how many of the replayed choices the live router made too (``matches`` of
    ``choices``) and every layer's tokens per expert among the ``real`` ones (``load``)."""

    def __init__(self, model: nn.Module):
        self.layers = routers(model)
        self.experts = int(self.layers[0].num_experts)
        self.routes: torch.Tensor | None = None
        self.real: torch.Tensor | None = None
        self.reset()
        self._hooks = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.layers)]

    def reset(self) -> None:
        # counted on the routers' device (no synchronisation a layer), read once a forward (metrics)
        self._matches = self._choices = self._load = None

    @property
    def matches(self) -> int:
        return int(self._matches) if self._matches is not None else 0

    @property
    def choices(self) -> int:
        return int(self._choices) if self._choices is not None else 0

    @property
    def load(self) -> torch.Tensor:
        """[layers, experts]: the tokens each layer sent to each expert so far."""
        if self._load is None:
            return torch.zeros(len(self.layers), self.experts, dtype=torch.float64)
        return self._load.double().cpu()

    def _add(self, name: str, value: torch.Tensor) -> None:
        before = getattr(self, name)
        setattr(self, name, value if before is None else before + value)

    def _hook(self, layer: int):
        def replay(module, inputs, output):
            logits, scores, live = output
            chosen, replaced = live, None
            if self.routes is not None:
                given = self.routes[:, layer].to(device=live.device, dtype=live.dtype)
                if given.shape != live.shape:
                    raise RuntimeError(f"router replay: {tuple(given.shape)} routes for a router of "
                                       f"{tuple(live.shape)}")
                known = (given >= 0).all(dim=1, keepdim=True)
                chosen = torch.where(known, given, live)
                weights = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
                if getattr(module, "norm_topk_prob", True):
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                with torch.no_grad():
                    same = (chosen.unsqueeze(2) == live.unsqueeze(1)).any(dim=2) & known
                    self._add("_matches", same.sum())
                    self._add("_choices", known.sum() * chosen.shape[1])
                replaced = logits, weights.to(scores.dtype), chosen
            with torch.no_grad():
                real = chosen if self.real is None else chosen[self.real.to(chosen.device).reshape(-1)]
                counts = torch.zeros(len(self.layers), self.experts, dtype=torch.long, device=chosen.device)
                counts[layer] = torch.bincount(real.reshape(-1), minlength=self.experts)
                self._add("_load", counts)
            return replaced
        return replay

    def metrics(self) -> dict[str, torch.Tensor]:
        """This forward's counts as loss metrics (summed over micro-batches and ranks; see :func:`summarise`)."""
        load = self.load  # a copy as it is now: a checkpointed layer's recompute counts again after
        out = {f"{LOAD}{layer}/{expert}": load[layer, expert]
               for layer in range(len(self.layers)) for expert in range(self.experts)}
        if self.routes is not None:
            out["moe/route_matches"] = torch.tensor(float(self.matches))
            out["moe/route_choices"] = torch.tensor(float(self.choices))
        return out

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


LOAD = "moe/expert_tokens/"  # per layer and expert, the step's tokens routed there (summarised, not logged)
_REPLAYS: WeakKeyDictionary[nn.Module, RouteReplay | None] = WeakKeyDictionary()


def route_replay(model: nn.Module, routes: torch.Tensor | None, real: torch.Tensor | None = None
                 ) -> RouteReplay | None:
    """For a mixture of experts (None for a dense model): route the model's next forwards -- and their
    recomputation in backward (activation checkpointing) -- by ``routes`` ([..., layers, k] over a forward's
    tokens, flattened in their order; None: as the routers choose), counting afresh the experts' load over the
    ``real`` tokens (a mask of them in the same order; None: all)."""
    if model not in _REPLAYS:  # looked for once a model: None for a dense one
        _REPLAYS[model] = RouteReplay(model) if routers(model) else None
    replay = _REPLAYS[model]
    if replay is None:
        return None
    replay.routes = routes.reshape(-1, *routes.shape[-2:]) if routes is not None else None
    replay.real = real.bool() if real is not None else None
    replay.reset()
    return replay


def summarise(metrics: dict[str, float]) -> None:
    """A step's (reduced) routing counts into what is logged, in place: ``moe/load_max_over_mean`` (the busiest
    expert's tokens over the mean, in the most unbalanced layer: 1.0 is even) and, with replay,
    ``moe/route_agreement`` (the share of the replayed choices the live routers made alike)."""
    counts: dict[int, list[float]] = {}
    for key in [k for k in metrics if k.startswith(LOAD)]:
        layer = int(key[len(LOAD):].split("/")[0])
        counts.setdefault(layer, []).append(metrics.pop(key))
    ratios = [max(c) / (sum(c) / len(c)) for c in counts.values() if sum(c) > 0]
    if ratios:
        metrics["moe/load_max_over_mean"] = max(ratios)
    if metrics.get("moe/route_choices"):
        metrics["moe/route_agreement"] = metrics["moe/route_matches"] / metrics["moe/route_choices"]
