"""Starting a job's ranks and ending them, and what the user sees when one fails or is stopped.

- :func:`launch_local` starts N ranks on this machine with the environment torchrun would give them and
  supervises them: Ctrl-C or SIGTERM is passed on (the ranks stop at the next step boundary; a second
  signal kills them), a rank that fails gives the others :data:`FAILURE_GRACE_S` to notice before they are
  killed, and no process is left behind.
- A :class:`~.rank_server.Worker` names a job's rank entry (``module:function``) without importing it: the
  ranks' fork server imports the job, the job's checks (a :class:`~.rank_server.Gate`) run in a process forked
  from it beside the ranks, and the ranks start their work only once the checks have passed.
- :func:`rank_main` is every rank's entry, under the local launcher or torchrun: it turns a clean stop
  into exit status 128 + signal and any error into one short report. Under the local launcher the reports
  go to a folder the launcher reads, and the launcher prints the root cause once; under torchrun each
  failing rank prints its own line. The traceback only with ``SYNCWISE_DEBUG=1`` (``syncwise --debug``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from .errors import notes_of
from .job_store import RUN_ID_ENV, SECRET_ENV, host_store, new_secret, say_go, wait_for_go
from .rank_server import Gate, Worker, check_in_server, end_rank_server, rank_context, rank_environment
from .signals import STOP_SIGNALS, JobStopped, StopRequest

REPORT_DIR_ENV = "SYNCWISE_REPORT_DIR"
DEBUG_ENV = "SYNCWISE_DEBUG"
# After one rank fails, the others normally fail within a moment (their peer's sockets close); a rank
# that is not in a collective with it (e.g. still joining the process group) is killed after this.
FAILURE_GRACE_S = 10.0
# Errors that are the consequence of another rank's failure rather than its cause.
_SECONDARY = re.compile(
    r"did not complete within dist\.timeout_s|invalid on \d+ other rank|Connection closed by peer|"
    r"Connection reset by peer|Broken pipe|DistBackendError"
)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


@dataclass
class ErrorReport:
    """What one rank says about the exception that ended it."""

    rank: int
    world_size: int
    time: float
    message: str
    traceback: str

    @property
    def secondary(self) -> bool:
        return bool(_SECONDARY.search(self.message))


def describe(exc: BaseException) -> str:
    """One line for the user: syncwise's own errors (and ``ValueError``, which syncwise raises naming the
    key or file) by their message, anything else with its type in front; the notes of a clean-up that failed
    after it follow on the same line."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    mine = type(exc).__module__.startswith("syncwise") or type(exc) in (ValueError, FileNotFoundError)
    line = first if mine and first else (f"{type(exc).__name__}: {first}" if first else type(exc).__name__)
    # a clean-up that failed after it (runtime/errors.py) is said on the same line, after the error itself
    return "; ".join([line, *notes_of(exc)])


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank_main(fn: Callable[..., Any], *args: Any) -> int:
    """Run ``fn(*args)`` as one rank; returns its exit status (0, 128 + signal, or 1 after an error)."""
    from tqdm import tqdm

    StopRequest.install()
    _adopt_earlier_stop()
    # A rank a fault ends (a segfault, glibc's abort on a corrupt heap) writes no report: it prints where each of
    # its threads was instead, on its stderr, for the launcher's line to point at. (Not torch's native dump as
    # well: its handler takes SIGINT too, and dumps from inside a signal handler corrupt the heap.)
    with contextlib.suppress(ValueError, OSError, AttributeError, RuntimeError):  # a stderr with no descriptor
        faulthandler.enable(all_threads=True)
    warnings.formatwarning = _one_line_warning
    # tqdm's default lock is a multiprocessing semaphore, which a rank that ends with ``os._exit`` would
    # leave behind (the resource tracker then warns at exit); one rank's bars need only a thread lock.
    tqdm.set_lock(threading.RLock())
    rank, world = _rank_and_world()
    try:
        fn(*args)
        return 0
    except JobStopped as stop:
        if rank == 0:
            print(str(stop), flush=True)
        return stop.exit_code
    except BaseException as exc:  # noqa: BLE001 - every failure becomes one report
        report = ErrorReport(rank, world, time.time(), describe(exc), traceback.format_exc())
        folder = os.environ.get(REPORT_DIR_ENV)
        if folder:
            _write_report(Path(folder), report)
        else:  # under torchrun nobody collects: each failing rank says it once
            print(error_lines(report, world)[0], file=sys.stderr, flush=True)
            if debug_enabled():
                print(report.traceback, file=sys.stderr, flush=True)
        return 1


