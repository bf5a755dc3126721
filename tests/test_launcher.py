"""The local launcher's verdict when a rank dies without a word (SIGKILL, OOM killer, segfault): that
rank is the cause, not the peer that then lost its connection."""

from __future__ import annotations

import os
import signal
import tempfile

import torch.distributed as dist

from dist_harness import _rank_main
from syncwise.runtime.launcher import launch_local


def _rank0_dies(info) -> None:
    dist.barrier()
    if info.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 1 waits for a peer that is gone: its connection breaks (or the launcher ends it)


def test_a_rank_that_dies_without_a_report_is_the_one_named(capsys):
    with tempfile.TemporaryDirectory() as out_dir:
        job = launch_local(_rank_main, 2, _rank0_dies, (), out_dir, 60.0, False, "gloo")
    assert job.exit_code == 1
    assert job.lines[0] == "syncwise: error: rank 0 of 2 died (signal SIGKILL) without a report"
    assert all("raised on rank 1" not in line for line in job.lines)
    assert capsys.readouterr().err.splitlines()[0] == job.lines[0]
