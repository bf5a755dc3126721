"""Scored rollout batches, and the queue of those drawn ahead for an off-policy job (``rl.off_policy_lag``).

A :class:`ScoredBatch` is what a step trains on: one step's prompts sampled, scored, its episodes closed, with
the policy version that drew it (the number of RL steps the policy had taken). A synchronous job draws the
step's own batch at the step's version; with a lag k, :class:`RolloutQueue` keeps each rank k batches ahead --
step t trains on the batch of its own prompts drawn by the policy of step max(t - k, 0) -- as verl's
one-step-off-policy and prime-rl's default do, so staleness is exactly min(t, k) and a job repeats itself
run to run. The queue is part of a checkpoint (plain tensors, loaded with ``weights_only``), so a resumed job
trains on what the uninterrupted one would, losing no sample and repeating none.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from .front import RolloutResult

DECODE_FIELDS = ("drawn_tokens", "lockstep", "dropped", "decode_steps")


@dataclass
class ScoredBatch:
    """One step's rollout on this rank, scored: the training batch, the sampler's (behaviour) log-probs, the
    rewards, and what the step's statistics read."""

    step: int  # whose prompts and seeds these are
    version: int  # the policy that drew every token: RL steps it had taken
    batch: dict[str, torch.Tensor]  # input_ids, attention_mask, loss_mask
    log_probs: torch.Tensor  # [B, T-1] the behaviour policy's, aligned with the targets
    rewards: torch.Tensor  # [B] the weighted total
    reward_parts: dict[str, torch.Tensor]  # each reward source's
    episode_metrics: list[dict[str, Any]]  # what each environment said about its episode
    response_lengths: torch.Tensor
    clipped: torch.Tensor  # cut by the length limit
    kept_mass: torch.Tensor  # what truncation kept, per sampled token (empty where the engine does not say)
    tool_counts: torch.Tensor | None  # with tools: TOOL_COUNTS summed over the samples
    tool_s: float
    started: torch.Tensor | None = None  # [B] per sample, the version that drew its first token (None: version)
    # partial rollouts' decode batch (:data:`DECODE_FIELDS`): tokens drawn, rows x longest response summed over the
    # engine calls, samples dropped for age, decode steps
    decode: dict[str, float] | None = None
    # drawn on a rollout rank: its seconds [sampling, scoring, idle waiting for weights, receiving them]; the last
    # two on the first batch it drew by those weights for this trainer, else 0
    rollout_rank_s: torch.Tensor | None = None
    # per sample, what the completions table shows of it (:mod:`syncwise.rl.transcripts`): plain strings and numbers
    transcripts: list[dict[str, Any]] | None = None
    # what TRL-signature rewards logged with log_metric while scoring it: {name: value} a call
    reward_metrics: list[dict[str, float]] | None = None
    # rl.agent: per row (a session's segment), the sample it is; None: each row its own sample
    sample_index: torch.Tensor | None = None
    agent_counts: torch.Tensor | None = None  # rl.agent: AGENT_COUNTS summed over the samples

    @classmethod
    def of(cls, step: int, version: int, result: RolloutResult, rewards: torch.Tensor,
           reward_parts: dict[str, torch.Tensor], episode_metrics: list[dict[str, Any]],
           transcripts: list[dict[str, Any]] | None = None,
           reward_metrics: list[dict[str, float]] | None = None) -> ScoredBatch:
        started = torch.tensor([min(t.versions, default=version) for t in result.trajectories])
        agent = result.agent
        return cls(step, version, dict(result.batch), result.log_probs, rewards, reward_parts, episode_metrics,
                   result.response_lengths, result.clipped, result.kept_mass, result.tool_counts, result.tool_s,
                   started, result.decode, transcripts=transcripts, reward_metrics=reward_metrics,
                   sample_index=torch.tensor(agent.sample_of) if agent is not None else None,
                   agent_counts=agent.counts if agent is not None else None)

    def per_sample(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` per row as one per sample (a sample's segments carry its value: the first row's)."""
        if self.sample_index is None:
            return values
        first = torch.ones_like(self.sample_index, dtype=torch.bool)
        first[1:] = self.sample_index[1:] != self.sample_index[:-1]
        return values[first]

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """One value per sample spread over its rows (its segments)."""
        return values if self.sample_index is None else values[self.sample_index]

    @property
    def start_versions(self) -> torch.Tensor:
        return self.started if self.started is not None else torch.full((len(self.rewards),), self.version)

    def state(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ScoredBatch:
        batch = cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})  # older ones lack the last
        if isinstance(batch.decode, torch.Tensor):  # a checkpoint of before the fields had names
            batch.decode = dict(zip(DECODE_FIELDS, batch.decode.tolist(), strict=True))
        return batch


class RolloutQueue:
    """This rank's batches drawn ahead of training: with ``lag`` k, after step t's draw it holds the batches
    of steps t .. t + k (never past the job's last step); :meth:`take` hands over step t's. Lag 0: one batch,
    drawn and taken in the same step (the synchronous job)."""

    def __init__(self, lag: int, steps: int):
        self.lag, self.steps = lag, steps
        self.ready: list[ScoredBatch] = []
        self.next_step = 0  # the first step not drawn yet

    def to_draw(self, step: int) -> list[int]:
        """The steps whose batches are drawn now, before step ``step`` trains (by the current policy)."""
        self.next_step = max(self.next_step, step)  # a job that starts at ``step`` with nothing ahead
        return list(range(self.next_step, min(step + self.lag + 1, self.steps)))

    def add(self, scored: ScoredBatch) -> None:
        if scored.step != self.next_step:
            raise RuntimeError(f"rollout queue: drew step {scored.step}'s batch, expected step {self.next_step}'s")
        self.ready.append(scored)
        self.next_step += 1

    def take(self, step: int) -> ScoredBatch:
        if not self.ready or self.ready[0].step != step:
            held = [s.step for s in self.ready]
            raise RuntimeError(f"rollout queue: step {step} has no batch (holding steps {held})")
        return self.ready.pop(0)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank's queue: the batches drawn ahead, plain tensors and numbers."""
        return {"lag": self.lag, "next_step": self.next_step, "ready": [s.state() for s in self.ready]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The batches a checkpoint's job had drawn ahead (under another lag too: they train first, in order)."""
        self.next_step = int(state["next_step"])
        self.ready = [ScoredBatch.from_state(s) for s in state["ready"]]
