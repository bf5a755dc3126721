"""Tools the policy calls during a multi-turn rollout (``rl.tools``): plain Python functions a user writes --
typed parameters and a Google-style docstring -- turned into the JSON schema a chat template takes
(transformers' ``get_json_schema``, what ``apply_chat_template(tools=[fn])`` does), and run with a time limit.

A tool runs in the rank's own process, as a reward function does: your code, with the job's rights. What it
does wrong never stops the job: an exception, a call past ``rl.tool_timeout_s``, arguments that do not fit
its signature, a return that is not text -- each becomes the tool's answer to the model (an ``error: ...``
string, or the value as JSON) and is counted (``rollout/tool_errors/<kind>``).

Built in (:mod:`syncwise.tools`): ``rl.tools=[calculator]``, exact arithmetic on an expression without ``eval``.
"""

from __future__ import annotations

import inspect
import json
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..tools import BUILTIN_TOOLS
from .scoring import load_function

# What a tool call can go wrong with (each counted as rollout/tool_errors/<kind>; their sum: rollout/tool_errors)
ERROR_KINDS = ("bad_json", "unknown_tool", "bad_arguments", "exception", "timeout", "non_text")




@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}


def load_tools(paths: list[str]) -> dict[str, Tool]:
    """``rl.tools``: built-in names (``calculator``) or ``file.py:function`` / ``package.module:function``;
    a ValueError in one line naming the entry: not a function, a parameter without a type, no docstring
    describing the parameters, a name given twice."""
    from transformers.utils import get_json_schema

    tools: dict[str, Tool] = {}
    for path in paths:
        fn = BUILTIN_TOOLS.get(path) or load_function(path, "rl.tools")
        if not inspect.isfunction(fn):
            raise ValueError(f"rl.tools: {path!r} is a {type(fn).__name__}, not a function (a def with typed "
                             f"parameters and a docstring)")
        untyped = [name for name, p in inspect.signature(fn).parameters.items() if p.annotation is p.empty]
        if untyped:
            raise ValueError(f"rl.tools: {path!r}: parameter(s) {', '.join(untyped)} have no type hint; the "
                             f"model is shown each parameter's type (e.g. 'def {fn.__name__}(x: float) -> str')")
        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(f"rl.tools: {path!r}: {str(exc).splitlines()[0]} (a Google-style docstring: a "
                             f"description, then 'Args:' with a line per parameter)") from exc
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


def run_tool(tools: dict[str, Tool], name: str, arguments: Any, timeout_s: float) -> ToolResult:
    """Call ``name`` with ``arguments`` (a dict of keyword arguments) within ``timeout_s``; whatever goes
    wrong is the returned content (``error: ...``) and its kind, never an exception."""
    start = time.perf_counter()

    def result(content: str, error: str | None = None) -> ToolResult:
        return ToolResult(content, error, time.perf_counter() - start)

    tool = tools.get(name)
    if tool is None:
        return result(f"error: there is no tool named {name!r} (tools: {', '.join(sorted(tools))})", "unknown_tool")
    if not isinstance(arguments, dict):
        return result(f"error: the arguments of {name} must be a JSON object, got {arguments!r}", "bad_arguments")
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as exc:
        return result(f"error: {name}: {exc}", "bad_arguments")
    try:
        with time_limit(timeout_s):
            value = tool.fn(**arguments)
    except ToolTimeout:
        return result(f"error: {name} did not finish within {timeout_s:g} s", "timeout")
    except Exception as exc:  # the tool's own failure is its answer
        return result(f"error: {type(exc).__name__}: {exc}", "exception")
    if isinstance(value, str):
        return result(value)
    try:
        return result(json.dumps(value), "non_text")
    except (TypeError, ValueError):
        return result(str(value), "non_text")


class ToolTimeout(Exception):
    """A tool call ran past rl.tool_timeout_s."""


@contextmanager
def time_limit(seconds: float):
    """Raise :class:`ToolTimeout` in the calling thread after ``seconds`` (SIGALRM's real-time timer; only
    the main thread can take signals, elsewhere no limit). Interrupts Python code and sleeps, not a C call
    that never returns to the interpreter."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise ToolTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
