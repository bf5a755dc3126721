"""Token in, token out: one agent run's conversation with the endpoint (:mod:`syncwise.rl.rollout.endpoint`) as the
exact tokens the engine sampled and the tokens put between them.

A session holds one or more *segments*, each a :class:`~syncwise.rl.rollout.base.Trajectory` -- its first prompt's
tokens, then every token after it, sampled (trained, with the sampler's log-probs and the policy version) or
inserted (the template's text for the messages the agent added: tool answers, user turns; never trained). A chat
request whose messages are the segment's so far -- the conversation it was last sent, plus the assistant message the
endpoint returned -- followed by new ones *extends* it: only the new messages' tokens are appended, rendered as the
turn loop renders tool answers (the template with and without them, the difference), so the sampled turns are never
re-tokenised. A request that does not extend (history rewritten, an earlier turn's thinking dropped by the
template, another conversation) opens a new segment, trained as its own sequence and counted (``rewritten``).
``/v1/completions`` extends where the prompt's token ids begin with the segment's.

Requests of one session may be sent side by side: each planned turn names its own segment (:class:`Turn`), and its
answer goes there. A segment whose turn is still being sampled (``awaiting``) is extended by nothing -- its next
tokens are not known yet -- so a request sent beside it opens a segment of its own (counted ``concurrent``); a
later request extends whichever segment its messages continue, the newest first."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...data.chat import refusal
from ..env.tool_calls import ParsedTurn, choose_parser, parse_turn
from .base import Trajectory


class RequestError(ValueError):
    """A request the endpoint answers with OpenAI's error shape (HTTP 400): its message names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def call_arguments(arguments: Any) -> Any:
    """A tool call's arguments as the chat template takes them: a JSON string parsed (OpenAI sends strings)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as the chat template renders it: the role, the text, the calls with their arguments as
    objects, a tool answer's name and call id."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError("messages: each message must be an object with a role", "messages")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: the text ones, joined
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    out: dict[str, Any] = {"role": message["role"], "content": content or ""}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [{"type": "function", "function": {
            "name": (c.get("function") or {}).get("name"), "arguments": call_arguments(
                (c.get("function") or {}).get("arguments"))}} for c in calls]
    for key in ("name", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two messages alike for extending a conversation: role, text and calls (ids and extra fields aside)."""
    def key(m: dict[str, Any]) -> tuple:
        calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                      for c in m.get("tool_calls", []))
        return m["role"], m["content"], calls
    return key(a) == key(b)


@dataclass
class Segment:
    trajectory: Trajectory
    messages: list[dict[str, Any]] | None  # chat: the conversation so far, as the template renders it
    prompt_messages: int = 0  # how many of them were the segment's first prompt
    tools: list[dict[str, Any]] | None = None
    awaiting: bool = False  # a turn planned on it is being sampled: nothing may extend it until it is taken


@dataclass
class Turn:
    """What a sampling request asks the engine for: the tokens to continue, at most how many more, the segment
    its answer belongs to, and which of its session's requests it is (its sampling seed's: not the order the
    batches came in)."""

    prompt: list[int]
    room: int
    segment: Segment
    number: int = 0


