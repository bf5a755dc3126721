"""Run a function on N real gloo ranks (spawned processes) and collect what each rank returns."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from syncwise.distributed import init_distributed, shutdown
from syncwise.launcher import launch_local

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
