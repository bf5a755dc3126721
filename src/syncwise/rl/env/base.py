"""The environment room's door: what a conversation's world is to the rollout (:class:`Environment`).

An episode starts from its dataset row (:meth:`~Environment.start`, which may say something first: appended
to the prompt's last user message), offers the policy its tools -- bound to the episode, so a tool can change
the episode's state -- and may score the episode once it is over (:meth:`~Environment.reward`) and say
something about it (:meth:`~Environment.metrics`); it is closed once the trainer has scored it. The turn loop
(:mod:`syncwise.rl.rollout.turns`) asks nothing else of it: the tools of every episode in a turn run side by side in one
:class:`~syncwise.rl.env.tools.ToolRunner`, each call within its limits. ``rl.tools``' plain functions are
the environment without state (:class:`FunctionTools`, one for every episode); ``rl.environment``'s class is
:mod:`syncwise.rl.env.classes`' (one instance an episode)."""

from __future__ import annotations

from typing import Any, Protocol

from .tools import Tool


class Environment(Protocol):
    """One episode's world."""

    def start(self, row: dict[str, Any]) -> str | None:
        """Begin the episode of a dataset row; an observation shown before the first turn, or None."""

    def tools(self) -> dict[str, Tool]:
        """What the policy may call in this episode, by name."""

    def reward(self) -> float | None:
        """The episode's score after its last turn (None: the reward functions alone score it)."""

    def metrics(self) -> dict[str, float]:
        """Numbers about the episode, logged as ``env/<name>`` (their mean over the step's episodes)."""

    def close(self) -> None:
        """The episode is over (scored, or failed): let go of what it holds."""

    def state(self) -> Any:
        """The episode's state as plain data (dicts, lists, strings, numbers, None), for a checkpoint taken while
        its conversation is in flight (partial rollouts); ``NOT_SAVED`` where it cannot be saved."""

    def restore(self, row: dict[str, Any], state: Any) -> None:
        """Instead of :meth:`start`: the episode of ``row`` as :meth:`state` saved it."""


NOT_SAVED = object()  # an episode's state() where it cannot be saved


def close_all(episodes: list[Environment]) -> None:
    """Each episode closed, all of them even where one raises; the first error raised after, naming it."""
    errors = []
    for episode in episodes:
        try:
            episode.close()
        except Exception as exc:  # noqa: BLE001 - the user's clean-up (__exit__): the others still close
            errors.append(exc)
    if errors:
        raise RuntimeError(f"rl.environment: the episode's __exit__ raised {type(errors[0]).__name__}: "
                           f"{errors[0]}") from errors[0]


class FunctionTools:
    """``rl.tools``: plain functions, the same for every episode -- nothing to start, score or close."""

    def __init__(self, tools: dict[str, Tool]):
        self._tools = tools

    def start(self, row: dict[str, Any]) -> str | None:
        return None

    def tools(self) -> dict[str, Tool]:
        return self._tools

    def reward(self) -> float | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing held."""

    def state(self) -> Any:
        return None  # nothing to save

    def restore(self, row: dict[str, Any], state: Any) -> None:
        """Nothing to restore."""