@dataclass
class Session:
    """One agent run: its segments, and what happened (``counts``)."""

    tokenizer: Any
    end_ids: list[int]
    max_new_tokens: int  # a segment's tokens after its first prompt, sampled and inserted
    max_positions: int  # the model's context
    parser: str = "auto"  # rl.tool_parser, resolved per request where tools are given
    segments: list[Segment] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    closed: bool = False
    sample: int = 0  # which of the rank's step's samples this run is (its turns' seeds)
    planned: int = 0  # the turns planned so far

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def plan_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Turn:
        """The tokens the next assistant turn follows: the current segment extended by the new messages' tokens,
        or a new segment's prompt."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: a non-empty list of messages is required", "messages")
        rendered = [template_message(m) for m in messages]
        for segment in self._open_segments(chat=True):
            if not self._extends(segment, rendered, tools):
                continue
            between = self._between(segment, rendered, tools)
            if between is not None:
                segment.trajectory.add(between, sampled=False)
                self.counts["inserted_tokens"] += len(between)
                segment.trajectory.messages += rendered[len(segment.messages):]
                segment.messages = rendered
                return self._turn(segment)
        prompt = self._render_ids(rendered, tools)
        return self._open(Segment(Trajectory(prompt=prompt), rendered, len(rendered), tools))

    def plan_text(self, prompt: list[int]) -> Turn:
        """``/v1/completions``: the current segment extended where ``prompt`` begins with its tokens, else a new
        segment."""
        for segment in self._open_segments(chat=False):
            so_far = segment.trajectory.prompt + segment.trajectory.tokens
            if len(prompt) >= len(so_far) and prompt[:len(so_far)] == so_far:
                inserted = prompt[len(so_far):]
                segment.trajectory.add(inserted, sampled=False)
                self.counts["inserted_tokens"] += len(inserted)
                return self._turn(segment)
        return self._open(Segment(Trajectory(prompt=list(prompt)), None))

    def take(self, turn: Turn, tokens: list[int], full: list[float], drawn: list[float] | None, ended: bool,
             version: int) -> None:
        """The turn the engine sampled for ``turn`` (cut to what the request allowed), appended as trained tokens
        to the segment it was planned on (not whichever segment is newest by now)."""
        trajectory = turn.segment.trajectory
        trajectory.add(tokens, sampled=True, full=full, drawn=drawn, version=version)
        trajectory.counts["turns"] += 1
        trajectory.ended = ended
        turn.segment.awaiting = False
        self.counts["sampled_tokens"] += len(tokens)

    def release(self, turn: Turn) -> None:
        """A planned turn answered without sampling (no room left): its segment may be extended again."""
        turn.segment.awaiting = False

    def answer(self, turn: Turn, text: str, tools: list[dict[str, Any]] | None) -> ParsedTurn:
        """The sampled turn's text as an assistant message (its tool calls parsed in the model family's format
        where the request gave tools), remembered as the next message of ``turn``'s conversation."""
        segment = turn.segment
        parsed = ParsedTurn(text)
        if tools:
            try:
                parsed = parse_turn(text, choose_parser(self.tokenizer, self.parser))
            except ValueError as exc:
                raise RequestError(f"tools: {exc}", "tools") from exc
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in parsed.calls]
            segment.trajectory.counts["tool_calls"] += len(parsed.calls)
        if segment.messages is not None:
            segment.messages = [*segment.messages, message]
            segment.trajectory.messages.append(message)
        else:
            segment.trajectory.text += text
        return parsed

    def _open_segments(self, chat: bool) -> list[Segment]:
        """The segments a request may extend, newest first: of its kind, none being sampled (two conversations of
        one session sent side by side each go on in their own segment)."""
        return [s for s in reversed(self.segments) if not s.awaiting and (s.messages is not None) == chat]

    def _open(self, segment: Segment) -> Turn:
        """A new segment for a request that extends none: counted as a rewrite of the history, or as sent beside
        a request still being answered."""
        if self.segments:
            self.counts["concurrent" if any(s.awaiting for s in self.segments) else "rewritten"] += 1
        self.segments.append(segment)
        return self._turn(segment)

    def _turn(self, segment: Segment) -> Turn:
        trajectory = segment.trajectory
        so_far = trajectory.prompt + trajectory.tokens
        room = min(self.max_new_tokens - len(trajectory.tokens), self.max_positions - len(so_far))
        segment.awaiting = True
        self.planned += 1
        return Turn(so_far, max(room, 0), segment, self.planned - 1)

    def _extends(self, segment: Segment, rendered: list[dict[str, Any]], tools) -> bool:
        known = segment.messages
        return (tools == segment.tools and len(rendered) > len(known)
                and all(_same(a, b) for a, b in zip(known, rendered, strict=False)))

    def _between(self, segment: Segment, rendered: list[dict[str, Any]], tools) -> list[int] | None:
        """The tokens the template puts after the last sampled turn for the new messages (the end-of-turn text
        where the turn was cut, the separator after it, the messages, the next generation prompt); None where the
        template renders the earlier turns differently once they follow (its own rewrite: a new segment)."""
        try:
            before = self._render(segment.messages, tools, generation_prompt=False)
            after = self._render(rendered, tools, generation_prompt=True)
        except RequestError:
            return None
        if not after.startswith(before):
            return None
        tokens = segment.trajectory.tokens
        last = self.tokenizer.decode(tokens[-1:]) if tokens and tokens[-1] in self.end_ids else ""
        ends = [self.tokenizer.decode([i]) for i in self.end_ids]
        end_text = last or max(ends, key=before.rfind, default="")
        at = before.rfind(end_text) if end_text else -1
        text = ("" if last or at < 0 else end_text) + (before[at + len(end_text):] if at >= 0 else "")
        return list(self.tokenizer(text + after[len(before):], add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[dict[str, Any]], tools, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as exc:  # the template's raise_exception, a jinja2 error
            raise RequestError(f"messages: refused by the chat template: {refusal(exc)}", "messages") from exc

    def _render_ids(self, messages: list[dict[str, Any]], tools) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("messages: the model's tokenizer has no chat template; use /v1/completions",
                               "messages")
        try:
            out = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                     add_generation_prompt=True)
        except Exception as exc:
            raise RequestError(f"messages: refused by the chat template: {refusal(exc)}", "messages") from exc
        return list(out["input_ids"])