_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])
_python_formatwarning = warnings.formatwarning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """syncwise's own warnings as one line a user reads (not the source line that raised them); other
    libraries' as Python prints them."""
    if str(Path(filename).resolve()).startswith(_PACKAGE_DIR):
        return f"syncwise: warning: {message}\n"
    return _python_formatwarning(message, category, filename, lineno, line)


def leave(code: int) -> None:
    """End this rank's process with ``code``, without the interpreter's teardown: the rank has written
    everything it keeps (checkpoints, logs, its report), and tearing down the C++ side of a process group --
    after an error or a failed collective, and under load even after a clean ``destroy_process_group`` --
    can abort the process ("terminate called without an active exception") and turn a finished job into a
    failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


STOP_FILE = "stop"  # in the report folder: the signal the launcher received (written before it forwards it)


def _adopt_earlier_stop() -> None:
    """A signal the local launcher received before this rank existed (the launcher forwards only to ranks
    already started) is a stop request all the same. Read after the handlers are installed: any signal
    forwarded later is caught."""
    folder = os.environ.get(REPORT_DIR_ENV)
    stop = Path(folder) / STOP_FILE if folder else None
    if stop is not None and stop.exists():
        StopRequest.received = StopRequest.received or int(stop.read_text())


def _write_report(folder: Path, report: ErrorReport) -> None:
    tmp = folder / f".rank{report.rank}.json"
    tmp.write_text(json.dumps(asdict(report)))
    tmp.replace(folder / f"rank{report.rank}.json")


def root_cause(reports: list[ErrorReport]) -> ErrorReport:
    """The earliest report that is not a consequence of another rank's failure (else the earliest)."""
    primary = [r for r in reports if not r.secondary] or reports
    return min(primary, key=lambda r: r.time)


def error_lines(report: ErrorReport, world_size: int) -> list[str]:
    """At most three lines: the error, where it was raised, how to see more."""
    lines = [f"syncwise: error: {report.message}"]
    where = f"raised on rank {report.rank} of {world_size}" if world_size > 1 else ""
    hint = "" if debug_enabled() else "rerun with SYNCWISE_DEBUG=1 (or syncwise --debug) for the traceback"
    if where or hint:
        lines.append("syncwise: " + "; ".join(p for p in (where, hint) if p))
    return lines


# ------------------------------------------------------------------------------------------------
# The local launcher
# ------------------------------------------------------------------------------------------------
def _local_entry(local_rank: int, nproc: int, port: int, fn: Callable[..., Any] | Worker, args: tuple,
                 environment: dict[str, str], gated: bool = False) -> None:
    # Forked with SIGINT / SIGTERM blocked (see rank_preload), so that a Ctrl-C while it was still importing
    # could not end it with a KeyboardInterrupt traceback; rank_main makes them stop requests, unblocks them,
    # and adopts one the launcher received before it could forward it here.
    rank_environment(environment)
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
    )
    if isinstance(fn, Worker):
        fn = fn.load()
    if gated:  # imported; nothing else happens until the launcher's checks pass (else it kills this rank)
        wait_for_go(port)
    leave(rank_main(fn, *args))


@dataclass
class JobResult:
    """How a locally launched job ended: its exit status and, after a failure, the root cause."""

    exit_code: int
    reports: list[ErrorReport]
    lines: list[str]  # what the launcher printed

    @property
    def cause(self) -> ErrorReport | None:
        return root_cause(self.reports) if self.reports else None


