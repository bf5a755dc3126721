"""The rollout room's door: what every rollout engine implements (:class:`RolloutEngine`), what it is built
from (:class:`RolloutSetup`: a plain record, no training engine), what it returns (:class:`Samples`), the
per-sample record every rollout ends in (:class:`Trajectory`: one turn or several), and the sampling seeds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch

from ...config import RLConfig


@dataclass
class Samples:
    """Per sequence (``samples_per_prompt`` consecutive ones per prompt): the response tokens (up to and
    including the end-of-sequence token) and the sampler's log-prob of each -- of the distribution it was drawn
    from (``log_probs``; None where the engine does not report it) and of the untruncated one
    (``full_log_probs``; the same tensors without truncation)."""

    tokens: list[torch.Tensor]
    log_probs: list[torch.Tensor] | None
    computed_rows: int  # sequence-steps computed (the padded loop's would be sequences x longest response)
    ended: list[bool] = None  # ended by an end token or a stop string (False: cut by max_new_tokens)
    full_log_probs: list[torch.Tensor] = None
    # a mixture of experts' routes (rl.router_replay): per token of prompt + response, each layer's k experts
    routes: list[torch.Tensor] | None = None


@dataclass
class RolloutSetup:
    """What a rollout engine is built from on this rank: the policy's plain Hugging Face config (LoRA merged),
    where and how to sample, and what training holds beside it (for an engine that plans its memory)."""

    hf_config: Any
    device: torch.device
    rl: RLConfig  # the sampling settings (temperature, truncation, stop strings, dtype, the engine's own keys)
    tokenizer: Any
    end_ids: list[int]  # every token that ends a response
    max_new_tokens: int
    seed: int  # the job's (train.seed)
    memory_budget: int  # this rank's budget in bytes (sync.memory_budget resolved)
    training_bytes: int = 0  # what this rank's training needs at the least beside the engine
    record_routes: bool = False  # a mixture of experts' chosen experts per token (rl.router_replay)


class RolloutEngine(Protocol):
    """What samples the responses (``rl.rollout_engine``): each engine one module, one entry in the table
    :data:`syncwise.config.rollout_engines.ROLLOUT_ENGINES`."""

    def held_bytes(self) -> int:
        """What the engine keeps in memory on this rank for the whole job (its weights, a KV cache it keeps)."""

    def refresh(self, weights_by_unit: Iterator[dict[str, torch.Tensor]]) -> None:
        """Load the policy's current weights, given one wrapping unit at a time, keyed as the plain Hugging Face
        model's (LoRA merged). Collective through the iterator: consume it all."""

    def sample(self, prompts: list[list[int]], n: int, max_new_tokens: int, seed: int | list[int]) -> Samples:
        """``n`` responses per prompt (consecutive), each with its drawn tokens' log-probs under the untruncated
        temperature-scaled distribution (``full_log_probs``) and, where the engine knows it, under the one it
        drew from (``log_probs``, else None). ``seed``: the first of ``len(prompts) * n`` consecutive seeds
        reserved for this call (:func:`sample_seed`), sample k of prompt i's ``seed + i * n + k`` (vLLM's; the
        local copy seeds torch's generator with it for the call): what is drawn depends on nothing else. A list:
        each sequence's own seed (prompt-major, :func:`sequence_seeds`), and each sequence's draws depend on its
        seed alone -- not on the call's other sequences (the agent endpoint batches whichever requests arrived
        together, so a resumed job draws alike only so)."""

    def release(self) -> None:
        """A rollout is over (every turn sampled): free what the engine need not hold through the update, until
        the next :meth:`refresh` (vLLM's sleep mode on CUDA)."""

    def describe(self) -> str:
        """A few words for the job's first line."""


class StopStrings:
    """Whether a response's text contains one of the stop strings (decoded as it grows: only its tail)."""

    def __init__(self, strings: list[str], tokenizer):
        self.strings, self.tokenizer = list(strings), tokenizer
        # enough trailing tokens to hold the longest stop string (a token is at least one character)
        self.window = max((len(s) for s in self.strings), default=0) + 2

    def __bool__(self) -> bool:
        return bool(self.strings)

    def hit(self, tokens: list[int]) -> bool:
        tail = self.tokenizer.decode(tokens[-self.window:], skip_special_tokens=False)
        return any(s in tail for s in self.strings)

    def first_end(self, tokens: list[int], start: int) -> int | None:
        """A stop string begun before token ``start`` and completed after it (a partial rollout's rounds: the
        engine saw the tokens from ``start`` only): the length up to the token that completes it, or None."""
        for end in range(start + 1, min(len(tokens), start + self.window) + 1):
            if self.hit(tokens[:end]):
                return end
        return None


