"""A rollout step with ``rl.agent``: every sample is one run of the user's agent against this process's endpoint
(:mod:`syncwise.rl.rollout.endpoint`), ``rl.agent_workers`` runs at a time; their requests, from every session,
are sampled together by the rank's engine (:class:`~syncwise.rl.rollout.serving.TurnServer`) on this thread while
the agents run on the endpoint's. Each sample ends as its session's segments -- one trajectory each, exactly the
tokens sampled and inserted -- with the agent's reward (or None: rl.reward_fn scores it) and how its run went.

Faults are the agent's, never the job's: an agent that raises, runs past ``rl.agent_timeout_s`` (cancelled; a
sync one's thread is left to finish, its session closed) or sends what the endpoint refuses is counted; a sample
whose agent failed keeps its tokens out of the loss and scores 0 in its group; one that never called the model is
its prompt alone (nothing to train), scored as its agent says."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ...config import RLConfig
from ..env.agents import AgentFunction
from .base import RolloutEngine, Trajectory, sample_seed
from .endpoint import Endpoint
from .serving import BATCH_WAIT_S, TurnServer
from .sessions import Session, Turn

AGENT_COUNTS = ("requests", "segments", "rewritten", "concurrent", "sampled_tokens", "inserted_tokens", "malformed",
                "unauthorized", "length", "sampling_overridden", "exceptions", "timeouts", "no_requests", "too_long",
                "engine_calls", "wall_s")


class AgentsFailed(RuntimeError):
    """Every agent run of a step failed the same way: the job's error, with the first run's words."""


@dataclass
class AgentRun:
    """A rollout step's agent runs on this rank: the segments as trajectories (each sample's consecutive), which
    sample each is (``sample_of``), each sample's reward from its agent (None: rl.reward_fn's), whether its agent
    failed, and the counts of :data:`AGENT_COUNTS` summed over the samples."""

    trajectories: list[Trajectory]
    sample_of: list[int]
    rewards: list[float | None]
    failed: list[bool]
    counts: torch.Tensor


FAILURES_SHOWN = 5  # kinds of failed runs a job prints a line for; the rest are counted only


class AgentLoop:
    """Runs ``rl.agent`` for every sample of a step on this process, through an endpoint started on first use."""

    def __init__(self, cfg: RLConfig, tokenizer, end_ids: list[int], model_name: str, max_positions: int):
        self.cfg, self.tokenizer, self.end_ids = cfg, tokenizer, end_ids
        self.agent = AgentFunction.load(cfg.agent)
        self.model_name, self.max_positions = model_name, max_positions
        self.endpoint: Endpoint | None = None
        self._http = None  # the connection pool the agents' clients share (made on the endpoint's loop)
        self._gap_s = BATCH_WAIT_S  # the batching gap the last step's engine calls set (TurnServer.gap_s)
        self._said: set[str] = set()  # the failures already shown (each kind once)

    def describe(self) -> str:
        return (f"rl.agent {self.cfg.agent} through an OpenAI-compatible endpoint on loopback "
                f"({self.cfg.agent_workers} agents at a time, {self.cfg.agent_timeout_s:g} s each)")

    def close(self) -> None:
        if self.endpoint is not None:
            if self._http is not None and self.endpoint.loop is not None:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._http.aclose(), self.endpoint.loop).result(10)
                self._http = None
            self.endpoint.close()
            self.endpoint = None

    def run(self, engine: RolloutEngine, rows: list[dict[str, Any]], prompt_ids: list[list[int]], n: int,
            max_new_tokens: int, seed: tuple[int, int, int, int], version: int) -> AgentRun:
        """``n`` agent runs per row (consecutive); ``seed``: (job seed, step, rank, world size) the sampling
        seeds are reserved from."""
        if self.endpoint is None:
            self.endpoint = Endpoint(self.model_name)
            self.endpoint.start()
            # a sync agent runs in a thread of the loop's executor: as many as run at once
            self.endpoint.loop.call_soon_threadsafe(self.endpoint.loop.set_default_executor,
                                                    ThreadPoolExecutor(self.cfg.agent_workers, "syncwise-agent"))
        endpoint = self.endpoint
        server = TurnServer(endpoint, engine, self.tokenizer,
                            {"temperature": self.cfg.temperature, "top_p": self.cfg.top_p})
        server.gap_s = self._gap_s
        samples = len(rows) * n
        sessions = {endpoint.open_session(): Session(self.tokenizer, self.end_ids, max_new_tokens,
                                                     self.max_positions, self.cfg.tool_parser, sample=k)
                    for k in range(samples)}
        ids = list(sessions)
        state = _RunState(samples)
        refused_before = Counter(endpoint.refused)
        runs = asyncio.run_coroutine_threadsafe(self._all(rows, n, ids, state), endpoint.loop)
        # a turn's seed: the job's, the step, the rank, the session's sample and its turn -- not the order the
        # requests came in, so a resumed job draws alike (its agents' requests batch differently)
        def seed_of(_k: int, session: Session, turn: Turn) -> int:
            return sample_seed(seed[0], seed[1], seed[2], seed[3], turn.number, 1 << 16, samples) + session.sample

        while not runs.done() or not endpoint.requests.empty():
            batch = server.collect(state.running)
            if batch:
                server.answer(batch, sessions.get, version, seed_of)
        runs.result()
        self._gap_s = server.gap_s
        self._stop_if_all_failed(state, samples, seed[2])
        self._say_failures(state, samples, seed[2])
        for sid in ids:
            sessions[sid].closed = True
            endpoint.close_session(sid)
        server.counts.update(Counter(endpoint.refused) - refused_before)  # answered by the handlers themselves
        server.counts["engine_calls"] = server.calls
        return self._collect([sessions[sid] for sid in ids], prompt_ids, n, state, server.counts)

    @staticmethod
    def _stop_if_all_failed(state: _RunState, samples: int, rank: int) -> None:
        """Every run of the step failed, and for one reason (the same exception, or all timed out): the agent cannot
        run here at all, so the job stops with that reason -- training on no sample would end it later with a
        batch that has no target token, and the reason lost."""
        if state.first_failure is None or not all(state.failed) or len(state.kinds) != 1:
            return
        raise AgentsFailed(f"rl.agent: all {samples} run(s) for rank {rank} failed this step, every one the same "
                           f"way; the first: {state.first_failure[1]}")

    def _say_failures(self, state: _RunState, samples: int, rank: int) -> None:
        """A line where the step's runs failed in a way not shown before (the first failure's words; each kind of
        failure once a job, at most :data:`FAILURES_SHOWN`): the counts alone would leave the user guessing."""
        if state.first_failure is None or len(self._said) >= FAILURES_SHOWN:
            return
        kind, words = state.first_failure
        if kind in self._said:
            return
        self._said.add(kind)
        failed = sum(state.failed)
        print(f"syncwise train: rl.agent: {failed} of {samples} run(s) for rank {rank} failed this step (their samples "
              f"train nothing; counted in agent/exceptions and agent/timeouts); the first: {words}",
              flush=True)

    async def _all(self, rows: list[dict[str, Any]], n: int, ids: list[str], state: _RunState) -> None:
        gate = asyncio.Semaphore(self.cfg.agent_workers)
        if self._http is None:  # one pool for the job: its connections stay open from step to step
            self._http = self.agent.http_client(self.cfg.agent_workers)
        await asyncio.gather(*(self._one(k, rows[k // n], sid, gate, state, self._http)
                               for k, sid in enumerate(ids)))

    async def _one(self, k: int, row: dict[str, Any], sid: str, gate: asyncio.Semaphore, state: _RunState,
                   http: Any) -> None:
        """Sample ``k``'s agent run: its outcome and seconds into ``state``; its session closed after."""
        async with gate:
            state.started(k)
            try:
                state.rewards[k] = await asyncio.wait_for(
                    self.agent.run(row, self.endpoint.base_url(sid), self.endpoint.key, self.model_name, http),
                    self.cfg.agent_timeout_s)
            except asyncio.TimeoutError:
                state.fail(k, "timeouts", "timeout", f"ran past rl.agent_timeout_s={self.cfg.agent_timeout_s:g}")
            except Exception as exc:  # the agent's own code: any exception is its sample's, not the job's
                state.fail(k, "exceptions", type(exc).__name__, f"{type(exc).__name__}: {exc}")
            finally:
                self.endpoint.close_session(sid)
                state.ended(k)

    def _collect(self, sessions: list[Session], prompt_ids: list[list[int]], n: int, state: _RunState,
                 served: Counter) -> AgentRun:
        trajectories, sample_of = [], []
        counts = Counter({key: served[key] for key in ("requests", "malformed", "unauthorized", "length",
                                                       "sampling_overridden", "engine_calls")})
        counts.update({key: state.counts[key] for key in ("exceptions", "timeouts")})
        counts["wall_s"] = sum(state.wall)
        for k, session in enumerate(sessions):
            counts.update({key: session.counts[key] for key in ("rewritten", "concurrent", "sampled_tokens",
                                                                           "inserted_tokens")})
            segments = [segment.trajectory for segment in session.segments]
            fits = [t for t in segments if len(t.prompt) + len(t.tokens) <= self.max_positions]
            counts["too_long"] += len(segments) - len(fits)  # a prompt past the context: answered, never trained
            segments = fits
            if not segments:  # the agent never called the model (or only past the context): its prompt alone
                counts["no_requests"] += not session.segments
                segments = [Trajectory(prompt=list(prompt_ids[k // n]), ended=True)]
            counts["segments"] += len(segments)
            for trajectory in segments:
                trajectory.done = True
                if state.failed[k]:  # nothing of a failed run trains
                    trajectory.sampled = [0] * len(trajectory.sampled)
                trajectories.append(trajectory)
                sample_of.append(k)
        rewards = [0.0 if failed else value for failed, value in zip(state.failed, state.rewards, strict=True)]
        return AgentRun(trajectories, sample_of, rewards, list(state.failed),
                        torch.tensor([float(counts[key]) for key in AGENT_COUNTS], dtype=torch.float64))


class _RunState:
    """What the agents' thread tells this one: how many are running, and each run's outcome."""

    def __init__(self, samples: int):
        self.rewards: list[float | None] = [None] * samples
        self.failed = [False] * samples
        self.wall = [0.0] * samples
        self.counts: Counter = Counter()
        self.first_failure: tuple[str, str] | None = None  # (its kind: the exception's name or timeout, its words)
        self.kinds: set[str] = set()  # every failure's kind
        self._begun: dict[int, float] = {}
        self._lock = threading.Lock()

    def running(self) -> int:
        with self._lock:
            return len(self._begun)

    def started(self, k: int) -> None:
        with self._lock:
            self._begun[k] = time.perf_counter()

    def ended(self, k: int) -> None:
        with self._lock, contextlib.suppress(KeyError):
            self.wall[k] = time.perf_counter() - self._begun.pop(k)

    def fail(self, k: int, count: str, kind: str, words: str) -> None:
        """Run ``k`` failed: counted under ``count``; the step's first failure kept as (``kind``, its words)."""
        with self._lock:
            self.failed[k] = True
            self.counts[count] += 1
            self.kinds.add(kind)
            if self.first_failure is None:
                self.first_failure = (kind, f"sample {k}: {words}")
