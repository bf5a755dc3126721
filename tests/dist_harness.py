"""Run a function on N real gloo ranks (processes the launcher starts) and collect what each rank returns."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from syncwise.runtime.distributed import init_distributed, shutdown
from syncwise.runtime.launcher import launch_local

# A hang becomes an error after this long, so a broken test fails instead of stalling CI.
COLLECTIVE_TIMEOUT_S = 120.0


class RankFailed(AssertionError):
    """A rank raised: the launcher's root cause with its traceback."""


def _rank_main(fn, args: tuple, out_dir: str, timeout_s: float, clean: bool, backend: str) -> None:
    info = init_distributed(backend, timeout_s)
    result = fn(info, *args)
    torch.save(result, Path(out_dir) / f"rank{info.rank}.pt")
    if clean:  # else the group is left as it is: the scenario broke it on purpose
        shutdown()


def run_distributed(fn, world_size: int, *args: Any, timeout_s: float = COLLECTIVE_TIMEOUT_S,
                    clean_shutdown: bool = True, backend: str = "gloo") -> list[Any]:
    """``fn(info, *args)`` on ``world_size`` ranks; returns each rank's (torch.save-able) result.

    ``clean_shutdown=False`` skips the final barrier, for scenarios that leave the group broken."""
    with tempfile.TemporaryDirectory() as out_dir:
        job = launch_local(_rank_main, world_size, fn, args, out_dir, timeout_s, clean_shutdown, backend)
        if job.exit_code != 0:
            cause = job.cause
            raise RankFailed("\n".join(job.lines) + ("\n" + cause.traceback if cause else ""))
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def child_pids(pid: int, *, descendants: bool = False) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc), or with ``descendants`` all below it."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = sorted(p for p, pp in parents.items() if pp == parent)
        found += kids
        if descendants:
            frontier += kids
    return found