@dataclass
class Trajectory:
    """One sample, however many turns it took: its prompt, and after it every token (sampled, or the template's text
    between turns), which were sampled (1: trained) and which not (0), the sampler's log-prob of each (of the
    untruncated distribution; of the one it drew from, or None where the engine does not say; 0 where
    nothing was sampled), what the reward function sees (``response``: the text, or with tools the messages
    after the prompt), whether the last turn ended by itself, what happened on the way (``counts``), and which
    policy version drew each token (a partial rollout's tokens span versions) -- everything plain, so a conversation
in flight goes into a checkpoint as it is."""

    prompt: list[int] = field(default_factory=list)  # the prompt's tokens it follows
    opening: str | None = None  # what its episode said first, appended to the prompt's last user message
    tokens: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    full_log_probs: list[float] = field(default_factory=list)
    drawn_log_probs: list[float] | None = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # with tools: assistant and tool messages
    text: str = ""  # without tools: the response decoded
    ended: bool = False  # not cut by rl.max_new_tokens
    done: bool = False
    env_reward: float | None = None  # the episode's own score (an environment's reward()), if it gives one
    counts: Counter = field(default_factory=Counter)  # turns, tool calls, answer kinds, each error kind
    versions: list[int] = field(default_factory=list)  # per token: the policy version that drew it (RL steps taken)
    turn_start: int = 0  # where in ``tokens`` the assistant turn under way began (a partial rollout's rounds)
    routes: Any = None  # a mixture of experts' sampled routes (one turn's, rl.router_replay): [tokens, layers, k]

    def add(self, tokens: list[int], sampled: bool, full: list[float] | None = None,
            drawn: list[float] | None = None, version: int = 0) -> None:
        self.tokens += tokens
        self.versions += [version] * len(tokens)
        self.sampled += [int(sampled)] * len(tokens)
        self.full_log_probs += full if full is not None else [0.0] * len(tokens)
        if self.drawn_log_probs is not None:
            if sampled and drawn is None:
                self.drawn_log_probs = None  # the engine does not report the drawn distribution
            else:
                self.drawn_log_probs += drawn if drawn is not None else [0.0] * len(tokens)

    def take(self, samples: Samples, k: int, max_new_tokens: int, version: int) -> tuple[list[int], bool]:
        """Sample ``k`` of an engine call appended as drawn by ``version`` (cut to the room ``max_new_tokens``
        leaves); the tokens taken, and whether the engine ended the sample within that room."""
        tokens = samples.tokens[k].tolist()
        room = max_new_tokens - len(self.tokens)
        ended = bool(samples.ended[k]) and len(tokens) <= room
        tokens = tokens[:room]
        if samples.routes is not None:  # one turn: the prompt's routes, then the response's
            self._take_routes(samples.routes[k][: len(self.prompt) + len(self.tokens) + len(tokens)])
        drawn = samples.log_probs[k][: len(tokens)].float().tolist() if samples.log_probs is not None else None
        self.add(tokens, sampled=True, full=samples.full_log_probs[k][: len(tokens)].float().tolist(), drawn=drawn,
                 version=version)
        return tokens, ended

    def _take_routes(self, routes: torch.Tensor) -> None:
        """A call's routes of prompt + tokens so far + its own: the first call's whole; a partial rollout's next
        round keeps the routes each earlier token was fed with and takes the rest -- the last token before the round
        (never fed then: -1) from the round's prefill, which fed it, and the round's own tokens'."""
        if self.routes is None or not self.tokens:
            self.routes = routes
            return
        fed = len(self.prompt) + len(self.tokens) - 1  # the last token so far, fed by this round's prefill
        self.routes = torch.cat([self.routes[:fed], routes[fed:]])

    def cut(self, length: int) -> None:
        """Only the first ``length`` tokens kept (what came after a stop string a round's sample ran past)."""
        if self.routes is not None:
            self.routes = self.routes[: len(self.prompt) + length]
        del self.tokens[length:], self.versions[length:], self.sampled[length:], self.full_log_probs[length:]
        if self.drawn_log_probs is not None:
            del self.drawn_log_probs[length:]

    def state(self) -> dict[str, Any]:
        """Plain lists, numbers and strings (a checkpoint loads it with ``weights_only``)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "counts": dict(self.counts)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Trajectory:
        return cls(**{**state, "counts": Counter(state["counts"])})


# vLLM seeds a torch.Generator per request: any value below 2**64 is taken as it is
SEED_SPACE = 2**62
SEED_SHIFT = 0x9E3779B1  # 2**32 / the golden ratio, odd


def sequence_seeds(seed: int | list[int], prompts: int, n: int) -> list[int]:
    """Each of a call's ``prompts * n`` sequences' seed (prompt-major): a call's first seed gives sample k of
    prompt i ``seed + i * n + k``; a list is one per sequence already."""
    if isinstance(seed, int):
        return [seed + k for k in range(prompts * n)]
    if len(seed) != prompts * n:
        raise ValueError(f"{len(seed)} seeds for {prompts} prompts x {n} samples")
    return list(seed)


def sample_seed(seed: int, step: int, rank: int, world_size: int, turn: int, turns: int, sequences: int) -> int:
    """The first of ``sequences`` consecutive sampling seeds reserved for (job seed, step, rank, turn): an engine
    that seeds each sample gives sample k of prompt i ``base + i * n + k`` (vLLM adds k to a request's seed for
    its n samples), so no two samples of a job -- across steps, ranks, turns, prompts and samples -- share a seed
    (up to 2**40 of them), and a resumed job draws the same."""
    index = ((step * world_size + rank) * turns + turn) * sequences
    # a CPU torch.Generator (the local samplers', vLLM's on CPU) keeps a seed's low 32 bits only: the job's seed
    # shifts them too -- by a large odd step, so a job's seeds stay consecutive and distinct there -- or every
    # job seed would draw job seed 0's samples (they did); seed 0's values are unchanged
    return (seed * 2**40 + index + seed * SEED_SHIFT) % SEED_SPACE
