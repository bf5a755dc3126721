"""One job a run folder: a lock held on ``train.out_dir`` / ``sft.out_dir`` / ``dpo.out_dir`` for the job's life,
so that a second job on the same folder is refused in one line instead of setting the first's logs aside, replacing
its ``config.yaml`` and writing checkpoints beside it (both would exit 0, and a later ``resume=auto`` would resume a
mixture).

The lock is the kernel's (``flock`` on ``<folder>/.syncwise.lock``): it goes with the process that holds it,
however that process ends -- a crash, SIGKILL, the machine's OOM killer -- so a lock file a dead job left behind is
simply taken over by the next one. The file holds the holder's pid and host for the refusal's line."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

LOCK_NAME = ".syncwise.lock"


class RunFolderRefused(RuntimeError):
    """Another live job holds the folder, or it cannot be written: the message names the folder (and the holder)."""


class RunFolderLock:
    """The lock on one run folder (made if missing); released by :meth:`release` or by the process's end."""

    def __init__(self, folder: str | Path, key: str):
        self.folder, self.key = Path(folder), key
        self._fd: int | None = None
        self._made: list[Path] = []  # the folders acquire made, deepest first: removed again if left empty

    def acquire(self) -> RunFolderLock:
        self._made = [f for f in (self.folder, *self.folder.parents) if not f.exists()]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunFolderRefused(f"{self.key}: {self.folder}: cannot write there ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not said its pid"
            os.close(fd)
            raise RunFolderRefused(f"{self.key}: {self.folder} is in use by another job ({holder}); wait for it, stop "
                                "it, or give this job another folder") from None
        os.set_inheritable(fd, False)  # the ranks and tools this process starts do not hold it past its end
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """The lock released (the file stays for the next job); a folder this lock made and nothing else wrote in --
        a job refused before any rank started -- is removed again, so a mistake leaves nothing behind."""
        if self._fd is None:
            return
        os.close(self._fd)  # closing the descriptor releases the lock
        self._fd = None
        if self._made and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
            (self.folder / LOCK_NAME).unlink(missing_ok=True)
            for folder in self._made:
                try:
                    folder.rmdir()
                except OSError:  # not empty: something else is there
                    break

    def __enter__(self) -> RunFolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
