"""The callbacks a Python script gave its trainer (``GRPOTrainer(..., callbacks=[...])``), called on rank 0 as
transformers' ``Trainer`` calls a ``TrainerCallback``: ``on_train_begin``, then each step ``on_step_end`` and
``on_log`` (``logs``: the step's metrics), ``on_evaluate`` for an evaluation's row, ``on_train_end`` -- each with
(args, state, control), transformers' own ``TrainerState`` and ``TrainerControl``; a hook a callback lacks is
skipped. A callback that sets ``control.should_training_stop`` is not obeyed (a step is collective): said once."""

from __future__ import annotations

from typing import Any

from ..runtime import script_objects
from .trackers import Tracker

CALLBACKS = "callbacks"  # the script objects' name for the trainer's callbacks
ARGS = "args"  # and for the config object it was given (the callbacks' ``args``)


class ScriptCallbacks(Tracker):
    name = "callbacks"

    def __init__(self, callbacks: list[Any], steps: int, resumed_at: int | None):
        from transformers import TrainerControl, TrainerState

        self.callbacks, self.args = callbacks, script_objects.registered(ARGS)
        self.state = TrainerState(global_step=resumed_at or 0, max_steps=steps, is_world_process_zero=True,
                                  is_local_process_zero=True)
        self.control = TrainerControl()
        self._call("on_train_begin")

    def _call(self, hook: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if callable(method):
                method(self.args, self.state, self.control, **kwargs)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.state.global_step = step
        self.state.log_history.append(dict(metrics))
        if any(k.startswith("eval/") for k in metrics) and "loss" not in metrics:
            self._call("on_evaluate", metrics=metrics)
            return
        self._call("on_step_end")
        self._call("on_log", logs=metrics)

    def close(self) -> None:
        self._call("on_train_end")


def script_callbacks(steps: int, resumed_at: int | None) -> list[Tracker]:
    """The trackers for the callbacks the script gave (none: an empty list)."""
    callbacks = script_objects.registered(CALLBACKS) or []
    return [ScriptCallbacks(list(callbacks), steps, resumed_at)] if callbacks else []
