"""Partial rollouts carried across steps (``rl.max_staleness`` > 0): AReaL's bounded staleness, on the colocated
engine or on rollout ranks of their own (:mod:`syncwise.rl.rollout_rank`, where the weights change between
rounds as the trainers send them).

A synchronous step waits for its longest response while the engine's batch empties (``rollout/decode_fill``).
Here each step samples in rounds of ``rl.partial_chunk_tokens`` tokens over every group in flight; a step ends
as soon as ``rl.prompts_per_rank`` groups have finished (the oldest first train), and the groups still sampling
are carried: after the refresh they continue under the new weights -- prompt and tokens so far resubmitted, so
the engine prefills them with the new weights (vLLM's prefix cache was reset with the refresh; the compact
sampler's state is the sequence itself) -- each token keeping the version that drew it. New prompts, in the
synchronous job's order, are admitted at a round's start while at most ``(max_staleness + 1) x
prompts_per_rank`` groups are in flight (AReaL's capacity rule; by a policy k versions behind the step, k fewer
steps' worth), and a group started more than ``max_staleness`` versions before the step that would train it is
dropped and counted. A stop string (``rl.stop``) split between two rounds ends the response where it ends: the
engine saw its round's tokens only, so the pool checks them with the earlier rounds' tail.

The pool is part of the rank's checkpoint (plain lists, loaded with ``weights_only``): a resumed job continues
the conversations it held, losing no sample and repeating none.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...config.rollout_modes import StalenessBound
from .base import RolloutEngine, Samples, StopStrings, Trajectory


@dataclass
class Group:
    """One prompt's ``samples_per_prompt`` samples, finished or not."""

    index: int  # its place in the job's stream of prompts on this rank (admission order)
    started: int  # the policy version that drew its first tokens
    trajectories: list[Trajectory]

    @property
    def done(self) -> bool:
        return all(t.done for t in self.trajectories)

    def state(self) -> dict[str, Any]:
        return {"index": self.index, "started": self.started, "trajectories": [t.state() for t in self.trajectories]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Group:
        return cls(state["index"], state["started"], [Trajectory.from_state(t) for t in state["trajectories"]])


@dataclass
class Fill:
    """What one step's rounds did on this rank."""

    groups: list[Group]  # the groups that train, oldest first
    drawn_tokens: int  # every token sampled this step (also those of groups still in flight)
    lockstep: int  # over the engine's calls: rows x the call's longest response (the decode batch's capacity)
    decode_steps: int  # over the engine's calls: the call's longest response (the decode steps it ran)
    dropped: int  # samples dropped for age
    rounds: int


class PartialPool:
    """This rank's groups in flight, finished or not, in admission order."""

    def __init__(self, max_staleness: int, groups_per_step: int, n: int, max_new_tokens: int, chunk: int,
                 tokenizer, stop: StopStrings | None = None):
        self.bound, self.groups_per_step, self.n = StalenessBound(max_staleness), groups_per_step, n
        self.max_new_tokens, self.tokenizer, self.stop = max_new_tokens, tokenizer, stop
        self.chunk = min(chunk or max(max_new_tokens // 4, 1), max_new_tokens)
        self.groups: list[Group] = []
        self.admitted = 0  # prompts taken from the stream so far
        # the step under way: tokens drawn, rows x longest per call, samples dropped, longest per call
        self.under_way = dict.fromkeys(("drawn", "lockstep", "dropped", "decode_steps"), 0)

    @property
    def capacity(self) -> int:
        """Groups in flight at most: what the next ``max_staleness + 1`` steps can train."""
        return (self.bound.versions + 1) * self.groups_per_step

    def room(self, step: int, version: int) -> int:
        """Groups in flight at most while step ``step``'s are sampled by the policy of ``version``: what steps
        ``step`` .. ``version + max_staleness`` can train (the capacity colocated, where the version is the
        step's; less on a rollout rank running ahead of the trainers)."""
        return self.bound.steps_drawable(step, version) * self.groups_per_step

    @property
    def max_rounds(self) -> int:
        """A step's rounds at most: every group in flight at its first round (the pool full) has finished
        after these."""
        return math.ceil(self.max_new_tokens / self.chunk)

    def fill(self, engine: RolloutEngine, step: int, prompt_of: Callable[[int], list[int]],
             seed_of: Callable[[int], int], version_now: Callable[[], int] | None = None) -> Fill:
        """Step ``step``'s groups: sample rounds -- one at least, more until ``groups_per_step`` groups have
        finished; those leave the pool, the oldest first. Each round by the policy ``version_now()`` gives at
        its start (None: ``step``'s, the colocated job's; on a rollout rank the newest received, which may change
        between rounds). ``prompt_of(k)``: the stream's k-th prompt; ``seed_of(r)``: round r's first seed."""
        under_way = self.under_way  # the step's counts so far (a rollout rank's snapshot may fall mid-step)
        under_way["dropped"] += self._drop_stale(step)
        rounds = 0
        # at least one round a step (the groups carried move on), more until enough have finished
        while rounds == 0 or sum(g.done for g in self.groups) < self.groups_per_step:
            if rounds == self.max_rounds:
                raise RuntimeError(f"partial rollout: {rounds} rounds without {self.groups_per_step} finished groups")
            version = version_now() if version_now is not None else step
            while len(self.groups) < self.room(step, version):
                prompt = prompt_of(self.admitted)
                self.groups.append(Group(self.admitted, version, [Trajectory(prompt=prompt) for _ in range(self.n)]))
                self.admitted += 1
            rounds += 1
            active = [t for g in self.groups for t in g.trajectories if not t.done]
            if not active:
                continue
            samples = engine.sample([t.prompt + t.tokens for t in active], 1,
                                    min(self.chunk, max(self.max_new_tokens - len(t.tokens) for t in active)),
                                    seed_of(rounds - 1))
            for k, trajectory in enumerate(active):
                under_way["drawn"] += self._take(trajectory, samples, k, version)
            longest = max(len(tokens) for tokens in samples.tokens)
            under_way["lockstep"] += len(active) * longest
            under_way["decode_steps"] += longest
        finished = [g for g in self.groups if g.done][: self.groups_per_step]
        taken = {g.index for g in finished}
        self.groups = [g for g in self.groups if g.index not in taken]
        self.under_way = dict.fromkeys(under_way, 0)
        return Fill(finished, under_way["drawn"], under_way["lockstep"], under_way["decode_steps"],
                    under_way["dropped"], rounds)

    def _drop_stale(self, step: int) -> int:
        """Drop the groups started by a policy more than ``max_staleness`` versions before ``step``, which would
        train them."""
        kept = [g for g in self.groups if self.bound.keeps(step, g.started)]
        dropped = (len(self.groups) - len(kept)) * self.n
        self.groups = kept
        return dropped

    def _take(self, trajectory: Trajectory, samples: Samples, k: int, version: int) -> int:
        """Sample ``k`` appended to the trajectory (cut to its room); done where it ended or filled its room.
        Returns the tokens taken."""
        before = len(trajectory.tokens)
        tokens, ended = trajectory.take(samples, k, self.max_new_tokens, version)
        if self.stop and before:  # the engine saw this round's tokens only: a string begun in an earlier round
            end = self.stop.first_end(trajectory.tokens, before)
            if end is not None:
                trajectory.cut(end)
                tokens, ended = tokens[: end - before], True
        if ended or len(trajectory.tokens) >= self.max_new_tokens:
            trajectory.done, trajectory.ended = True, ended
            trajectory.counts["turns"] = 1
            trajectory.text = self.tokenizer.decode(trajectory.tokens, skip_special_tokens=True)
        return len(tokens)

    def state_dict(self) -> dict[str, Any]:
        """The pool now (its lists are the live ones: saved there and then, as a checkpoint does)."""
        return {"admitted": self.admitted, "groups": [g.state() for g in self.groups],
                "under_way": dict(self.under_way)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted = int(state["admitted"])
        self.groups = [Group.from_state(g) for g in state["groups"]]
        self.under_way.update(state.get("under_way", {}))  # older checkpoints: saved between steps, none
