"""``rl.environment=my_env.py:MyEnv``: an environment class as TRL's ``environment_factory`` takes it, run
unchanged. One instance per conversation (built with no arguments); ``reset(**row)`` starts its episode from
the dataset row (every column, ``prompt`` included) and may return text, appended to the prompt's last user
message; every public method but the reserved ones is a tool (its schema from its signature and docstring,
as ``rl.tools``' functions); ``get_reward()``, if the class has it, scores the episode after its last turn --
one more reward beside ``rl.reward_fn``'s, at weight 1, logged as ``reward/<ClassName>``; ``get_metrics()``, if
it has it, returns numbers logged as ``env/<name>`` (the mean over every episode of the step); ``close()``, if
it has it, is called once the episode is scored, also when anything failed. What a method raises is the
tool's answer to the model, as for ``rl.tools``."""

from __future__ import annotations

import inspect
from typing import Any

from .loader import load_function
from .tools import Tool, tool_schema

# Methods of the class that are not tools
RESERVED = ("reset", "get_reward", "get_metrics", "close")


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
        methods = [name for name, member in inspect.getmembers(cls, inspect.isfunction)
                   if not name.startswith("_") and name not in RESERVED]
        if not methods:
            raise ValueError(f"rl.environment: {path!r} has no tool methods (public methods besides "
                             f"{', '.join(RESERVED)}); the model needs something to call")
        self.schemas = {name: tool_schema(getattr(cls, name), f"rl.environment: {path!r}: {name}")
                        for name in methods}
        self.reset_needs = [name for name, p in inspect.signature(cls.reset).parameters.items()
                            if name != "self" and p.default is p.empty
                            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

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
    :class:`~syncwise.rl.env.base.Environment` protocol."""

    def __init__(self, spec: EnvironmentClass, functions: dict[str, Tool] | None = None):
        self.spec, self.instance = spec, spec.cls()
        own = {name: Tool(name, getattr(self.instance, name), schema) for name, schema in spec.schemas.items()}
        self._tools = {**(functions or {}), **own}  # rl.tools' functions beside the episode's methods

    def start(self, row: dict[str, Any]) -> str | None:
        opening = self.instance.reset(**row)
        return None if opening is None else str(opening)

    def tools(self) -> dict[str, Tool]:
        return self._tools

    def reward(self) -> float | None:
        get_reward = getattr(self.instance, "get_reward", None)
        return None if get_reward is None else float(get_reward())

    def metrics(self) -> dict[str, float]:
        get_metrics = getattr(self.instance, "get_metrics", None)
        return {} if get_metrics is None else {str(k): float(v) for k, v in dict(get_metrics()).items()}

    def close(self) -> None:
        close = getattr(self.instance, "close", None)
        if close is not None:
            close()
