"""Multi-turn rollouts with tools (``rl.tools``): every sample is its own conversation -- an assistant turn is
sampled, its tool calls parsed in the model family's format (:mod:`syncwise.rl.tool_calls`) and run
(:mod:`syncwise.rl.tools`), their results appended through the chat template, and the next turn sampled --
until a turn calls nothing, ``rl.max_turns`` turns, or ``rl.max_new_tokens`` tokens after the prompt.

The rollout engine is asked one turn at a time (:class:`~syncwise.rl.rollout.RolloutEngine`'s ``sample``; the
first turn ``samples_per_prompt`` per prompt, later ones one per conversation still going), so every engine
runs it; vLLM's prefix cache keeps the conversation so far between turns.

The sequence that trains is exactly the one sampled: the prompt's tokens, each turn's sampled tokens as
drawn (never re-tokenised), and between turns the template's text for the tool results tokenised once --
what the template adds after the assistant turn (its separator after the end-of-turn token, the tool
messages, the next generation prompt), found by rendering the conversation with and without them. The loss
mask is on the sampled tokens only (tool calls included; tool results and template text not), and the
sampler's log-probs are kept for exactly those, so ``rollout/log_prob_diff``, ``rl.loss.rollout_is`` and the
PPO ratio see the same positions as the loss.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import RLConfig
from ..data.chat import refusal
from .prompts import prompt_messages
from .tool_calls import ParsedTurn, choose_parser, parse_turn
from .tool_runner import ERROR_KINDS, Tool, run_tool

TOOL_COUNTS = ("turns", "tool_calls", *ERROR_KINDS, "refused_by_template")


@dataclass
class Conversation:
    """One sample after its prompt: every token (sampled or the template's), which were sampled, their
    log-probs (0 elsewhere), and the messages as the reward function sees them."""

    tokens: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # 1: drawn by the policy (trained), 0: template / tool text
    full_log_probs: list[float] = field(default_factory=list)
    drawn_log_probs: list[float] | None = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # after the prompt: assistant and tool messages
    ended: bool = False  # the last turn ended by itself (not cut by rl.max_new_tokens)
    done: bool = False
    counts: Counter = field(default_factory=Counter)  # turns, tool_calls and each error kind

    def add(self, tokens: list[int], sampled: bool, full: list[float] | None = None,
            drawn: list[float] | None = None) -> None:
        self.tokens += tokens
        self.sampled += [int(sampled)] * len(tokens)
        self.full_log_probs += full if full is not None else [0.0] * len(tokens)
        if self.drawn_log_probs is not None:
            if sampled and drawn is None:
                self.drawn_log_probs = None  # the engine does not report the drawn distribution
            else:
                self.drawn_log_probs += drawn if drawn is not None else [0.0] * len(tokens)


def turn_seed(seed: int, turn: int) -> int:
    """Each turn's sampling seed, from the step's (a resumed job repeats every turn)."""
    return (seed + 104_729 * turn) % (2**31 - 2**20)


class ToolLoop:
    """The conversations of one rollout step on this rank."""

    def __init__(self, cfg: RLConfig, tokenizer, tools: dict[str, Tool]):
        self.cfg, self.tokenizer, self.tools = cfg, tokenizer, tools
        self.parser = choose_parser(tokenizer, cfg.tool_parser)

    def describe(self) -> str:
        return (f"multi-turn with tools {', '.join(self.tools)} ({self.parser} calls, up to {self.cfg.max_turns} "
                f"turns, {self.cfg.tool_timeout_s:g} s per call)")

    def run(self, sampler, rows: list[dict[str, Any]], prompt_ids: list[list[int]],
            schemas: list[list[dict[str, Any]] | None], n: int, max_new_tokens: int, seed: int
            ) -> tuple[list[Conversation], float]:
        """``n`` conversations per prompt (consecutive) and the seconds spent in the tools."""
        conversations = [Conversation() for _ in range(len(prompt_ids) * n)]
        tool_seconds = 0.0
        for turn in range(self.cfg.max_turns):
            active = [i for i, c in enumerate(conversations) if not c.done]
            if not active:
                break
            if turn == 0:
                samples = sampler.sample(prompt_ids, n, max_new_tokens, turn_seed(seed, 0))
            else:
                inputs = [prompt_ids[i // n] + conversations[i].tokens for i in active]
                room = max(max_new_tokens - len(conversations[i].tokens) for i in active)
                samples = sampler.sample(inputs, 1, room, turn_seed(seed, turn))
            for k, i in enumerate(active):
                tool_seconds += self._turn(conversations[i], samples, k, rows[i // n], schemas[i // n],
                                           max_new_tokens, last=turn == self.cfg.max_turns - 1)
        return conversations, tool_seconds

    def _turn(self, conversation: Conversation, samples, k: int, row: dict[str, Any],
              schemas: list[dict[str, Any]] | None, max_new_tokens: int, last: bool) -> float:
        """Take sample ``k`` as the conversation's next assistant turn; run its calls. Returns the tools' seconds."""
        tokens = samples.tokens[k].tolist()
        room = max_new_tokens - len(conversation.tokens)
        ended = bool(samples.ended[k]) and len(tokens) <= room
        tokens = tokens[:room]
        drawn = samples.log_probs[k][: len(tokens)].float().tolist() if samples.log_probs is not None else None
        full = samples.full_log_probs[k][: len(tokens)].float().tolist()
        conversation.add(tokens, sampled=True, full=full, drawn=drawn)
        conversation.counts["turns"] += 1
        parsed = parse_turn(self.tokenizer.decode(tokens, skip_special_tokens=True), self.parser)
        assistant = _assistant_message(parsed)
        if not ended or not parsed.calls_tools or last:
            conversation.messages.append(assistant)
            conversation.done, conversation.ended = True, ended
            return 0.0
        results, seconds = [], 0.0
        for call in parsed.calls:
            result = run_tool(self.tools, call.name, call.arguments, self.cfg.tool_timeout_s)
            results.append({"role": "tool", "name": call.name, "content": result.content})
            seconds += result.seconds
            conversation.counts["tool_calls"] += 1
            if result.error:
                conversation.counts[result.error] += 1
        for error in parsed.errors:  # a call that did not parse: the model reads why
            results.append({"role": "tool", "name": "", "content": f"error: {error}"})
            conversation.counts["tool_calls"] += 1
            conversation.counts["bad_json"] += 1
        prompt = prompt_messages(row["prompt"])
        try:
            between = self._between(prompt + conversation.messages, assistant, results, schemas,
                                    self.tokenizer.decode(tokens[-1:]))
        except ValueError:
            conversation.counts["refused_by_template"] += 1
            between = None
        conversation.messages += [assistant, *results]
        if between is None or len(conversation.tokens) + len(between) >= max_new_tokens:
            # no way on, or no room left for an answer: the conversation ends here (cut by the length limit)
            conversation.done, conversation.ended = True, between is None
            return seconds
        conversation.add(between, sampled=False)
        return seconds

    def _between(self, history: list[dict[str, Any]], assistant: dict[str, Any], results: list[dict[str, Any]],
                 schemas: list[dict[str, Any]] | None, end_text: str) -> list[int]:
        """The tokens the template puts after the sampled assistant turn: the separator after its end-of-turn
        token, the tool messages and the next generation prompt. A ValueError where the template refuses the
        messages or rewrites the earlier turns once tool results follow (nothing to append to)."""
        try:
            before = self._render(history + [assistant], schemas, generation_prompt=False)
            after = self._render(history + [assistant, *results], schemas, generation_prompt=True)
        except Exception as exc:  # the template's raise_exception, a jinja2 error
            raise ValueError(refusal(exc)) from exc
        if not after.startswith(before):
            raise ValueError("the chat template renders the earlier turns differently once tool results follow")
        end = before.rfind(end_text) if end_text else -1
        separator = before[end + len(end_text):] if end >= 0 else ""
        return list(self.tokenizer(separator + after[len(before):], add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[dict[str, Any]], schemas, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                                  add_generation_prompt=generation_prompt)


def _assistant_message(parsed: ParsedTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parsed.calls]
    return message


def counts_tensor(conversations: list[Conversation]) -> torch.Tensor:
    """[TOOL_COUNTS] summed over the conversations (for the metrics' all-reduce)."""
    return torch.tensor([float(sum(c.counts[k] for c in conversations)) for k in TOOL_COUNTS], dtype=torch.float64)
