"""The sampling side of the endpoint: a batch of queued requests, from any number of sessions, planned (token in:
:mod:`syncwise.rl.rollout.sessions`), sampled together in one call of the rank's rollout engine for each distinct
room the requests have (the compact sampler, ``generate``, vLLM; a prompt's alike first turns prefilled once, as the
turn loop's; no request sampled past its own room), each cut to what it asked for
(``max_tokens``, ``stop``), recorded (token out) and answered in OpenAI's shape -- with vLLM's ``prompt_token_ids``
/ ``token_ids`` beside where the request asked for them (``return_token_ids``; null otherwise, as vLLM answers)."""

from __future__ import annotations

import queue
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from .base import RolloutEngine
from .endpoint import Endpoint, Pending, error_body
from .sessions import RequestError, Session, Turn

BATCH_WAIT_S = 0.02  # after a request, how long at least to wait for another before sampling those queued
# ... and at most this share of the last engine call: a batch cut early costs a whole engine call more (its decode
# steps' fixed cost) for the requests that come just after, while the agents' own Python -- 64 runs reading their
# answers on one event loop -- can leave gaps longer than BATCH_WAIT_S between requests that are on their way
BATCH_WAIT_SHARE, BATCH_WAIT_MAX_S = 0.1, 1.0


class TurnServer:
    """Answers an endpoint's requests with ``engine``; ``session_of``: a request's session (None: closed)."""

    def __init__(self, endpoint: Endpoint, engine: RolloutEngine, tokenizer, sampling: dict[str, Any]):
        self.endpoint, self.engine, self.tokenizer = endpoint, engine, tokenizer
        self.sampling = sampling  # the job's temperature and top_p: what a request's own are compared with
        self.counts: Counter = Counter()
        self.calls = 0
        self.gap_s = BATCH_WAIT_S  # how long collect waits between requests: BATCH_WAIT_SHARE of the last call

    def collect(self, waiting: Callable[[], int], first_wait_s: float = 0.05) -> list[Pending]:
        """The requests queued now: after the first, more until every agent that is running is waiting on the
        model (``waiting()``: how many could still send one) or none came for :attr:`gap_s`."""
        try:
            batch = [self.endpoint.requests.get(timeout=first_wait_s)]
        except queue.Empty:
            return []
        while len(batch) < waiting():
            try:
                batch.append(self.endpoint.requests.get(timeout=self.gap_s))
            except queue.Empty:
                break
        return batch

    def answer(self, batch: list[Pending], session_of: Callable[[str], Session | None], version: int,
               seed_of: Callable[[int, Session, Turn], int]) -> None:
        """Plan every request of ``batch``, sample the planned ones -- one engine call for each distinct number of
        new tokens they may have, so that no request is sampled past its own room (the model's positions) --
        and answer each. ``seed_of(k, session, turn)``: the sampling seed of the batch's k-th request; each
        request draws by its own (the engine's per-sequence seeds), whatever else was batched beside it."""
        planned: dict[int, list[tuple[Pending, Session, Turn, int]]] = {}
        for k, pending in enumerate(batch):
            self.counts["requests"] += 1
            session = session_of(pending.session)
            if session is None or session.closed:
                pending.answer(404, error_body(f"session {pending.session} is closed", code="session_closed"))
                continue
            try:
                turn = self._plan(pending, session)
            except RequestError as exc:
                self.counts["malformed"] += 1
                pending.answer(400, error_body(str(exc), param=exc.param))
                continue
            if turn.room <= 0:  # no room left in the context or the sample's budget
                session.release(turn)
                self.counts["length"] += 1
                pending.answer(200, self._response(pending, session, turn, [], [], None, "length", ""))
                continue
            planned.setdefault(min(turn.room, _asked(pending.body) or turn.room), []).append(
                (pending, session, turn, seed_of(k, session, turn)))
        for room, group in planned.items():
            self.calls += 1
            prompts, n, place = shared_prompts([turn.prompt for _, _, turn, _ in group])
            seeds = [0] * len(group)
            for k, (_, _, _, seed) in enumerate(group):
                seeds[place[k]] = seed
            began = time.perf_counter()
            samples = self.engine.sample(prompts, n, room, seeds)
            self.gap_s = batch_gap(time.perf_counter() - began)
            for k, (pending, session, turn, _) in enumerate(group):
                self._record(pending, session, turn, samples, place[k], version)

    def _plan(self, pending: Pending, session: Session) -> Turn:
        """The request's turn in its session; a RequestError (HTTP 400) for whatever in it cannot be sampled."""
        body = pending.body
        for key in ("temperature", "top_p"):
            if body.get(key) is not None and float(body[key]) != float(self.sampling[key]):
                self.counts["sampling_overridden"] += 1  # the job samples what it trains on
        if pending.kind == "chat":
            return session.plan_chat(body["messages"], body.get("tools") or None)
        prompt = body["prompt"]  # its shape checked by the handler (endpoint.check_body)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt = list(self.tokenizer(prompt)["input_ids"])
        vocabulary = len(self.tokenizer)
        outside = next((t for t in prompt if not 0 <= t < vocabulary), None)
        if outside is not None:
            raise RequestError(f"prompt: token id {outside} is outside the vocabulary (0 to {vocabulary - 1})",
                               "prompt")
        return session.plan_text(prompt)

    def _record(self, pending: Pending, session: Session, turn: Turn, samples, k: int, version: int) -> None:
        """Sample ``k`` cut to what the request allows, appended to its session, and the request answered."""
        body = pending.body
        limit = min(turn.room, _asked(body) or turn.room)
        tokens = samples.tokens[k].tolist()[:limit]
        ended = bool(samples.ended[k]) and len(samples.tokens[k]) <= limit
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        cut = _stop_at(self.tokenizer, tokens, stops) if stops else None
        if cut is not None:
            tokens, ended = tokens[:cut], True
        full = samples.full_log_probs[k][: len(tokens)].float().tolist()
        drawn = samples.log_probs[k][: len(tokens)].float().tolist() if samples.log_probs is not None else None
        session.take(turn, tokens, full, drawn, ended, version)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if cut is not None:
            text = _before_stop(text, stops)
        calls = body.get("tools") if pending.kind == "chat" and body.get("tool_choice") != "none" else None
        try:
            ends_turn = bool(tokens) and tokens[-1] in session.end_ids  # the end token is no part of the text
            shown = self.tokenizer.decode(tokens[:-1] if ends_turn else tokens, skip_special_tokens=False)
            parsed = session.answer(turn, shown if calls else text, calls)
        except RequestError as exc:
            self.counts["malformed"] += 1
            pending.answer(400, error_body(str(exc), param=exc.param))
            return
        reason = "tool_calls" if parsed.calls else ("stop" if ended else "length")
        self.counts["length"] += reason == "length"
        logprobs = drawn if drawn is not None else full
        pending.answer(200, self._response(pending, session, turn, tokens, logprobs, parsed, reason,
                                           parsed.content if pending.kind == "chat" else text))

    def _response(self, pending: Pending, session: Session, turn: Turn, tokens: list[int], logprobs: list[float],
                  parsed, reason: str, text: str) -> dict[str, Any]:
        """OpenAI's response body; vLLM's ``prompt_token_ids`` and ``token_ids`` (vLLM >= 0.10.2's fields, where
        it puts them) filled where the request has ``return_token_ids``, null otherwise, as vLLM answers."""
        usage = {"prompt_tokens": len(turn.prompt), "completion_tokens": len(tokens),
                 "total_tokens": len(turn.prompt) + len(tokens)}
        common = {"created": int(time.time()), "model": self.endpoint.model, "usage": usage}
        wants_logprobs = bool(pending.body.get("logprobs"))
        wants_ids = bool(pending.body.get("return_token_ids"))
        token_ids, prompt_token_ids = (tokens, turn.prompt) if wants_ids else (None, None)
        if pending.kind == "text":
            choice = {"index": 0, "text": text, "finish_reason": reason, "token_ids": token_ids,
                      "prompt_token_ids": prompt_token_ids,
                      "logprobs": {"tokens": [self.tokenizer.decode([t]) for t in tokens],
                                   "token_logprobs": logprobs, "top_logprobs": None,
                                   "text_offset": None} if wants_logprobs else None}
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", **common, "choices": [choice]}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parsed is not None and parsed.calls:
            message["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments if isinstance(c.arguments, str)
                              else _json(c.arguments)}} for c in parsed.calls]
        content = [{"token": (piece := self.tokenizer.decode([t])), "logprob": lp, "bytes": list(piece.encode()),
                    "top_logprobs": []} for t, lp in zip(tokens, logprobs, strict=True)] if wants_logprobs else None
        choice = {"index": 0, "message": message, "finish_reason": reason, "token_ids": token_ids,
                  "logprobs": {"content": content} if wants_logprobs else None}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", **common, "choices": [choice],
                "prompt_token_ids": prompt_token_ids}


