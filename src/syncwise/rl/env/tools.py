"""Tools the policy calls during a multi-turn rollout (``rl.tools``): plain Python functions a user writes --
typed parameters and a Google-style docstring -- turned into the JSON schema a chat template takes
(transformers' ``get_json_schema``, what ``apply_chat_template(tools=[fn])`` does), and run by
:class:`ToolRunner`.

A tool runs in the rank's own process, as a reward function does: your code, with the job's rights. Each call
runs on a thread of its own, the calls of a turn side by side (``rl.tool_workers`` at a time), and the rank
waits for none past its limit: a call still running at ``rl.tool_timeout_s`` is abandoned -- its answer is the
timeout -- and stopped where Python can stop it (an exception the tool's own ``except Exception`` does not
catch, raised at its next bytecode; a call blocked in C runs on, abandoned). The calls of a step together stop
at ``rl.tool_step_timeout_s``, so one rank's slow tools cannot keep the others waiting at the next collective
until ``dist.timeout_s`` ends the job. Nothing a tool does wrong stops the job: an exception (``SystemExit``
too), the time limits, arguments that do not fit its signature, an answer that is not text -- each becomes the
tool's answer to the model (an ``error: ...`` string) and is counted (``rollout/tool_errors/<kind>``). An
answer longer than ``rl.tool_max_chars`` is cut (the cut said in it); one that is JSON (``None``, a dict, a
number) is given as JSON and counted apart, not as an error. What a tool prints goes to the job's output with
``[tool <name>]`` before each line.

Built in (:mod:`syncwise.tools`): ``rl.tools=[calculator]``, exact arithmetic on an expression without ``eval``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...runtime.sandbox import SandboxRefused
from ...tools import BUILTIN_TOOLS
from .loader import load_function
from .threads import Job, OwnThread

# What a tool call can go wrong with (each counted as rollout/tool_errors/<kind>; their sum: rollout/tool_errors)
ERROR_KINDS = ("bad_json", "unknown_tool", "bad_arguments", "exception", "timeout", "step_timeout", "hung", "non_text")
# What a call's answer can be beside an error (counted, not errors): JSON (a dict, None, a number), cut
ANSWER_KINDS = ("json_answers", "truncated_answers")


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    thread: OwnThread | None = None  # the thread it must run on (an episode's own); None: a thread per call


def tool_schema(fn: Callable[..., Any], label: str) -> dict[str, Any]:
    """The JSON schema a chat template shows for ``fn``; a ValueError in one line naming ``label`` where a
    parameter has no type hint or the docstring does not describe the parameters."""
    from transformers.utils import get_json_schema

    untyped = [name for name, p in inspect.signature(fn).parameters.items()
               if name != "self" and p.annotation is p.empty]
    if untyped:
        raise ValueError(f"{label}: parameter(s) {', '.join(untyped)} have no type hint; the "
                         f"model is shown each parameter's type (e.g. 'def {fn.__name__}(x: float) -> str')")
    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(f"{label}: {str(exc).splitlines()[0]} (a Google-style docstring: a "
                         f"description, then 'Args:' with a line per parameter)") from exc


def load_tools(paths: list[str]) -> dict[str, Tool]:
    """``rl.tools``: built-in names (``calculator``) or ``file.py:function`` / ``package.module:function``;
    a ValueError in one line naming the entry: not a function, a parameter without a type, no docstring
    describing the parameters, a name given twice."""
    tools: dict[str, Tool] = {}
    for path in paths:
        fn = BUILTIN_TOOLS.get(path) or load_function(path, "rl.tools")
        if not inspect.isfunction(fn):
            raise ValueError(f"rl.tools: {path!r} is a {type(fn).__name__}, not a function (a def with typed "
                             f"parameters and a docstring)")
        schema = tool_schema(fn, f"rl.tools: {path!r}")
        name = schema["function"]["name"]
        if name in tools:
            raise ValueError(f"rl.tools: two tools are named {name!r}")
        tools[name] = Tool(name, fn, schema)
    return tools


@dataclass
class ToolResult:
    content: str  # what the model reads as the tool's answer
    error: str | None  # one of ERROR_KINDS, or None
    seconds: float
    kinds: tuple[str, ...] = ()  # of ANSWER_KINDS: what else to count about the answer


@dataclass(frozen=True)
class ToolLimits:
    """The limits every call runs within (``rl.tool_*``)."""

    timeout_s: float = 10.0  # per call
    step_timeout_s: float = 300.0  # all of a step's calls on this rank, one after another or side by side
    max_chars: int = 4096  # an answer's length
    workers: int = 8  # calls at a time


# One call: the tools of its episode, the name called, the arguments as parsed
Call = tuple[dict[str, Tool], str, Any]


class ToolRunner:
    """Runs one rank's tool calls (see the module's docstring); :meth:`new_step` starts a step's budget."""

    def __init__(self, limits: ToolLimits):
        self.limits = limits
        self.spent = 0.0  # this step's seconds in tools (wall clock, however many ran at once)
        # calls given up on whose threads still run (blocked in C): per tool (its function, whichever episode's
        # instance it is bound to), pruned as they come back
        self.hanging: dict[Any, list[Job]] = {}
        ToolOutput.install()

    def new_step(self) -> None:
        self.spent = 0.0

    def run(self, calls: list[Call]) -> list[ToolResult]:
        """Every call's result, in order: up to ``workers`` at a time (over every episode of the rank; one
        episode's calls one after another, on its own thread), each within the call's limit and all within what
        is left of the step's."""
        started = time.perf_counter()
        step_deadline = started + max(self.limits.step_timeout_s - self.spent, 0.0)
        results: list[ToolResult | None] = [None] * len(calls)
        finished: queue.Queue = queue.Queue()
        lanes: dict[int, list[int]] = {}  # an episode's own thread (or a call of a plain function alone) -> calls
        for i, (tools, name, _) in enumerate(calls):
            thread = tools[name].thread if name in tools else None
            lanes.setdefault(id(thread) if thread is not None else -1 - i, []).append(i)
        running: dict[int, tuple[Job, OwnThread, float, float]] = {}  # lane -> (its call, thread, start, deadline)
        while any(lanes.values()) or running:
            for lane, waiting in lanes.items():
                if len(running) >= self.limits.workers:
                    break
                while waiting and lane not in running:
                    self._start(calls, waiting.pop(0), lane, results, finished, running, step_deadline)
            if not running:
                continue
            try:
                job = finished.get(timeout=max(min(d for *_, d in running.values()) - time.perf_counter(), 0.0))
            except queue.Empty:
                self._expire(calls, lanes, running, results, step_deadline)
                continue
            lane, i = job.tag
            if lane in running and running[lane][0] is job:  # not given up on already
                start = running.pop(lane)[2]
                results[i] = self._answer(job.value, job.failure, time.perf_counter() - start)
        self.spent += time.perf_counter() - started
        return results

    def _start(self, calls: list[Call], i: int, lane: int, results: list, finished: queue.Queue,
               running: dict, step_deadline: float) -> None:
        """Call ``i`` started on its thread, or answered at once: it cannot run, the step's budget is spent, or
        what it would run on still hangs in an earlier call."""
        tools, name, arguments = calls[i]
        now = time.perf_counter()
        results[i] = _check(tools, name, arguments)
        if results[i] is not None:
            return
        if now >= step_deadline:
            results[i] = self._step_spent(name)
            return
        tool = tools[name]
        results[i] = self._hangs(tool)
        if results[i] is not None:
            return
        thread = tool.thread or OwnThread(f"syncwise-tool-{name}")
        try:
            job = thread.submit(tool.fn, report_to=finished, tag=(lane, i), around=lambda: ToolOutput.calling(name),
                                **arguments)
        except RuntimeError as exc:  # no thread to be had (the machine's limit): the call's answer, not the job's end
            results[i] = ToolResult(f"error: {name} could not be started: {exc}", "exception", 0.0)
            return
        if tool.thread is None:
            thread.close()  # its one call, then it ends
        running[lane] = (job, thread, now, min(now + self.limits.timeout_s, step_deadline))

    def _hangs(self, tool: Tool) -> ToolResult | None:
        """The answer for a call not made because an earlier one still hangs -- cancelled a call's time ago or more
        and not back (blocked in C): this episode's own thread is stuck in one, or ``workers`` of this tool's calls
        are (a tool that keeps hanging is called no more until they end: its threads stay bounded)."""
        grace = self.limits.timeout_s  # a cancelled call that has not stopped within a call's time again hangs
        if tool.thread is not None and (stuck := tool.thread.stuck_in(grace)) is not None:
            return ToolResult(f"error: {tool.name} was not called: this episode's earlier call of {stuck.fn.__name__} "
                              f"still hangs, cancelled past rl.tool_timeout_s={self.limits.timeout_s:g} s", "hung", 0.0)
        key = _function_of(tool)
        alive = self.hanging[key] = [job for job in self.hanging.get(key, []) if not job.done.is_set()]
        now = time.perf_counter()
        if sum(now - job.cancelled_at >= grace for job in alive) >= self.limits.workers:
            return ToolResult(f"error: {tool.name} was not called: {len(alive)} of its earlier calls still hang, "
                              f"cancelled past rl.tool_timeout_s={self.limits.timeout_s:g} s", "hung", 0.0)
        return None

    def _expire(self, calls: list[Call], lanes: dict, running: dict, results: list, step_deadline: float) -> None:
        """Give up on the calls past their deadline: their answer is the limit they ran into; each is cancelled
        where Python can stop it, and one still running is counted as hanging."""
        now = time.perf_counter()
        for lane, (job, thread, start, deadline) in list(running.items()):
            if now < deadline:
                continue
            del running[lane]
            i = job.tag[1]
            name = calls[i][1]
            job.abandoned, job.cancelled_at = True, now
            thread.cancel(job)
            self.hanging.setdefault(_function_of(calls[i][0][name]), []).append(job)
            if deadline < start + self.limits.timeout_s:  # the step's budget ran out first
                results[i] = self._step_spent(name, now - start)
            else:
                results[i] = ToolResult(f"error: {name} did not finish within {self.limits.timeout_s:g} s",
                                        "timeout", now - start)

    def _step_spent(self, name: str, seconds: float = 0.0) -> ToolResult:
        return ToolResult(f"error: {name} was not run to the end: this rank's tool calls have used the step's "
                          f"rl.tool_step_timeout_s={self.limits.step_timeout_s:g} s", "step_timeout", seconds)

    def _answer(self, value: Any, failure: BaseException | None, seconds: float) -> ToolResult:
        """The model's view of what the call gave: text as it is, JSON for JSON values, an error otherwise --
        at most ``max_chars`` of it."""
        kinds: tuple[str, ...] = ()
        error = None
        if isinstance(failure, SandboxRefused):  # the machine's, not the call's: the job's error
            raise failure
        if failure is not None:
            content, error = f"error: {type(failure).__name__}: {failure}", "exception"
        elif isinstance(value, str):
            content = value
        else:
            try:
                content, kinds = json.dumps(value), ("json_answers",)
            except (TypeError, ValueError):
                content, error = str(value), "non_text"
        limit = self.limits.max_chars
        if len(content) > limit:
            content = (content[:limit] + f"\n[truncated: the first {limit} of {len(content)} characters "
                       f"(rl.tool_max_chars)]")
            kinds += ("truncated_answers",)
        return ToolResult(content, error, seconds, kinds)


