"""What a Python script hands a trainer (``GRPOTrainer(reward_funcs=[fn], train_dataset=ds, callbacks=[...])``,
:mod:`syncwise.jobs.trainers`), kept in this process and named in the job's config by a reference
(``<script>:reward_len``) where a command line names a file or a ``module:function``.

A config is plain data (it travels to the ranks and into ``config.yaml``); the objects do not travel: every rank
runs the script again (as ``torchrun`` and ``accelerate launch`` run a TRL script), so its trainer registers the same
objects under the same names there, and the loaders (:func:`syncwise.rl.env.loader.load_function`,
:func:`syncwise.data.sft_dataset.read_rows`, the logs' callbacks) find them here."""

from __future__ import annotations

from typing import Any

PREFIX = "<script>:"
_OBJECTS: dict[str, Any] = {}


def register(name: str, value: Any) -> str:
    """Keep ``value`` under ``name`` (a later one of the name replaces it: a script that builds two trainers); the
    reference a config names it by."""
    _OBJECTS[name] = value
    return PREFIX + name


def is_reference(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def lookup(reference: str, key: str) -> Any:
    """The object ``reference`` names; a ValueError naming ``key`` where this process has none (a config written
    by a script, read by a command line)."""
    name = reference[len(PREFIX):]
    if name not in _OBJECTS:
        raise ValueError(f"{key}: {reference} is an object a Python script gave its trainer; this process has none "
                         "of that name (run the script itself, or name a file or module:function instead)")
    return _OBJECTS[name]


def registered(name: str, default: Any = None) -> Any:
    """The object kept under ``name``, else ``default``."""
    return _OBJECTS.get(name, default)
