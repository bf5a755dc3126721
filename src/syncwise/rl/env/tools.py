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

import ctypes
import inspect
import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...tools import BUILTIN_TOOLS
from .loader import load_function

# What a tool call can go wrong with (each counted as rollout/tool_errors/<kind>; their sum: rollout/tool_errors)
ERROR_KINDS = ("bad_json", "unknown_tool", "bad_arguments", "exception", "timeout", "step_timeout", "non_text")
# What a call's answer can be beside an error (counted, not errors): JSON (a dict, None, a number), cut
ANSWER_KINDS = ("json_answers", "truncated_answers")


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}


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


class ToolCancelled(BaseException):
    """Raised in an abandoned call's thread: a BaseException, so the tool's ``except Exception`` lets it by."""


# One call: the tools of its episode, the name called, the arguments as parsed
Call = tuple[dict[str, Tool], str, Any]


class ToolRunner:
    """Runs one rank's tool calls (see the module's docstring); :meth:`new_step` starts a step's budget."""

    def __init__(self, limits: ToolLimits):
        self.limits = limits
        self.spent = 0.0  # this step's seconds in tools (wall clock, however many ran at once)
        ToolOutput.install()

    def new_step(self) -> None:
        self.spent = 0.0

    def run(self, calls: list[Call]) -> list[ToolResult]:
        """Every call's result, in order: up to ``workers`` at a time (over every episode of the rank), each
        within the call's limit and all within what is left of the step's."""
        started = time.perf_counter()
        step_deadline = started + max(self.limits.step_timeout_s - self.spent, 0.0)
        results: list[ToolResult | None] = [None] * len(calls)
        finished: queue.Queue = queue.Queue()
        waiting = list(range(len(calls)))
        running: dict[int, tuple[threading.Thread, float, float]] = {}  # index -> (thread, start, deadline)
        while waiting or running:
            while waiting and len(running) < self.limits.workers:
                i = waiting.pop(0)
                now = time.perf_counter()
                tools, name, arguments = calls[i]
                early = _check(tools, name, arguments)
                if early is not None:
                    results[i] = early
                elif now >= step_deadline:
                    results[i] = self._step_spent(name)
                else:
                    thread = threading.Thread(target=_call, args=(i, tools[name], arguments, finished), daemon=True,
                                              name=f"syncwise-tool-{name}")
                    running[i] = (thread, now, min(now + self.limits.timeout_s, step_deadline))
                    thread.start()
            if not running:
                continue
            try:
                i, value, failure = finished.get(timeout=max(min(d for _, _, d in running.values())
                                                              - time.perf_counter(), 0.0))
            except queue.Empty:
                self._expire(calls, running, results, step_deadline)
                continue
            if i in running:  # not abandoned already
                _, start, _ = running.pop(i)
                results[i] = self._answer(value, failure, time.perf_counter() - start)
        self.spent += time.perf_counter() - started
        return results

    def _expire(self, calls, running, results, step_deadline: float) -> None:
        """Abandon the calls past their deadline: their answer is the limit they ran into."""
        now = time.perf_counter()
        for i, (thread, start, deadline) in list(running.items()):
            if now < deadline:
                continue
            del running[i]
            _raise_in(thread, ToolCancelled)  # abandoned: stopped where Python can stop it
            name = calls[i][1]
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


def _call(i: int, tool: Tool, arguments: dict, finished: queue.Queue) -> None:
    """One call, on its own thread: whatever it raises (SystemExit too) is its failure."""
    try:
        ToolOutput.current.name = tool.name
        try:
            value, failure = tool.fn(**arguments), None
        except ToolCancelled:
            raise
        except BaseException as exc:  # noqa: BLE001 - a tool's exit, or anything else, is its answer
            value, failure = None, exc
        finally:
            ToolOutput.current.name = None
        finished.put((i, value, failure))
    except ToolCancelled:
        return  # abandoned: its answer was given already


def _raise_in(thread: threading.Thread, exception: type[BaseException]) -> None:
    """Raise ``exception`` in ``thread`` at its next bytecode (CPython's asynchronous exception)."""
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exception))


class ToolOutput:
    """``sys.stdout`` / ``sys.stderr`` as a tool's thread sees them: each line it prints says which tool
    printed it (the job's own lines pass as they are). Installed once per process."""

    current = threading.local()

    def __init__(self, stream):
        self.stream = stream

    @classmethod
    def install(cls) -> None:
        for attr in ("stdout", "stderr"):
            stream = getattr(sys, attr)
            if not isinstance(stream, cls) and stream is not None:
                setattr(sys, attr, cls(stream))

    def write(self, text: str) -> int:
        name = getattr(self.current, "name", None)
        if name is None:
            return self.stream.write(text)
        out = []
        for piece in text.splitlines(keepends=True):
            if getattr(self.current, "line_start", True):  # per thread: each call's own lines
                out.append(f"[tool {name}] ")
            out.append(piece)
            self.current.line_start = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def __getattr__(self, attr: str):
        return getattr(self.stream, attr)