def run_tool(tools: dict[str, Tool], name: str, arguments: Any, timeout_s: float) -> ToolResult:
    """One call, alone, within ``timeout_s`` (what :class:`ToolRunner` does for a turn's calls)."""
    return ToolRunner(ToolLimits(timeout_s=timeout_s)).run([(tools, name, arguments)])[0]


def _function_of(tool: Tool) -> Any:
    """What a tool runs, the same for every episode's instance (a bound method's function)."""
    return getattr(tool.fn, "__func__", tool.fn)


def _check(tools: dict[str, Tool], name: str, arguments: Any) -> ToolResult | None:
    """The answer for a call that cannot run (no such tool, arguments that do not fit), else None."""
    tool = tools.get(name)
    if tool is None:
        return ToolResult(f"error: there is no tool named {name!r} (tools: {', '.join(sorted(tools))})",
                          "unknown_tool", 0.0)
    if not isinstance(arguments, dict):
        return ToolResult(f"error: the arguments of {name} must be a JSON object, got {arguments!r}",
                          "bad_arguments", 0.0)
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as exc:
        return ToolResult(f"error: {name}: {exc}", "bad_arguments", 0.0)
    return None


class ToolOutput:
    """``sys.stdout`` / ``sys.stderr`` as a tool's thread sees them: each line it prints says which tool
    printed it, written whole (a line begun by one call never takes another's text: calls side by side print
    line by line), the last unfinished one at the call's end; the job's own lines pass as they are. Installed
    once per process."""

    current = threading.local()
    _lock = threading.Lock()

    def __init__(self, stream):
        self.stream = stream

    @classmethod
    def install(cls) -> None:
        for attr in ("stdout", "stderr"):
            stream = getattr(sys, attr)
            if not isinstance(stream, cls) and stream is not None:
                setattr(sys, attr, cls(stream))

    @classmethod
    @contextlib.contextmanager
    def calling(cls, name: str):
        """Within the block this thread's prints are tool ``name``'s; what is left of a line is written at its end."""
        cls.current.name, cls.current.pending = name, {}
        try:
            yield
        finally:
            pending, cls.current.name, cls.current.pending = cls.current.pending, None, {}
            for stream, text in pending.items():
                if text:
                    stream._write_lines(name, text + "\n")

    def write(self, text: str) -> int:
        name = getattr(self.current, "name", None)
        if name is None:
            return self.stream.write(text)
        pending = self.current.pending
        whole, _, rest = (pending.get(self, "") + text).rpartition("\n")
        pending[self] = rest
        if whole:
            self._write_lines(name, whole + "\n")
        return len(text)

    def _write_lines(self, name: str, text: str) -> None:
        lines = "".join(f"[tool {name}] {line}" for line in text.splitlines(keepends=True))
        with self._lock:
            self.stream.write(lines)

    def __getattr__(self, attr: str):
        return getattr(self.stream, attr)
