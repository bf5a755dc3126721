"""Threads that tools and episodes run on.

TRL runs an environment's ``reset``, its tools and ``get_reward`` on one thread, one call after another, and awaits
the ``async`` ones. An :class:`OwnThread` gives one episode exactly that -- everything of the episode on one thread
of its own (a sqlite connection opened in ``reset`` works in its tools), its calls in the order they were made,
a coroutine awaited on an event loop of the thread's own -- while other episodes' threads run side by side. A
plain function tool (``rl.tools``), which holds no state, gets an :class:`OwnThread` per call.

A call can be cancelled (:meth:`OwnThread.cancel`): an exception the tool's own ``except Exception`` does not catch
is raised in its thread at the next bytecode; a call blocked in C runs on until it returns, and its thread with
it -- the runner counts such threads and stops calling what keeps hanging (:mod:`syncwise.rl.env.tools`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class ToolCancelled(BaseException):
    """Raised in a cancelled call's thread: a BaseException, so the tool's ``except Exception`` lets it by."""


class Job:
    """One call on an :class:`OwnThread`: its outcome (``value`` or ``failure``) once ``done``."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, report_to: queue.Queue | None, tag: Any,
                 around: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.fn, self.args, self.kwargs, self.report_to, self.tag = fn, args, kwargs, report_to, tag
        self.around = around or contextlib.nullcontext
        self.done = threading.Event()
        self.value: Any = None
        self.failure: BaseException | None = None
        self.started: float | None = None  # when its thread began it (perf_counter)
        self.abandoned = False  # its caller gave up on it (past its limit) and cancelled it
        self.cancelled_at = 0.0  # when (perf_counter)

    def run(self, loop: asyncio.AbstractEventLoop) -> None:
        self.started = time.perf_counter()
        if self.abandoned:  # given up on before its turn came (answered already): never run late
            self.failure = ToolCancelled()
            self.done.set()
            return
        try:
            with self.around():
                value = self.fn(*self.args, **self.kwargs)
                if inspect.isawaitable(value):  # an async method: awaited here, as TRL awaits it
                    value = loop.run_until_complete(value)
            self.value = value
        except BaseException as exc:  # noqa: BLE001 - a tool's exit, a cancel, anything: the call's outcome
            self.failure = exc
        self.done.set()
        if self.report_to is not None:
            self.report_to.put(self)


class OwnThread:
    """A thread that runs the jobs it is given one at a time, in order (started at the first)."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.current: Job | None = None  # the job running now
        self.closed = False

    def submit(self, fn: Callable[..., Any], *args: Any, report_to: queue.Queue | None = None, tag: Any = None,
               around: Callable[[], contextlib.AbstractContextManager] | None = None, **kwargs: Any) -> Job:
        """Queue a call (``around``: a context it runs in, on the thread; ``report_to``: a queue the finished job is
        put on); a RuntimeError where no thread can be started (the caller says so as the call's answer)."""
        if self._thread is None:
            thread = threading.Thread(target=self._serve, daemon=True, name=self.name)
            thread.start()
            self._thread = thread
        job = Job(fn, args, kwargs, report_to, tag, around)
        self._jobs.put(job)
        return job

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` there and wait for it: its value, or what it raised."""
        job = self.submit(fn, *args, **kwargs)
        job.done.wait()
        if job.failure is not None:
            raise job.failure
        return job.value

    def cancel(self, job: Job) -> None:
        """Stop ``job`` where Python can, if it is still the one running."""
        with self._lock:
            if self.current is job and self._thread is not None and self._thread.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread.ident),
                                                           ctypes.py_object(ToolCancelled))

    def stuck_in(self, grace_s: float = 0.0) -> Job | None:
        """The job this thread is still running if its caller gave up on it (cancelled) ``grace_s`` or more ago and
        it has not come back: blocked where a cancel cannot reach it."""
        job = self.current
        if job is not None and job.abandoned and time.perf_counter() - job.cancelled_at >= grace_s:
            return job
        return None

    def close(self) -> None:
        """No more jobs: the thread ends once those queued have run."""
        self.closed = True
        if self._thread is not None:
            self._jobs.put(_END)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        job: Job | object | None = None
        try:
            while True:
                try:
                    if job is None:
                        with self._lock:
                            self.current = None
                        job = self._jobs.get()
                    if job is _END:
                        return
                    with self._lock:
                        self.current = job
                    job.run(loop)
                    job = None
                except ToolCancelled:  # a cancel that landed just after its job returned: that job is over
                    if isinstance(job, Job) and job.done.is_set():
                        job = None  # (one taken from the queue and not yet run runs on the next pass)
        finally:
            with self._lock:
                self.current = None
            with contextlib.suppress(Exception, ToolCancelled):
                loop.close()


_END = object()  # what close() queues: the thread ends there