class _Supervisor:
    """Passes signals to the ranks (the first asks them to stop, a second kills them) and reaps them,
    noting which ranks it killed itself and in which order the others ended."""

    def __init__(self, processes: list[multiprocessing.Process], folder: Path):
        self.processes, self.folder = processes, folder
        self.signals: list[int] = []
        self.previous: dict[int, Any] = {}
        self.killed: set[int] = set()  # ranks the launcher killed (a second signal, or after a failure)
        self.ended: list[int] = []  # ranks in the order they were seen to end on their own

    def __enter__(self) -> _Supervisor:
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.kill_all()

    def _handle(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)
        if len(self.signals) == 1:  # for ranks not started yet; before forwarding (see _adopt_earlier_stop)
            (self.folder / f".{STOP_FILE}").write_text(str(signum))
            (self.folder / f".{STOP_FILE}").replace(self.folder / STOP_FILE)
        for rank, process in enumerate(self.processes):
            if process in self.alive():
                if len(self.signals) > 1:
                    self.killed.add(rank)
                os.kill(process.pid, signum if len(self.signals) == 1 else signal.SIGKILL)

    def start(self) -> None:
        """Start every rank with the stop signals *blocked* (forked from a server that blocks them, see
        rank_preload, and is started in this masked section, a mask kept across exec): until :func:`rank_main`
        has installed its handlers and unblocks them, a signal stays pending in the rank -- it can neither end it
        mid-import nor be lost. The launcher's own handlers stay installed throughout, so a signal it receives
        meanwhile is handled too (never ignored: a disposition is process-wide, and a thread a library started
        would take a signal and drop it). Multiprocessing unblocks SIGINT / SIGTERM after starting its resource
        tracker, which would unmask the rest of this section: it is started first."""
        resource_tracker.ensure_running()
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for process in self.processes:
                process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)

    def alive(self) -> list[multiprocessing.Process]:
        return [p for p in self.processes if p.exitcode is None and p.is_alive()]

    def kill_all(self) -> None:
        for rank, process in enumerate(self.processes):
            if process in self.alive():
                self.killed.add(rank)
                process.kill()
        for process in self.processes:
            if process.pid is not None:  # one that failed to start (fork refused) has nothing to join
                process.join()

    def _note_ended(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.exitcode is not None and rank not in self.ended and rank not in self.killed:
                self.ended.append(rank)

    def wait(self) -> None:
        """Until every rank has exited; after the first failure, the rest get FAILURE_GRACE_S."""
        deadline = None
        while alive := self.alive():
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=1.0)
            self._note_ended()
            failed = any(p.exitcode not in (None, 0) and p.exitcode < 128 for p in self.processes)
            if failed and deadline is None:
                deadline = time.monotonic() + FAILURE_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                self.kill_all()


def launch_local(fn: Callable[..., Any] | Worker, nproc: int, *args: Any, gate: Gate | None = None,
                 forked_from_here: bool = False) -> JobResult:
    """Run ``fn(*args)`` on ``nproc`` local ranks (processes forked from :mod:`.rank_server`'s server, with
    torchrun's environment) and wait. ``forked_from_here``: the ranks are forks of this process instead (a
    notebook's trainer: what it holds in memory is theirs too, as accelerate's notebook launcher does).

    Prints the root cause of a failure (at most three lines) to stderr and returns how the job ended.
    ``fn`` must be picklable (a module-level function, or a :class:`Worker`). ``gate``: the job's checks, run in
    a process forked from the server beside the ranks (:func:`~.rank_server.check_in_server`); the ranks start
    their work only once they pass, and if they raise the ranks are killed (they have done nothing) and the
    exception goes on to the caller.
    """
    store = host_store()  # lives until the ranks have ended
    # Each rank gets its share of the cores; oversubscribing threads slows CPU runs several-fold.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    folder = Path(tempfile.mkdtemp(prefix="syncwise-reports-"))
    os.environ[REPORT_DIR_ENV] = str(folder)
    context = (multiprocessing.get_context("fork") if forked_from_here
               else rank_context(fn.module if isinstance(fn, Worker) else fn.__module__))
    environment = dict(os.environ)
    environment.setdefault(SECRET_ENV, new_secret())  # what the ranks sign their messages in the store with
    environment[RUN_ID_ENV] = new_secret()  # never inherited: a message recorded from an earlier run fails here
    processes = [context.Process(target=_local_entry, args=(r, nproc, store.port, fn, args, environment,
                                                            gate is not None)) for r in range(nproc)]
    try:
        with _Supervisor(processes, folder) as supervisor:
            supervisor.start()
            if gate is not None:  # a signal meanwhile is the supervisor's: the ranks adopt it at their first step
                check_in_server(context, gate, environment)
                say_go(store, environment[SECRET_ENV], environment[RUN_ID_ENV])
            supervisor.wait()
        reports = [ErrorReport(**json.loads(p.read_text())) for p in sorted(folder.glob("rank*.json"))]
    finally:
        os.environ.pop(REPORT_DIR_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)
    return _outcome([p.exitcode for p in processes], reports, nproc, supervisor)