def batch_gap(call_s: float) -> float:
    """How long to wait between requests for the next batch after an engine call of ``call_s`` seconds."""
    return min(max(BATCH_WAIT_S, BATCH_WAIT_SHARE * call_s), BATCH_WAIT_MAX_S)


def shared_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
    """(prompts, n, place): where the requests are n alike copies of each of their distinct prompts -- the first
    turns of a prompt's ``rl.samples_per_prompt`` runs -- each distinct prompt once with n samples (the engine
    prefills it once, as the turn loop's first turn), else every prompt with 1; ``place[k]``: request k's sample."""
    copies: dict[tuple[int, ...], list[int]] = {}
    for k, prompt in enumerate(prompts):
        copies.setdefault(tuple(prompt), []).append(k)
    sizes = {len(ks) for ks in copies.values()}
    if len(copies) == len(prompts) or len(sizes) != 1:
        return prompts, 1, list(range(len(prompts)))
    n, place = sizes.pop(), [0] * len(prompts)
    for i, ks in enumerate(copies.values()):
        for j, k in enumerate(ks):
            place[k] = i * n + j
    return [list(prompt) for prompt in copies], n, place


def _asked(body: dict[str, Any]) -> int | None:
    return body.get("max_completion_tokens") or body.get("max_tokens")


def _stop_at(tokenizer, tokens: list[int], stops: list[str]) -> int | None:
    """The length up to the token that completes the first of ``stops`` in the decoded text, or None."""
    for end in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:end], skip_special_tokens=True)
        if any(s and s in text for s in stops):
            return end
    return None


def _before_stop(text: str, stops: list[str]) -> str:
    """The text up to the first stop string (OpenAI leaves it out of the answer)."""
    at = min((text.find(s) for s in stops if s and s in text), default=len(text))
    return text[:at]


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)
