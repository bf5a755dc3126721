"""``rl.environment=my_env.py:MyEnv``: an environment class as TRL's ``environment_factory`` takes it, run
unchanged -- as TRL runs it.

- One instance per conversation (built with no arguments). ``reset(**row)`` starts its episode from the dataset
  row (every column, ``prompt`` included) and may return text, appended to the prompt's last user message.
- Its tools are what TRL's are: every public method (instance or class method; not a static method) but ``reset``
  and ``get_reward`` -- a method named ``close`` or ``get_metrics`` is a tool like any other -- its schema from its
  signature and docstring, as ``rl.tools``' functions. What a method raises is the tool's answer to the model.
- ``get_reward()``, if the class has it, scores the episode after its last turn: one more reward beside
  ``rl.reward_fn``'s, at weight 1, logged as ``reward/<ClassName>``; ``None`` is no reward for that episode (as TRL
  has it: nothing added); a non-finite number or an exception is an error naming it.
- ``async def`` tools and an async ``get_reward`` (remote environments' adapters) are awaited.
- Everything of one episode -- building it, ``reset``, its tools in the order the model called them,
  ``get_reward``, its metrics and its clean-up -- runs on one thread of the episode's own
  (:class:`~syncwise.rl.env.threads.OwnThread`), as TRL runs them on one: what ``reset`` opens (a sqlite
  connection) works in the tools. Different episodes run side by side.
- syncwise's own additions, under names TRL never takes for a tool: a ``metrics`` attribute or property (a dict
  of numbers), logged as ``env/<name>`` (its mean over the step's episodes); for a class that is a context
  manager (``__enter__`` / ``__exit__``), the episode runs inside it -- entered before ``reset``, exited once the
  episode is scored, also when anything failed; and for a class with Python's ``__getstate__`` and
  ``__setstate__`` of its own (plain data: dicts, lists, strings, numbers, None), a partial rollout's checkpoint
  keeps its episodes in flight -- a resumed episode is built with no arguments, entered, and given
  ``__setstate__(state)`` instead of ``reset``. Without them a checkpoint cannot keep an episode under way: its
  conversation is dropped when the checkpoint is taken (counted, and said in one line).
"""

from __future__ import annotations

import inspect
from typing import Any

from .base import NOT_SAVED
from .loader import load_function
from .scoring import checked_reward
from .threads import OwnThread
from .tools import Tool, tool_schema

# TRL's: the methods of the class that are not tools
RESERVED = ("reset", "get_reward")


def tool_methods(cls: type) -> list[str]:
    """The names of ``cls``'s tools as TRL finds them (``inspect.getmembers(instance, inspect.ismethod)`` but
    ``reset``, ``get_reward`` and private names): instance methods and class methods, not static methods, not
    properties or other attributes."""
    names = []
    for name in dir(cls):
        if name.startswith("_") or name in RESERVED:
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, classmethod) or (inspect.isfunction(member) and not isinstance(member, staticmethod)):
            names.append(name)
    return names


