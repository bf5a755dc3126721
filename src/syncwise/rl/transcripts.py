"""What each sample of a step was, as the completions table (:mod:`syncwise.logs.completions`) shows it: the prompt and
the completion as readable text (a conversation's tool calls and tool answers marked), the completion's messages as
JSON, how it ended, its turns, calls and tool errors -- plain strings and numbers, drawn with the batch and kept with
it (a lagged job's queue, a checkpoint, a rollout rank's mailbox) -- and, at the step that trains on it, its
rewards, advantage, length and policy version beside them."""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ..runtime.distributed import gather_to_main
from .env.tools import ERROR_KINDS
from .rollout.base import Trajectory
from .rollout.queue import ScoredBatch
from .rollout.turns import opened

FINISH_REASONS = ("eos", "stop", "length", "tool_error")


def conversation_text(messages: list[dict[str, Any]]) -> str:
    """Messages as text a person reads: ``role: content`` a message, a tool call on its own line after its
    assistant turn (``-> tool name(arguments)``), a tool's answer as ``tool (name): content``."""
    lines = []
    for message in messages:
        role = message.get("role", "?")
        name = f" ({message['name']})" if role == "tool" and message.get("name") else ""
        lines.append(f"{role}{name}: {message.get('content') or ''}")
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            arguments = function.get("arguments")
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            lines.append(f"  -> tool call {function.get('name')}({arguments})")
    return "\n".join(lines)


def finish_reason(trajectory: Trajectory, end_ids: list[int]) -> str:
    """How the sample ended: ``length`` (cut by rl.max_new_tokens), ``tool_error`` (a tool answer the template
    could not take: the conversation could not go on), ``eos`` (an end token), ``stop`` (an rl.stop string)."""
    if not trajectory.ended:
        return "length"
    if trajectory.counts["refused_by_template"]:
        return "tool_error"
    return "eos" if trajectory.tokens and trajectory.tokens[-1] in end_ids else "stop"


def transcripts(trajectories: list[Trajectory], prompts: list[Any], end_ids: list[int]) -> list[dict[str, Any]]:
    """Each sample's transcript (``prompts``: each sample's row prompt, a string or messages)."""
    out = []
    for trajectory, prompt in zip(trajectories, prompts, strict=True):
        shown = opened(prompt, trajectory.opening) if trajectory.opening is not None or isinstance(prompt, list) \
            else prompt
        multi_turn = bool(trajectory.messages)
        out.append({
            "prompt": shown if isinstance(shown, str) else conversation_text(shown),
            "completion": conversation_text(trajectory.messages) if multi_turn else trajectory.text,
            "messages": json.dumps(trajectory.messages if multi_turn else
                                   [{"role": "assistant", "content": trajectory.text}], ensure_ascii=False),
            "finish_reason": finish_reason(trajectory, end_ids),
            "turns": int(trajectory.counts["turns"]),
            "tool_calls": int(trajectory.counts["tool_calls"]),
            "tool_errors": int(sum(trajectory.counts[kind] for kind in ERROR_KINDS)),
        })
    return out


def completion_rows(scored: ScoredBatch, advantages: torch.Tensor | None, step: int,
                    off_policy: bool) -> list[dict[str, Any]]:
    """The table's rows of this rank's samples trained at ``step`` (1-based): each transcript with its total
    reward, each reward source's value (None where a function gave none), the advantage (``advantages``: one per
    sample, GRPO's; None for PPO, whose advantages are per token), the length in tokens after the prompt, and
    off-policy the version that drew its first token and how many steps behind it is."""
    rows = []
    for i, transcript in enumerate(scored.transcripts or []):
        parts = {f"reward/{name}": _number(values[i]) for name, values in scored.reward_parts.items()}
        row = {"step": step, "prompt": transcript["prompt"], "completion": transcript["completion"],
               "reward": float(scored.rewards[i]), **parts,
               "advantage": float(advantages[i]) if advantages is not None else None,
               "length": int(scored.response_lengths[i]),
               **{k: v for k, v in transcript.items() if k not in ("prompt", "completion")}}
        if off_policy:
            version = int(scored.start_versions[i])
            row.update({"policy_version": version, "staleness": step - 1 - version})
        rows.append(row)
    return rows


def _number(value: Any) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


def step_completions(scored: ScoredBatch, advantages: torch.Tensor | None, done: int, config: Any
                     ) -> list[dict[str, Any]] | None:
    """Collective where due (``train.log_completions_every``, and the last step): every rank's samples of step
    ``done`` with their rewards and advantages (None: PPO's, not known yet), gathered; rank 0 gets the rows of
    the completions table, the other ranks (and a step not due) None."""
    every = config.train.log_completions_every
    if not every or (done % every and done != config.train.steps):
        return None
    rows = completion_rows(scored, advantages, done, config.rl.is_off_policy)
    gathered = gather_to_main(rows, "the completions table's gather", config.dist.timeout_s)
    return None if gathered is None else [row for rank_rows in gathered for row in rank_rows]
