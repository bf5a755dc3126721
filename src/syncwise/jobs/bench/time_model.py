"""A time model of the rollout, synchronous against partial rollouts (``rl.max_staleness``), fitted to what a
``bench --workload grpo`` run measured and projected to other machines and length distributions.

A decode step of the engine's batch costs ``per_step_s`` (reading the weights, launching the kernels: what a
GPU's memory-bound decode is made of) plus ``per_token_s`` per row in it (the arithmetic: what a CPU's decode
is made of). A synchronous rollout runs until its longest response: ``longest x per_step_s + tokens x
per_token_s``. Partial rollouts run fewer decode steps per trained batch -- rounds of ``rl.partial_chunk_tokens``
over more sequences in flight, the tail carried -- for the same tokens, plus the carried sequences' prefill
after each refresh. :func:`simulate` counts both by running the real :class:`PartialPool` over a scripted
engine whose responses have the given lengths; :func:`fit` takes the two costs from measured steps (least
squares over every configuration's steps: ``time/rollout_s`` against ``rollout/decode_steps`` and the
tokens each rank drew); :func:`project` gives the step time of each for a given generation / training ratio.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...rl.rollout.base import Samples
from ...rl.rollout.partial import PartialPool
from ...rl.stats import drawn_tokens


@dataclass(frozen=True)
class DecodeCost:
    per_step_s: float  # a decode step's fixed cost
    per_token_s: float  # each row's share of a decode step

    def seconds(self, decode_steps: float, tokens: float) -> float:
        return decode_steps * self.per_step_s + tokens * self.per_token_s


@dataclass(frozen=True)
class RolloutWork:
    """Per trained batch (one step, one rank): the decode steps and the tokens the engine computed."""

    decode_steps: float
    tokens: float  # sampled (with partial rollouts also those of groups dropped for age)
    prefill: float  # partial rollouts: the carried sequences' tokens, prefilled again after a refresh
    fill: float  # sampled tokens over rows x decode steps
    dropped: float  # the fraction of sampled groups dropped for age


def fit(rows: list[dict[str, Any]], world_size: int) -> DecodeCost:
    """The two costs from measured steps (``metrics.jsonl`` rows of any configurations, least squares, both
    kept non-negative)."""
    x = torch.tensor([[r["rollout/decode_steps"], drawn_tokens(r) / world_size] for r in rows], dtype=torch.float64)
    y = torch.tensor([r["time/rollout_s"] for r in rows], dtype=torch.float64)
    solution = torch.linalg.lstsq(x, y[:, None]).solution.squeeze(1)
    if (solution < 0).any():  # one cost alone explains it better: the other is 0
        alone = [(y @ x[:, i] / (x[:, i] @ x[:, i])).item() for i in range(2)]
        errors = [((y - alone[i] * x[:, i]) ** 2).sum().item() for i in range(2)]
        best = errors.index(min(errors))
        solution = torch.tensor([alone[0] if best == 0 else 0.0, alone[1] if best == 1 else 0.0])
    return DecodeCost(float(solution[0]), float(solution[1]))


class _Scripted:
    """An engine whose responses are as long as ``length_of((prompt, sample))`` says: a new sequence's first token
    is its index among its prompt's samples in the call (they come consecutively), so a continuation knows it."""

    def __init__(self, length_of: Callable[[tuple[int, int]], int]):
        self.length_of = length_of

    def sample(self, prompts, n, max_new_tokens, seed):
        tokens, ended, siblings = [], [], {}
        for sequence in prompts:
            if len(sequence) == 1:
                siblings[sequence[0]] = siblings.get(sequence[0], -1) + 1
            sample = sequence[1] if len(sequence) > 1 else siblings[sequence[0]]
            left = self.length_of((sequence[0], sample)) - (len(sequence) - 1)
            drawn = [sample] + [0] * (left - 1) if len(sequence) == 1 else [0] * left
            tokens.append(torch.tensor(drawn[:max_new_tokens], dtype=torch.long))
            ended.append(left <= max_new_tokens)
        empty = [torch.zeros(len(t)) for t in tokens]
        return Samples(tokens, empty, sum(map(len, tokens)), ended, empty)


class _Words:
    def decode(self, tokens, skip_special_tokens=True):
        return ""


def simulate(lengths: Callable[[random.Random], int], prompts: int, samples_per_prompt: int, max_new_tokens: int,
             staleness: int, chunk: int = 0, steps: int = 200, seed: int = 0) -> RolloutWork:
    """Per trained batch of ``prompts`` groups of ``samples_per_prompt``, in the steady state (the first
    ``staleness + 1`` steps left out): the decode steps and tokens of partial rollouts (``staleness`` > 0, the
    real :class:`PartialPool`) or of the synchronous rollout (0), each response's length drawn by ``lengths``
    (cut at ``max_new_tokens``)."""
    rng = random.Random(seed)
    drawn: dict[tuple[int, int], int] = {}

    def length_of(key: tuple[int, int]) -> int:
        if key not in drawn:
            drawn[key] = min(lengths(rng), max_new_tokens)
        return drawn[key]

    if not staleness:
        batches = [[length_of((g, j)) for g in range(s * prompts, (s + 1) * prompts) for j in range(samples_per_prompt)]
                   for s in range(steps)]
        return RolloutWork(statistics.mean(max(b) for b in batches), statistics.mean(sum(b) for b in batches), 0.0,
                           statistics.mean(sum(b) / (len(b) * max(b)) for b in batches), 0.0)
    pool = PartialPool(staleness, prompts, samples_per_prompt, max_new_tokens, chunk, _Words())
    engine = _Scripted(length_of)
    work = []
    for version in range(steps):
        # after the refresh the carried sequences are prefilled again (vLLM's prefix cache was reset)
        carried = sum(len(t.prompt) + len(t.tokens) for g in pool.groups for t in g.trajectories
                      if t.tokens and not t.done)
        fill = pool.fill(engine, version, lambda k: [k], lambda r: r)
        work.append((fill.decode_steps, fill.drawn_tokens, carried, fill.drawn_tokens / max(fill.lockstep, 1),
                     fill.dropped / samples_per_prompt))
    steady = work[staleness + 1:]
    decode_steps, tokens, prefill, fill, dropped = (statistics.mean(w[i] for w in steady) for i in range(5))
    return RolloutWork(decode_steps, tokens, prefill, fill, dropped / (dropped + prompts))


def project(cost: DecodeCost, sync: RolloutWork, partial: RolloutWork, generation_share: float,
            prefill_s_per_token: float = 0.0) -> dict[str, float]:
    """Step times with the synchronous rollout taking ``generation_share`` of the synchronous step (the rest,
    training, is the same work in both), the carried sequences' prefill at ``prefill_s_per_token``: each one's
    rollout and step seconds, and the step's speed-up."""
    sync_gen = cost.seconds(sync.decode_steps, sync.tokens)
    partial_gen = cost.seconds(partial.decode_steps, partial.tokens) + partial.prefill * prefill_s_per_token
    train = sync_gen * (1 - generation_share) / generation_share
    return {"sync_rollout_s": sync_gen, "partial_rollout_s": partial_gen, "sync_step_s": sync_gen + train,
            "partial_step_s": partial_gen + train, "speedup": (sync_gen + train) / (partial_gen + train)}


def long_tail(longest: int = 256) -> Callable[[random.Random], int]:
    """Log-uniform lengths from 1 to ``longest``: the median is its square root, the tail that many times the
    median (256: median 16, a tail 16x longer)."""

    def draw(rng: random.Random) -> int:
        return max(1, round(longest ** rng.random()))

    return draw