class EnvironmentClass:
    """A user's environment class, checked once: its tool methods and their schemas."""

    def __init__(self, path: str):
        cls = load_function(path, "rl.environment")
        if not inspect.isclass(cls):
            raise ValueError(f"rl.environment: {path!r} is a {type(cls).__name__}, not a class (one instance per "
                             f"conversation, its public methods the tools)")
        if not callable(getattr(cls, "reset", None)):
            raise ValueError(f"rl.environment: {path!r} has no reset method (reset(**row) starts an episode)")
        self.cls, self.name = cls, cls.__name__
        methods = tool_methods(cls)
        if not methods:
            raise ValueError(f"rl.environment: {path!r} has no tool methods (public methods besides "
                             f"{', '.join(RESERVED)}); the model needs something to call")
        self.schemas = {name: tool_schema(getattr(cls, name), f"rl.environment: {path!r}: {name}")
                        for name in methods}
        self.reset_needs = [name for name, p in inspect.signature(cls.reset).parameters.items()
                            if name != "self" and p.default is p.empty
                            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.context_manager = callable(getattr(cls, "__enter__", None)) and callable(getattr(cls, "__exit__", None))
        self.row_places: dict[int, str] = {}  # id of a dataset row -> "data.jsonl line 3", for reset's errors

    def place_of(self, row: dict[str, Any]) -> str:
        """Where ``row`` comes from (its file and line), else the row itself, shortened."""
        if id(row) in self.row_places:
            return self.row_places[id(row)]
        text = repr(row)
        return f"row {text[:160]}{'...' if len(text) > 160 else ''}"

    @property
    def saves(self) -> bool:
        """Whether the class saves its episodes' state: ``__getstate__`` and ``__setstate__`` of its own (every
        object inherits a ``__getstate__`` that is not one)."""
        inherited = getattr(object, "__getstate__", None)
        return (getattr(self.cls, "__getstate__", inherited) is not inherited
                and callable(getattr(self.cls, "__setstate__", None)))

    @property
    def scores(self) -> bool:
        """Whether the class scores its episodes (``get_reward``)."""
        return callable(getattr(self.cls, "get_reward", None))

    @property
    def tools(self) -> dict[str, Tool]:
        """The tools as the prompts show them (their functions unbound: an episode binds its own)."""
        return {name: Tool(name, getattr(self.cls, name), schema) for name, schema in self.schemas.items()}

    def check_rows(self, columns: set[str], name: str) -> None:
        """A ValueError (one line) where ``reset`` takes arguments the dataset's rows do not have."""
        missing = [arg for arg in self.reset_needs if arg not in columns]
        if missing:
            raise ValueError(f"rl.environment: {self.name}.reset needs {', '.join(missing)}, which {name} does not "
                             f"have (its columns: {', '.join(sorted(columns))})")


class ClassEpisode:
    """One conversation's instance of an :class:`EnvironmentClass`, as the
    :class:`~syncwise.rl.env.base.Environment` protocol, everything of it on its own thread."""

    def __init__(self, spec: EnvironmentClass, functions: dict[str, Tool] | None = None):
        self.spec = spec
        self.thread = OwnThread(f"syncwise-episode-{spec.name}")
        self.instance = self.thread.call(spec.cls)
        self.entered = False
        own = {name: Tool(name, getattr(self.instance, name), schema, self.thread)
               for name, schema in spec.schemas.items()}
        self._tools = {**(functions or {}), **own}  # rl.tools' functions beside the episode's methods

    def start(self, row: dict[str, Any]) -> str | None:
        if self.spec.context_manager:
            self.thread.call(self.instance.__enter__)
            self.entered = True
        try:
            opening = self.thread.call(self.instance.reset, **row)
        except Exception as exc:  # the user's code: any exception -- named with the class, reset and the row
            raise ValueError(f"rl.environment: {self.spec.name}.reset(**row) raised {type(exc).__name__}: {exc} "
                             f"for {self.spec.place_of(row)}") from exc
        return None if opening is None else str(opening)

    def state(self) -> Any:
        """``__getstate__()``'s plain data; ``NOT_SAVED`` where the class has none of its own or a call of the
        episode still hangs on its thread (its state is mid-call)."""
        if not self.spec.saves or self.thread.stuck_in() is not None:
            return NOT_SAVED
        where = f"rl.environment: {self.spec.name}.__getstate__()"
        try:
            state = self.thread.call(self.instance.__getstate__)
        except Exception as exc:  # the user's code: any exception
            raise ValueError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        odd = not_plain(state)
        if odd is not None:
            raise ValueError(f"{where} returned {odd}; a checkpoint keeps plain data (dicts with string keys, "
                             "lists, strings, numbers, None)")
        return state

    def restore(self, row: dict[str, Any], state: Any) -> None:
        """The episode as ``state`` was saved: entered (a context-manager class), then ``__setstate__(state)``."""
        if self.spec.context_manager:
            self.thread.call(self.instance.__enter__)
            self.entered = True
        try:
            self.thread.call(self.instance.__setstate__, state)
        except Exception as exc:  # the user's code: any exception
            raise ValueError(f"rl.environment: {self.spec.name}.__setstate__() raised {type(exc).__name__}: "
                             f"{exc}") from exc

    def tools(self) -> dict[str, Tool]:
        return self._tools

    def reward(self) -> float | None:
        """``get_reward()``'s number; None where the class has none, where it says None (TRL: no reward), or
        where a call of the episode still hangs on its thread (its state is mid-call: nothing to ask)."""
        get_reward = getattr(self.instance, "get_reward", None)
        if get_reward is None or self.thread.stuck_in() is not None:
            return None
        where = f"rl.environment: {self.spec.name}.get_reward()"
        try:
            value = self.thread.call(get_reward)
        except Exception as exc:  # the user's code: any exception
            raise ValueError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        return checked_reward(value, f"{where} returned", "None for no reward")

    def metrics(self) -> dict[str, float]:
        """The ``metrics`` attribute's numbers (a method of that name is a tool, as TRL has it: not read)."""
        if self.thread.stuck_in() is not None:
            return {}
        found = self.thread.call(getattr, self.instance, "metrics", None)
        if found is None or callable(found):
            return {}
        return {str(k): float(v) for k, v in dict(found).items()}

    def close(self) -> None:
        """The episode is over: its context exited (a context-manager class), its thread ended."""
        try:
            if self.entered and self.thread.stuck_in() is None:
                self.entered = False
                self.thread.call(self.instance.__exit__, None, None, None)
        finally:
            self.thread.close()


def not_plain(value: Any, where: str = "state") -> str | None:
    """Where ``value`` holds something a checkpoint loaded with ``weights_only`` cannot (``"a set at
    state['seen']"``), or None where it is all plain data."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (list, tuple)):
        return next((odd for i, item in enumerate(value) if (odd := not_plain(item, f"{where}[{i}]"))), None)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"a {type(key).__name__} key {key!r} in {where}"
            if (odd := not_plain(item, f"{where}[{key!r}]")) is not None:
                return odd
        return None
    return f"a {type(value).__name__} at {where}"
