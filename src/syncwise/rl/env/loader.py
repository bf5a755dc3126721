"""A user's code by the name a config gives it: ``package.module:function`` (imported as ``python -m`` would,
with the job's folder first on the path), ``path/to/file.py:function`` or an object a Python script gave its
trainer (``<script>:name``, :mod:`syncwise.runtime.script_objects`) -- one loader for reward functions, tools and
environment classes."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...runtime import script_objects


def load_function(path: str, key: str) -> Callable[..., Any]:
    """The callable ``path`` names (``package.module:function`` or ``file.py:function``); a ValueError naming
    ``key`` (``rl.reward_fn``, ``rl.tools``) if it cannot be had."""
    if script_objects.is_reference(path):
        fn = script_objects.lookup(path, key)
        if not callable(fn):
            raise ValueError(f"{key}: {path} is not callable")
        return fn
    target, sep, attr = path.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{key}: {path!r} must look like 'package.module:function' or 'file.py:function'")
    try:
        if target.endswith(".py"):
            file = Path(target)
            if not file.is_file():
                raise ImportError(f"no file {target}")
            spec = importlib.util.spec_from_file_location(f"syncwise_user_{file.stem}", file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # as `python -m` runs: the job's folder importable
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, SyntaxError) as exc:
        raise ValueError(f"{key}: cannot import {path!r}: {exc}") from exc
    except (Exception, SystemExit) as exc:  # the module's own code failed (or exited) while it was imported
        raise ValueError(f"{key}: cannot import {path!r}: {type(exc).__name__}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"{key}: {path!r} is not callable")
    return fn
