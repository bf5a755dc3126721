"""``syncwise ...`` run inside the test process, for what starts no rank: the mistakes a job's command answers
before any rank starts, and ``syncwise plan``.

A subprocess pays ~5 s of imports (torch, transformers) to print a few lines; here they are already imported.
What the user sees is the same: ``syncwise.jobs.cli.main`` is what ``python -m syncwise`` runs, its exit status
and its stdout / stderr are returned as a ``CompletedProcess``. A command that would start ranks fails the
test instead (those run as real processes: ``test_stop_and_errors.py`` keeps one real-process case of each kind).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock


def _no_launch(fn, nproc, payload, gate=None):
    if gate is not None:  # the job's checks (the launcher runs them beside its ranks): a mistake ends here
        gate()
    raise AssertionError("the command started ranks: run_cli is for what starts none")


@contextlib.contextmanager
def _inside(cwd: Path | None, path: Path | None, env: dict[str, str] | None):
    """In ``cwd``, with ``path`` and ``cwd`` first on sys.path and ``env`` set; afterwards as before, and the
    modules the command imported from ``cwd`` or ``path`` (a user's reward or tool file) forgotten, so that
    another test's file of the same name is imported afresh."""
    before_cwd, before_path, before_env = os.getcwd(), list(sys.path), dict(os.environ)
    before_modules = set(sys.modules)
    roots = [str(Path(p).resolve()) for p in (cwd, path) if p is not None]
    try:
        if cwd is not None:
            os.chdir(cwd)
        # as `python -m syncwise` has them: PYTHONPATH's entry, then the working folder, first on the path
        sys.path[:0] = [str(p) for p in (path, cwd) if p is not None]
        importlib.invalidate_caches()  # files a test just wrote
        os.environ.update(env or {})
        yield
    finally:
        os.chdir(before_cwd)
        sys.path[:] = before_path
        os.environ.clear()
        os.environ.update(before_env)
        for name in set(sys.modules) - before_modules:
            where = getattr(sys.modules[name], "__file__", None) or ""
            if any(where.startswith(root) for root in roots):
                del sys.modules[name]


def run_cli(args: list[str], *, cwd: Path | None = None, path: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``syncwise *args`` (in ``cwd``, ``path`` on the import path, ``env`` added) in this process."""
    from syncwise.jobs import cli

    out, err = io.StringIO(), io.StringIO()
    with _inside(cwd, path, env), mock.patch.object(cli, "launch", _no_launch), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in args])
        except SystemExit as stop:  # argparse's answer to a bad flag, as the process would exit
            code = stop.code if isinstance(stop.code, int) else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
