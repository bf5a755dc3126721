"""Ctrl-C and SIGTERM: a request to stop at the next step boundary, never an exception mid-collective.

Each rank only records the signal here. The engine shares the request in the all-reduce every step ends
with (``stop/signal`` in its metrics), so every rank learns it at the same step boundary; the job then
writes a checkpoint and raises :class:`JobStopped`, and the process exits with 128 + the signal number
(130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class JobStopped(Exception):
    """Every rank stopped cleanly at a step boundary after a signal; ``message`` says where and how to resume."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequest:
    """The signal this process received (0: none). Process-wide: signals are."""

    received: int = 0

    @classmethod
    def install(cls) -> None:
        """Catch SIGINT and SIGTERM from now on -- except a signal the process was started with ignored: a
        job put in the background by a non-interactive shell inherits SIGINT ignored, so that a Ctrl-C
        meant for the foreground does not stop it. Then unblocks them: the local launcher starts its ranks
        with them blocked, so one sent while the rank was importing is delivered now."""
        cls.received = 0
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, cls._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    @classmethod
    def _handle(cls, signum: int, frame: FrameType | None) -> None:
        cls.received = cls.received or signum


def stopped(signum: int, done: int, total: int, where: str) -> JobStopped:
    """The :class:`JobStopped` a job raises after stopping at a step boundary; ``where`` says what was kept."""
    name = signal.Signals(signum).name
    return JobStopped(signum, f"syncwise: stopped by {name} after step {done} of {total}; {where}")
