"""Multi-turn rollouts with tools (``rl.tools``): every sample is its own conversation -- an assistant turn is
sampled, its tool calls parsed in the model family's format (:mod:`syncwise.rl.tool_calls`) and run
(:mod:`syncwise.rl.tool_runner`: the calls of every conversation's turn side by side), their results appended
through the chat template, and the next turn sampled -- until a turn calls nothing, ``rl.max_turns`` turns,
or ``rl.max_new_tokens`` tokens after the prompt.

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

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import RLConfig
from ..data.chat import refusal
from .prompts import prompt_messages
from .tool_calls import ParsedTurn, choose_parser, parse_turn
from .tool_runner import ANSWER_KINDS, ERROR_KINDS, Tool, ToolLimits, ToolResult, ToolRunner

TOOL_COUNTS = ("turns", "tool_calls", *ANSWER_KINDS, *ERROR_KINDS, "refused_by_template")


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
    counts: Counter = field(default_factory=Counter)  # turns, tool_calls, answer kinds and each error kind

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

    def count(self, result: ToolResult) -> None:
        self.counts["tool_calls"] += 1
        for kind in (result.error, *result.kinds):
            if kind:
                self.counts[kind] += 1


def tool_limits(cfg: RLConfig) -> ToolLimits:
    return ToolLimits(cfg.tool_timeout_s, cfg.tool_step_timeout_s, cfg.tool_max_chars, cfg.tool_workers)


class ToolLoop:
    """The conversations of one rollout step on this rank."""

    def __init__(self, cfg: RLConfig, tokenizer, tools: dict[str, Tool], end_ids: list[int] | None = None):
        self.cfg, self.tokenizer, self.tools = cfg, tokenizer, tools
        self.parser = choose_parser(tokenizer, cfg.tool_parser)
        # the tokens that end a turn, left out of the text the calls are parsed from (special tokens kept: a
        # tokenizer may register the call's tags as special tokens)
        self.end_ids = set(end_ids or []) | {tokenizer.eos_token_id}
        self.runner = ToolRunner(tools, tool_limits(cfg))

    def describe(self) -> str:
        limits = self.runner.limits
        return (f"multi-turn with tools {', '.join(self.tools)} ({self.parser} calls, up to {self.cfg.max_turns} "
                f"turns, {limits.timeout_s:g} s per call, {limits.step_timeout_s:g} s per step, "
                f"{limits.workers} at a time)")

    def run(self, sampler, rows: list[dict[str, Any]], prompt_ids: list[list[int]],
            schemas: list[list[dict[str, Any]] | None], n: int, max_new_tokens: int, seeds: list[int]
            ) -> tuple[list[Conversation], float]:
        """``n`` conversations per prompt (consecutive) and the seconds spent in the tools (running them and
        putting their answers into the conversations); ``seeds``: each turn's first sampling seed."""
        conversations = [Conversation() for _ in range(len(prompt_ids) * n)]
        self.runner.new_step()
        tool_seconds = 0.0
        for turn in range(self.cfg.max_turns):
            active = [i for i, c in enumerate(conversations) if not c.done]
            if not active:
                break
            if turn == 0:
                samples = sampler.sample(prompt_ids, n, max_new_tokens, seeds[0])
            else:
                inputs = [prompt_ids[i // n] + conversations[i].tokens for i in active]
                room = max(max_new_tokens - len(conversations[i].tokens) for i in active)
                samples = sampler.sample(inputs, 1, room, seeds[turn])
            last = turn == self.cfg.max_turns - 1
            calling = [(i, parsed) for k, i in enumerate(active)
                       if (parsed := self._take(conversations[i], samples, k, max_new_tokens, last)) is not None]
            started = time.perf_counter()
            results = iter(self.runner.run([(call.name, call.arguments) for _, parsed in calling
                                            for call in parsed.calls]))
            for i, parsed in calling:
                self._answer(conversations[i], parsed, [next(results) for _ in parsed.calls], rows[i // n],
                             schemas[i // n], max_new_tokens)
            tool_seconds += time.perf_counter() - started
        return conversations, tool_seconds

    def _take(self, conversation: Conversation, samples, k: int, max_new_tokens: int,
              last: bool) -> ParsedTurn | None:
        """Take sample ``k`` as the conversation's next assistant turn; its parsed calls where they are to run,
        else None (the conversation ends here)."""
        tokens = samples.tokens[k].tolist()
        room = max_new_tokens - len(conversation.tokens)
        ended = bool(samples.ended[k]) and len(tokens) <= room
        tokens = tokens[:room]
        drawn = samples.log_probs[k][: len(tokens)].float().tolist() if samples.log_probs is not None else None
        full = samples.full_log_probs[k][: len(tokens)].float().tolist()
        conversation.add(tokens, sampled=True, full=full, drawn=drawn)
        conversation.counts["turns"] += 1
        text_tokens = tokens[:-1] if tokens and tokens[-1] in self.end_ids else tokens
        parsed = parse_turn(self.tokenizer.decode(text_tokens, skip_special_tokens=False), self.parser)
        if not ended or not parsed.calls_tools or last:
            conversation.messages.append(_assistant_message(parsed))
            conversation.done, conversation.ended = True, ended
            return None
        return parsed

    def _answer(self, conversation: Conversation, parsed: ParsedTurn, answers: list[ToolResult],
                row: dict[str, Any], schemas: list[dict[str, Any]] | None, max_new_tokens: int) -> None:
        """The calls' answers (and the errors of calls that did not parse) appended through the template."""
        assistant = _assistant_message(parsed)
        results = []
        for call, answer in zip(parsed.calls, answers, strict=True):
            results.append({"role": "tool", "name": call.name, "content": answer.content})
            conversation.count(answer)
        for error in parsed.errors:  # a call that did not parse: the model reads why
            results.append({"role": "tool", "name": "", "content": f"error: {error}"})
            conversation.count(ToolResult("", "bad_json", 0.0))
        prompt = prompt_messages(row["prompt"])
        end_text = self.tokenizer.decode(conversation.tokens[-1:])
        try:
            between = self._between(prompt + conversation.messages, assistant, results, schemas, end_text)
        except ValueError:
            conversation.counts["refused_by_template"] += 1
            between = None
        conversation.messages += [assistant, *results]
        if between is None or len(conversation.tokens) + len(between) >= max_new_tokens:
            # no way on, or no room left for an answer: the conversation ends here (cut by the length limit)
            conversation.done, conversation.ended = True, between is None
            return
        conversation.add(between, sampled=False)

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