CLEAN_STOP_CODES = (0, 128 + signal.SIGINT, 128 + signal.SIGTERM)
FAULT_SIGNALS = (signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL)  # faulthandler's


def _outcome(codes: list[int], reports: list[ErrorReport], nproc: int, supervisor: _Supervisor) -> JobResult:
    """The job's exit status and what the user reads. The root cause, in order: an error a rank reported
    that is not a consequence of another's failure; else a rank that died on its own without a report
    (killed by the kernel, a segfault: its peers then report only a broken connection); else the earliest
    report. Ranks the launcher killed itself are never the cause."""
    if all(code == 0 for code in codes):
        return JobResult(0, [], [])
    if len(supervisor.signals) > 1 and not [r for r in reports if not r.secondary]:
        name = signal.Signals(supervisor.signals[0]).name
        lines = [f"syncwise: stopped by a second {name}: ranks killed before a step boundary; no new checkpoint "
                 f"(rerun with train.resume=auto to go on from the last one)"]
        print(lines[0], file=sys.stderr, flush=True)
        return JobResult(128 + supervisor.signals[0], reports, lines)
    if not reports and all(code in CLEAN_STOP_CODES for code in codes):
        return JobResult(max(codes), [], [])  # a clean stop: rank 0 said where the checkpoint is
    reported = {r.rank for r in reports}
    died = [rank for rank in supervisor.ended
            if codes[rank] not in CLEAN_STOP_CODES and rank not in reported and rank not in supervisor.killed]
    primary = [r for r in reports if not r.secondary]
    if primary or not died:
        lines = error_lines(root_cause(reports), nproc) if reports else [
            f"syncwise: error: the ranks ended with exit statuses {codes} without a report"]
    else:
        rank = died[0]
        how = f"signal {signal.Signals(-codes[rank]).name}" if codes[rank] < 0 else f"exit status {codes[rank]}"
        lines = [f"syncwise: error: rank {rank} of {nproc} died ({how}) without a report"
                 + ("; where its threads were is printed above it" if -codes[rank] in FAULT_SIGNALS else "")]
        if reports:  # what its peers saw, so the broken connection they report is not mistaken for the cause
            lines.append(f"syncwise: the other rank(s) then lost their connection to it: {reports[0].message[:160]}")
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    if debug_enabled() and reports:
        print(root_cause(reports).traceback, file=sys.stderr, flush=True)
    return JobResult(1, reports, lines)


def launch(fn: Callable[..., Any] | Worker, nproc: int, payload: dict, gate: Gate | None = None) -> int:
    """Run ``fn(payload)`` as this torchrun rank, or start ``nproc`` local ranks; the exit status. ``gate``:
    the job's checks, which raise before anything starts (locally, in a process beside the ranks)."""
    from .distributed import launched_by_torchrun  # torch: only once a job really starts

    if not launched_by_torchrun():
        try:
            return launch_local(fn, nproc, payload, gate=gate).exit_code
        finally:
            end_rank_server()
    if gate is not None:
        gate()
    leave(rank_main(fn.load() if isinstance(fn, Worker) else fn, payload))
    return 0
