"""The turn loop: every sample of a rollout step, one turn at a time, over any rollout engine
(:class:`~syncwise.rl.rollout.base.RolloutEngine`'s ``sample``). Without tools a sample is one turn; with
``rl.tools`` (or an environment) every sample is its own conversation -- an assistant turn is sampled, its
tool calls parsed in the model family's format (:mod:`syncwise.rl.env.tool_calls`) and run by its episode's
environment (:mod:`syncwise.rl.env`: the calls of every conversation's turn side by side), their results
appended through the chat template, and the next turn sampled -- until a turn calls nothing, ``rl.max_turns``
turns, or ``rl.max_new_tokens`` tokens after the prompt. Each sample ends as one
:class:`~syncwise.rl.rollout.base.Trajectory`, whatever its turns.

The engine is asked one turn at a time: the first turn ``samples_per_prompt`` per prompt (per conversation
where an episode opened with an observation of its own), later ones one per conversation still going, so
every engine runs it; vLLM's prefix cache keeps the conversation so far between turns.

The sequence that trains is exactly the one sampled: the prompt's tokens, each turn's sampled tokens as
drawn (never re-tokenised), and between turns the template's text for the tool results tokenised once --
what the template adds after the assistant turn (its separator after the end-of-turn token, the tool
messages, the next generation prompt), found by rendering the conversation with and without them. The loss
mask is on the sampled tokens only (tool calls included; tool results and template text not), and the
sampler's log-probs are kept for exactly those, so ``rollout/log_prob_diff``, ``rl.loss.rollout_is`` and the
PPO ratio see the same positions as the loss.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ...config import RLConfig
from ...data.chat import refusal
from ...runtime.sandbox import describe as sandbox_words
from ..env.base import Environment
from ..env.prompts import encode_prompt, prompt_messages
from ..env.tool_calls import ParsedTurn, choose_parser, parse_turn
from ..env.tools import ANSWER_KINDS, ERROR_KINDS, ToolLimits, ToolResult, ToolRunner
from .base import RolloutEngine, Trajectory

TOOL_COUNTS = ("turns", "tool_calls", *ANSWER_KINDS, *ERROR_KINDS, "refused_by_template")


def tool_limits(cfg: RLConfig) -> ToolLimits:
    return ToolLimits(cfg.tool_timeout_s, cfg.tool_step_timeout_s, cfg.tool_max_chars, cfg.tool_workers)


class EndedTurn(NamedTuple):
    """A conversation whose assistant turn ended calling tools: what answering it needs."""

    trajectory: Trajectory
    episode: Environment
    parsed: ParsedTurn
    row: dict[str, Any]
    schemas: list[dict[str, Any]] | None


class TurnLoop:
    """The samples of one rollout step on this rank. ``episode``: each conversation's environment from its
    row (None: single-turn, no tools)."""

    def __init__(self, cfg: RLConfig, tokenizer, end_ids: list[int] | None = None,
                 episode: Callable[[dict[str, Any]], Environment] | None = None, tool_names: list[str] = (),
                 environment: str | None = None):
        self.cfg, self.tokenizer, self.episode, self.tool_names = cfg, tokenizer, episode, list(tool_names)
        self.environment = environment  # the environment class's name, for the first line
        # the tokens that end a turn, left out of the text the calls are parsed from (special tokens kept: a
        # tokenizer may register the call's tags as special tokens)
        self.end_ids = set(end_ids or []) | {tokenizer.eos_token_id}
        self.parser = choose_parser(tokenizer, cfg.tool_parser) if episode is not None else None
        self.runner = ToolRunner(tool_limits(cfg)) if episode is not None else None
        self.max_turns = cfg.max_turns if episode is not None else 1
        self.version = 0  # the policy's that samples now (RL steps taken)

    @property
    def multi_turn(self) -> bool:
        return self.episode is not None

    def describe(self) -> str:
        if self.runner is None:
            return ""
        limits = self.runner.limits
        where = f"environment {self.environment}: " if self.environment else ""
        sandbox = f"; python runs in {sandbox_words()}" if "python" in self.tool_names else ""
        return (f"multi-turn with {where}tools {', '.join(self.tool_names)} ({self.parser} calls, up to "
                f"{self.cfg.max_turns} turns, {limits.timeout_s:g} s per call, {limits.step_timeout_s:g} s per step, "
                f"{limits.workers} at a time{sandbox})")

    def run(self, engine: RolloutEngine, rows: list[dict[str, Any]], prompt_ids: list[list[int]],
            schemas: list[list[dict[str, Any]] | None], n: int, max_new_tokens: int, seeds: list[int],
            version: int = 0) -> tuple[list[Trajectory], float, list[Environment]]:
        """``n`` samples per prompt (consecutive), the seconds spent in the tools (running them and putting
        their answers into the conversations) and each sample's episode, still open (the trainer closes them
        once it has scored them; here only when something fails); ``seeds``: each turn's first sampling seed;
        ``version``: the policy's, recorded with every token."""
        self.version = version
        trajectories = [Trajectory(prompt=prompt_ids[i // n]) for i in range(len(prompt_ids) * n)]
        if not self.multi_turn:
            samples = engine.sample(prompt_ids, n, max_new_tokens, seeds[0])
            for k, trajectory in enumerate(trajectories):
                self.end_turn(trajectory, *trajectory.take(samples, k, max_new_tokens, self.version), last=True)
            return trajectories, 0.0, []
        episodes: list[Environment] = []
        self.runner.new_step()
        started = time.perf_counter()
        try:
            for i, trajectory in enumerate(trajectories):
                episodes.append(self.open(rows[i // n], schemas[i // n], trajectory))
            tool_seconds = time.perf_counter() - started
            return (*self._conversations(engine, episodes, trajectories, rows, prompt_ids, schemas, n,
                                         max_new_tokens, seeds, tool_seconds), episodes)
        except BaseException:
            for episode in episodes:
                with contextlib.suppress(Exception):
                    episode.close()
            raise

    def open(self, row: dict[str, Any], schemas: list[dict[str, Any]] | None, trajectory: Trajectory) -> Environment:
        """A conversation's episode, started from its row; what it says first is appended to the prompt's last
        user message (the trajectory's prompt re-encoded with it). Closed again where starting it fails."""
        episode = self.episode(row)
        try:
            opening = episode.start(row)
        except BaseException:
            with contextlib.suppress(Exception):
                episode.close()
            raise
        if opening is not None:
            trajectory.opening = opening
            trajectory.prompt = encode_prompt(opened(row["prompt"], opening), self.cfg, self.tokenizer, schemas)
        return episode

    def _conversations(self, engine: RolloutEngine, episodes: list[Environment], trajectories: list[Trajectory],
                       rows, prompt_ids, schemas, n: int, max_new_tokens: int, seeds: list[int],
                       tool_seconds: float) -> tuple[list[Trajectory], float]:
        for turn in range(self.max_turns):
            active = [i for i, t in enumerate(trajectories) if not t.done]
            if not active:
                break
            if turn == 0 and all(t.opening is None for t in trajectories):
                samples = engine.sample(prompt_ids, n, max_new_tokens, seeds[0])  # each prompt prefilled once
            else:
                inputs = [trajectories[i].prompt + trajectories[i].tokens for i in active]
                room = max(max_new_tokens - len(trajectories[i].tokens) for i in active)
                samples = engine.sample(inputs, 1, room, seeds[turn])
            last = turn == self.max_turns - 1
            calling = []
            for k, i in enumerate(active):
                tokens, ended = trajectories[i].take(samples, k, max_new_tokens, self.version)
                parsed = self.end_turn(trajectories[i], tokens, ended, last)
                if parsed is not None:
                    calling.append(EndedTurn(trajectories[i], episodes[i], parsed, rows[i // n], schemas[i // n]))
            tool_seconds += self.answer(calling, max_new_tokens)
        for trajectory, episode in zip(trajectories, episodes, strict=True):
            trajectory.env_reward = episode.reward()
        return trajectories, tool_seconds

    def answer(self, calling: list[EndedTurn], max_new_tokens: int) -> float:
        """The calls of every turn that ended calling tools, run side by side (each episode's own in order), and
        each conversation's answers appended through the template: its next turn starts after them. The
        seconds it took."""
        started = time.perf_counter()
        answers = iter(self.runner.run([(turn.episode.tools(), call.name, call.arguments)
                                        for turn in calling for call in turn.parsed.calls]))
        for turn in calling:
            self._answer(turn.trajectory, turn.parsed, [next(answers) for _ in turn.parsed.calls], turn.row,
                         turn.schemas, max_new_tokens)
            turn.trajectory.turn_start = len(turn.trajectory.tokens)
        return time.perf_counter() - started

    def end_turn(self, trajectory: Trajectory, tokens: list[int], ended: bool, last: bool) -> ParsedTurn | None:
        """The trajectory's assistant turn ended (its ``tokens``; ``ended``: by an end token or a stop string, else
        by the length limit): its parsed calls where they are to run, else None (the trajectory ends here)."""
        trajectory.counts["turns"] += 1
        if not self.multi_turn:
            trajectory.text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            trajectory.done, trajectory.ended = True, ended
            return None
        text_tokens = tokens[:-1] if tokens and tokens[-1] in self.end_ids else tokens
        parsed = parse_turn(self.tokenizer.decode(text_tokens, skip_special_tokens=False), self.parser)
        if not ended or not parsed.calls_tools or last:
            trajectory.messages.append(_assistant_message(parsed))
            trajectory.done, trajectory.ended = True, ended
            return None
        return parsed

    def _answer(self, trajectory: Trajectory, parsed: ParsedTurn, answers: list[ToolResult],
                row: dict[str, Any], schemas: list[dict[str, Any]] | None, max_new_tokens: int) -> None:
        """The calls' answers (and the errors of calls that did not parse) appended through the template."""
        assistant = _assistant_message(parsed)
        results = []
        for call, answer in zip(parsed.calls, answers, strict=True):
            results.append({"role": "tool", "name": call.name, "content": answer.content})
            _count(trajectory, answer)
        for error in parsed.errors:  # a call that did not parse: the model reads why
            results.append({"role": "tool", "name": "", "content": f"error: {error}"})
            _count(trajectory, ToolResult("", "bad_json", 0.0))
        prompt = opened(row["prompt"], trajectory.opening)
        end_text = self.tokenizer.decode(trajectory.tokens[-1:])
        try:
            between = self._between(prompt + trajectory.messages, assistant, results, schemas, end_text)
        except ValueError:
            trajectory.counts["refused_by_template"] += 1
            between = None
        trajectory.messages += [assistant, *results]
        if between is None or len(trajectory.tokens) + len(between) >= max_new_tokens:
            # no way on, or no room left for an answer: the conversation ends here (cut by the length limit)
            trajectory.done, trajectory.ended = True, between is None
            return
        trajectory.add(between, sampled=False, version=self.version)

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



def opened(prompt: Any, opening: str | None) -> list[dict[str, Any]]:
    """The prompt's messages, ``opening`` (what an episode's ``start`` said) appended to its last user message,
    as TRL does with what ``reset`` returns -- apart from it by a blank line where neither has whitespace at the
    seam (TRL joins them as they are: "What is 3 + 4?You have 3 tries.")."""
    messages = prompt_messages(prompt)
    if opening is None:
        return messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        return [*messages, {"role": "user", "content": opening}]
    last = users[-1]
    content = messages[last]["content"]
    seam = "" if not content or not opening or content[-1].isspace() or opening[0].isspace() else "\n\n"
    return [*messages[:last], {**messages[last], "content": content + seam + opening}, *messages[last + 1:]]


def _count(trajectory: Trajectory, result: ToolResult) -> None:
    trajectory.counts["tool_calls"] += 1
    for kind in (result.error, *result.kinds):
        if kind:
            trajectory.counts[kind] += 1


def _assistant_message(parsed: ParsedTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parsed.calls]
    return message


def counts_tensor(trajectories: list[Trajectory]) -> torch.Tensor:
    """[TOOL_COUNTS] summed over the samples (for the metrics' all-reduce)."""
    return torch.tensor([float(sum(t.counts[k] for t in trajectories)) for k in TOOL_COUNTS], dtype=torch.float64)
