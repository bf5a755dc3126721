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

A multi-turn job (``rl.tools``, ``rl.environment``) carries whole conversations: a round advances each one's
turn under way -- to its end unless ``rl.partial_chunk_tokens`` is set (then by up to a chunk, a turn continued
under a newer policy after a refresh); a turn that ends in the round is parsed and its tool calls run -- every
conversation's of the round side by side, as the turn loop runs a turn's (:mod:`syncwise.rl.rollout.turns`) --,
the answers appended through the chat template, and the next turn is sampled from the next round on. So no
tool call is ever under way between two rounds: what a conversation carries is its trajectory (the turns so far,
each token's version, the tool messages, its counts) and its episode -- one environment instance per
conversation, opened when its group is admitted, scored (``reward()``) when it ends, closed once the trainer has
scored it. A conversation can run ``ceil(max_new_tokens / chunk) + max_turns`` rounds at most.

The pool is part of the rank's checkpoint (plain lists, loaded with ``weights_only``): a resumed job continues
the conversations it held, losing no sample and repeating none. An episode goes in as its environment's
``state()`` (a class's own ``__getstate__``); a group with an episode that cannot be saved is dropped when the
checkpoint is taken -- in the job that goes on as in the one resumed from it -- closed and counted with the
dropped samples.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...config.rollout_modes import StalenessBound
from ..env.base import NOT_SAVED, Environment
from .base import RolloutEngine, Samples, StopStrings, Trajectory
from .turns import EndedTurn, TurnLoop

# a multi-turn job's prompts: the row of the stream's k-th prompt and the tool schemas its prompt shows
RowOf = Callable[[int], tuple[dict[str, Any], list[dict[str, Any]] | None]]


@dataclass
class Group:
    """One prompt's ``samples_per_prompt`` samples, finished or not (multi-turn: with each one's episode)."""

    index: int  # its place in the job's stream of prompts on this rank (admission order)
    started: int  # the policy version that drew its first tokens
    trajectories: list[Trajectory]
    episodes: list[Environment] | None = None  # multi-turn: each conversation's, open until scored
    saved: list[Any] | None = None  # multi-turn, loaded from a checkpoint: the episodes' states, until reopened

    @property
    def done(self) -> bool:
        return all(t.done for t in self.trajectories)

    def episode_states(self) -> list[Any] | None:
        """Each episode's ``state()`` (``NOT_SAVED`` where it cannot be saved); None single-turn."""
        return [e.state() for e in self.episodes] if self.episodes is not None else self.saved

    def state(self, episodes: list[Any] | None = None) -> dict[str, Any]:
        """Plain data; ``episodes``: the episodes' states where already asked for."""
        episodes = episodes if episodes is not None else self.episode_states()
        return {"index": self.index, "started": self.started, "trajectories": [t.state() for t in self.trajectories],
                **({"episodes": episodes} if episodes is not None else {})}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Group:
        return cls(state["index"], state["started"], [Trajectory.from_state(t) for t in state["trajectories"]],
                   saved=state.get("episodes"))

    def close(self) -> None:
        """Its episodes closed, quietly (a group dropped unscored, or a job's end with it in flight)."""
        for episode in self.episodes or []:
            with contextlib.suppress(Exception):
                episode.close()
        self.episodes = None


@dataclass
class Fill:
    """What one step's rounds did on this rank."""

    groups: list[Group]  # the groups that train, oldest first
    drawn_tokens: int  # every token sampled this step (also those of groups still in flight)
    lockstep: int  # over the engine's calls: rows x the call's longest response (the decode batch's capacity)
    decode_steps: int  # over the engine's calls: the call's longest response (the decode steps it ran)
    dropped: int  # samples dropped for age (or at a checkpoint, their episodes unsaved)
    rounds: int
    tool_s: float = 0.0  # in the tools: opening episodes, running calls, putting answers in the conversations


class PartialPool:
    """This rank's groups in flight, finished or not, in admission order. ``turns`` (a multi-turn job's turn
    loop) with ``row_of``: conversations with tools and episodes; else single-turn samples."""

    def __init__(self, max_staleness: int, groups_per_step: int, n: int, max_new_tokens: int, chunk: int,
                 tokenizer, stop: StopStrings | None = None, turns: TurnLoop | None = None,
                 row_of: RowOf | None = None):
        self.bound, self.groups_per_step, self.n = StalenessBound(max_staleness), groups_per_step, n
        self.max_new_tokens, self.tokenizer, self.stop = max_new_tokens, tokenizer, stop
        self.turns = turns if turns is not None and turns.multi_turn else None
        self.row_of = row_of
        # unset: a quarter of the response limit; for conversations the whole room, so a round ends each one's
        # turn and no turn is continued under a newer policy (the guess_number recipe at max_staleness 1, lr 1e-4:
        # rounds of 64 tokens fell apart in 3 of 4 seeds, whole turns in 2 -- those a lag of 1 fell apart in too)
        default = max_new_tokens if self.turns is not None else max(max_new_tokens // 4, 1)
        self.chunk = min(chunk or default, max_new_tokens)
        self.groups: list[Group] = []
        self.admitted = 0  # prompts taken from the stream so far
        # the step under way: tokens drawn, rows x longest per call, samples dropped, longest per call, tool time
        self.under_way = dict.fromkeys(("drawn", "lockstep", "dropped", "decode_steps", "tool_s"), 0)
        self.unsaved = 0  # groups the last state_dict dropped, an episode of theirs unsaved

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
        after these (a round each chunk, and multi-turn one more per turn, which may end mid-round)."""
        return math.ceil(self.max_new_tokens / self.chunk) + (self.turns.max_turns if self.turns else 0)

    def fill(self, engine: RolloutEngine, step: int, prompt_of: Callable[[int], list[int]],
             seed_of: Callable[[int], int], version_now: Callable[[], int] | None = None) -> Fill:
        """Step ``step``'s groups: sample rounds -- one at least, more until ``groups_per_step`` groups have
        finished; those leave the pool, the oldest first. Each round by the policy ``version_now()`` gives at
        its start (None: ``step``'s, the colocated job's; on a rollout rank the newest received, which may change
        between rounds). ``prompt_of(k)``: the stream's k-th prompt; ``seed_of(r)``: round r's first seed."""
        under_way = self.under_way  # the step's counts so far (a rollout rank's snapshot may fall mid-step)
        under_way["dropped"] += self._drop_stale(step)
        if self.turns is not None:
            self.turns.runner.new_step()  # rl.tool_step_timeout_s: this step's calls
            with _timed(under_way):
                self._reopen()  # after a resume: the checkpoint's conversations get their episodes back
        rounds = 0
        # at least one round a step (the groups carried move on), more until enough have finished
        while rounds == 0 or sum(g.done for g in self.groups) < self.groups_per_step:
            if rounds == self.max_rounds:
                raise RuntimeError(f"partial rollout: {rounds} rounds without {self.groups_per_step} finished groups")
            version = version_now() if version_now is not None else step
            with _timed(under_way):  # admission opens the new conversations' episodes
                while len(self.groups) < self.room(step, version):
                    self.groups.append(self._admit(prompt_of(self.admitted), version))
            rounds += 1
            active = [(g, i) for g in self.groups for i, t in enumerate(g.trajectories) if not t.done]
            if not active:
                continue
            room = max(self.max_new_tokens - len(g.trajectories[i].tokens) for g, i in active)
            samples = engine.sample([g.trajectories[i].prompt + g.trajectories[i].tokens for g, i in active], 1,
                                    min(self.chunk, room), seed_of(rounds - 1))
            calling: list[EndedTurn] = []
            for k, (group, i) in enumerate(active):
                under_way["drawn"] += self._take(group, i, samples, k, version, calling)
            longest = max(len(tokens) for tokens in samples.tokens)
            under_way["lockstep"] += len(active) * longest
            under_way["decode_steps"] += longest
            if calling:
                self.turns.version = version
                under_way["tool_s"] += self.turns.answer(calling, self.max_new_tokens)
            for group, i in active:  # a conversation over: its episode's own score, while it is as it ended
                if group.episodes is not None and group.trajectories[i].done:
                    group.trajectories[i].env_reward = group.episodes[i].reward()
        finished = [g for g in self.groups if g.done][: self.groups_per_step]
        taken = {g.index for g in finished}
        self.groups = [g for g in self.groups if g.index not in taken]
        self.under_way = dict.fromkeys(under_way, 0)
        return Fill(finished, under_way["drawn"], under_way["lockstep"], under_way["decode_steps"],
                    under_way["dropped"], rounds, float(under_way["tool_s"]))

    def _admit(self, prompt: list[int], version: int) -> Group:
        """The stream's next prompt as a group started by ``version`` (multi-turn: each conversation's episode
        opened from its row, which may change its prompt)."""
        group = Group(self.admitted, version, [Trajectory(prompt=prompt) for _ in range(self.n)])
        if self.turns is not None:
            row, schemas = self.row_of(self.admitted)
            group.episodes = []
            try:
                for trajectory in group.trajectories:
                    group.episodes.append(self.turns.open(row, schemas, trajectory))
            except BaseException:
                group.close()
                raise
        self.admitted += 1
        return group

    def _reopen(self) -> None:
        """The episodes of the groups a checkpoint held, each rebuilt from its row and restored to its state."""
        for group in self.groups:
            if self.turns is None or group.episodes is not None or group.saved is None:
                continue
            row = self.row_of(group.index)[0]
            group.episodes = []
            try:
                for state in group.saved:
                    group.episodes.append(self.turns.episode(row))
                    group.episodes[-1].restore(row, state)
            except BaseException:
                group.close()
                raise
            group.saved = None

    def _drop_stale(self, step: int) -> int:
        """Drop the groups started by a policy more than ``max_staleness`` versions before ``step``, which would
        train them."""
        kept, dropped = [], 0
        for group in self.groups:
            if self.bound.keeps(step, group.started):
                kept.append(group)
            else:
                group.close()
                dropped += 1
        self.groups = kept
        return dropped * self.n

    def _take(self, group: Group, i: int, samples: Samples, k: int, version: int, calling: list[EndedTurn]) -> int:
        """Sample ``k`` appended to the group's trajectory ``i`` (cut to its room); where its turn ended (or
        filled the room) the turn is over: a single-turn sample done, a conversation's turn parsed -- its calls
        into ``calling``, or the conversation done. Returns the tokens taken."""
        trajectory = group.trajectories[i]
        before, turn = len(trajectory.tokens), trajectory.turn_start
        tokens, ended = trajectory.take(samples, k, self.max_new_tokens, version)
        if self.stop and before > turn:  # the engine saw this round's tokens only: a string begun in an earlier one
            end = self.stop.first_end(trajectory.tokens[turn:], before - turn)
            if end is not None:
                trajectory.cut(turn + end)
                tokens, ended = tokens[: turn + end - before], True
        if not ended and len(trajectory.tokens) < self.max_new_tokens:
            return len(tokens)  # the turn goes on next round
        if self.turns is None:
            trajectory.done, trajectory.ended = True, ended
            trajectory.counts["turns"] = 1
            trajectory.text = self.tokenizer.decode(trajectory.tokens, skip_special_tokens=True)
            return len(tokens)
        last = trajectory.counts["turns"] == self.turns.max_turns - 1
        parsed = self.turns.end_turn(trajectory, trajectory.tokens[turn:], ended, last)
        if parsed is not None:
            row, schemas = self.row_of(group.index)
            calling.append(EndedTurn(trajectory, group.episodes[i], parsed, row, schemas))
        return len(tokens)

    def state_dict(self) -> dict[str, Any]:
        """The pool now (its lists are the live ones: saved there and then, as a checkpoint does). A group with
        an episode that cannot be saved is dropped first, closed and counted (``unsaved``: how many)."""
        groups, kept = [], []
        for group in self.groups:
            states = group.episode_states()
            if states is not None and any(s is NOT_SAVED for s in states):
                group.close()
                continue
            kept.append(group)
            groups.append(group.state(states))
        self.unsaved = len(self.groups) - len(kept)
        self.under_way["dropped"] += self.unsaved * self.n
        self.groups = kept
        return {"admitted": self.admitted, "groups": groups, "under_way": dict(self.under_way)}

    def unsaved_words(self) -> str:
        """The last save's drop in a line ('' where it dropped nothing)."""
        if not self.unsaved:
            return ""
        name = self.turns.environment if self.turns is not None else "the environment"
        return (f"{self.unsaved} group(s) in flight ({self.unsaved * self.n} conversations) dropped at the checkpoint: "
                f"{name} has no __getstate__ / __setstate__ of its own to save an episode with (or a tool call "
                "still hung in one)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.admitted = int(state["admitted"])
        self.groups = [Group.from_state(g) for g in state["groups"]]
        self.under_way.update(state.get("under_way", {}))  # older checkpoints: saved between steps, none

    def close(self) -> None:
        """The episodes of every conversation in flight closed (the job's end)."""
        for group in self.groups:
            group.close()


@contextlib.contextmanager
def _timed(under_way: dict[str, float]):
    """The block's time added to the step's time in the tools (``under_way["tool_s"]``)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        under_way["tool_s"] += time.perf_counter() - started
