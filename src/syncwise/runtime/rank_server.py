"""The process the local launcher forks its ranks from (multiprocessing's ``forkserver``), and what it imports.

A spawned rank imports torch, transformers and the job's modules afresh: ~4.5 s of CPU per rank, per job, most of
a short job's cost. The server imports them once, and each rank -- and the job's checks (:class:`Gate`) -- is
forked from it already imported: a launcher's ranks share one import, and a process that launches many jobs (a
test suite, a notebook) pays it once. What a rank must not share with another job it is given at its start:
the launcher's environment as it is then (:func:`rank_environment`), its working folder and import path
(multiprocessing's own preparation data).

The server's preload is :mod:`.rank_preload`, then the job's module.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Worker:
    """A job's rank entry, ``module:function``, imported where the ranks come from (the local launcher's fork
    server; torchrun's worker), never by the launcher: the job's imports (torch, transformers: seconds) are paid
    there, once per server."""

    path: str

    @property
    def module(self) -> str:
        return self.path.partition(":")[0]

    def load(self) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), self.path.partition(":")[2])


@dataclass(frozen=True)
class Gate:
    """A job's checks before its ranks start their work: ``worker`` called with ``args``. The local launcher runs
    them in a process forked from the ranks' server (:func:`check_in_server`: the server's imports serve them
    too, and the launcher imports neither torch's models nor transformers); torchrun's rank calls them itself."""

    worker: Worker
    args: tuple = ()

    def __call__(self) -> None:
        self.worker.load()(*self.args)


def check_in_server(context: multiprocessing.context.BaseContext, gate: Gate, environment: dict[str, str]) -> None:
    """Run ``gate`` in a process forked from the server and wait for it; raise what it raised."""
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_run_gate, args=(gate, environment, send))
    process.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError:  # it died without a word (killed)
        outcome = EOFError
    process.join()
    if outcome is EOFError:
        outcome = RuntimeError(f"the job's checks ended with exit status {process.exitcode} before they finished")
    if outcome is not None:
        raise outcome


def _run_gate(gate: Gate, environment: dict[str, str], send: Any) -> None:
    rank_environment(environment)
    try:
        gate()
        send.send(None)
    except Exception as exc:  # noqa: BLE001 - the launcher raises it; a mistake the checks found, or a bug
        try:
            send.send(exc)
        except Exception:  # noqa: BLE001 - an exception that does not pickle goes as its words
            send.send(RuntimeError(f"{type(exc).__name__}: {exc}"))


def rank_context(job_module: str | None) -> multiprocessing.context.BaseContext:
    """The context the launcher starts ranks with: a fork server that has imported :mod:`.rank_preload` and
    ``job_module`` (the rank entry's module). A process has one server; the first launch's job decides what it
    preloads, and a later job's module is imported in its ranks as before."""
    context = multiprocessing.get_context("forkserver")
    preload = [f"{__package__}.rank_preload"] + ([job_module] if job_module and job_module != "__main__" else [])
    context.set_forkserver_preload(preload)
    return context


def rank_environment(environment: dict[str, str]) -> None:
    """In a forked rank: the launcher's environment as it was when it started this rank (the server's is the one
    it had when the server started), and the intra-op threads torch took from it at import."""
    os.environ.clear()
    os.environ.update(environment)
    threads = environment.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def end_rank_server() -> None:
    """End the processes a local job left beside its ranks, and wait until they are gone: this process's fork
    server (killed: the ranks it forked have ended, and its interpreter's teardown with torch loaded took ~3 s,
    still running after the shell had its prompt back) and multiprocessing's resource tracker (it ends when its
    pipe closes). For a command's one job (:func:`~.launcher.launch`); a process that launches many keeps its
    server."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            server._stop()  # closes its pipe, reaps it, removes its socket
    with contextlib.suppress(ChildProcessError, OSError, AttributeError):
        resource_tracker._resource_tracker._stop()
