"""Reward functions as ``rl.reward_fn`` names them, and scoring a rollout's responses with them.

A path is ``package.module:function`` (imported as ``python -m`` would, with the job's folder first on the
path) or ``path/to/file.py:function``. A function is per-sample, ``fn(prompt, response, row) -> float``, or
batched, ``fn(prompts, responses, rows) -> list[float]`` -- declared with ``@syncwise.rewards.batched`` or by
naming its first parameter ``prompts``. With ``rl.environment``, a per-sample function with an ``env``
parameter is given the sample's episode (the environment instance), a batched one with an ``environments``
parameter the list of them (TRL's name). Several functions are summed with ``rl.reward_weights``; each is
logged as ``reward/<name>`` beside the weighted total; an episode's own ``get_reward()`` is one more part, at
weight 1, logged under its class's name. Reward functions are your code and run with the
job's rights.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .loader import load_function


@dataclass
class RewardFunction:
    name: str  # as logged: reward/<name>
    label: str  # how an error names it: rl.reward_fn (one function) or rl.reward_fn <path> (several)
    fn: Callable[..., Any]
    weight: float = 1.0
    batched: bool = False
    parameters: frozenset = field(init=False)  # its parameters' names: whether it asks for env / environments

    def __post_init__(self) -> None:
        self.parameters = frozenset(_parameters(self.fn))


def load_reward_fn(path: str) -> Callable[..., Any]:
    """The reward function ``path`` names; a ValueError naming ``rl.reward_fn`` if it cannot be had."""
    return load_function(path, "rl.reward_fn")


def _parameters(fn: Callable[..., Any]) -> list[str]:
    """``fn``'s parameters' names, in order (none for a builtin without a signature)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def is_batched(fn: Callable[..., Any]) -> bool:
    """Declared batched (``@syncwise.rewards.batched``), or its first parameter is named ``prompts``."""
    if getattr(fn, "syncwise_batched", False):
        return True
    params = _parameters(fn)  # a builtin without a signature: per-sample
    return bool(params) and params[0] == "prompts"


def reward_functions(paths: list[str], weights: list[float]) -> list[RewardFunction]:
    """The functions of ``rl.reward_fn`` with their weights (1 each when none are given) and unique names."""
    out: list[RewardFunction] = []
    for i, path in enumerate(paths):
        fn = load_reward_fn(path)
        name = path.rpartition(":")[2]
        if any(r.name == name for r in out):
            name = f"{name}_{i}"
        label = "rl.reward_fn" if len(paths) == 1 else f"rl.reward_fn {path}"
        out.append(RewardFunction(name, label, fn, weights[i] if weights else 1.0, is_batched(fn)))
    return out


def score(functions: list[RewardFunction], prompts: list[Any], responses: list[str], rows: list[dict[str, Any]],
          environments: list[Any] | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """Every response's weighted total and each function's own rewards (``environments``: each sample's episode,
    for the functions that ask for it). A function that raises, returns the wrong number of rewards or a
    non-finite one is a ValueError naming it (and, per sample, the prompt)."""
    parts: dict[str, list[float]] = {}
    envs = environments if environments is not None else [None] * len(responses)
    for reward in functions:
        wants = reward.parameters
        if reward.batched:
            extra = {"environments": environments} if "environments" in wants and environments else {}
            parts[reward.name] = _batched(reward, prompts, responses, rows, extra)
        else:
            parts[reward.name] = [_one(reward, p, r, row, {"env": env} if "env" in wants and env is not None else {})
                                  for p, r, row, env in zip(prompts, responses, rows, envs, strict=True)]
    totals = [sum(r.weight * parts[r.name][i] for r in functions) for i in range(len(responses))]
    return totals, parts


def score_samples(functions: list[RewardFunction], rows: list[dict[str, Any]], responses: list[Any], n: int,
                  environments: list[Any] | None = None, episode_rewards: list[float | None] = (),
                  episode_name: str = "environment") -> tuple[list[float], dict[str, list[float]]]:
    """:func:`score` for a rollout step's samples, ``n`` consecutive ones per row; an episode's own score (its
    environment's ``reward()``, where it gives one) is one more part, ``episode_name``, added to the total."""
    group_rows = [rows[i // n] for i in range(len(responses))]
    totals, parts = score(functions, [row["prompt"] for row in group_rows], responses, group_rows, environments)
    if any(r is not None for r in episode_rewards):
        parts[episode_name] = [r or 0.0 for r in episode_rewards]
        totals = [total + r for total, r in zip(totals, parts[episode_name], strict=True)]
    return totals, parts



def _one(reward: RewardFunction, prompt: Any, response: str, row: dict[str, Any], extra: dict[str, Any]) -> float:
    try:
        value = float(reward.fn(prompt, response, row, **extra))
    except Exception as exc:  # user code: any exception
        raise ValueError(f"{reward.label}: raised {type(exc).__name__}: {exc} (prompt {prompt!r}, "
                         f"response {response!r})") from exc
    if not math.isfinite(value):
        raise ValueError(f"{reward.label}: returned {value} (prompt {prompt!r}, response {response!r}); "
                         "a reward must be a finite number")
    return value


def _batched(reward: RewardFunction, prompts: list[Any], responses: list[str], rows: list[dict[str, Any]],
             extra: dict[str, Any]) -> list:
    try:
        values = [float(v) for v in reward.fn(prompts, responses, rows, **extra)]
    except Exception as exc:  # user code: any exception
        raise ValueError(f"{reward.label} (batched): raised {type(exc).__name__}: {exc}") from exc
    if len(values) != len(responses):
        raise ValueError(f"{reward.label} (batched): returned {len(values)} rewards for "
                         f"{len(responses)} responses")
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{reward.label} (batched): returned {bad[0]}; a reward must be a finite number")
    return values
