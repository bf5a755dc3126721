"""The local launcher's verdict when a rank dies without a word (SIGKILL, OOM killer, segfault): that
rank is the cause, not the peer that then lost its connection. A signal that reaches the launcher while it is
still starting its ranks is never lost. And the ranks' fork server, shared by a process's launches, gives each
job the launcher as it is at the job's start."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.context import ForkServerProcess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_harness import _rank_main, run_distributed
from job_output import failed
from syncwise.runtime.job_store import host_store
from syncwise.runtime.launcher import launch_local
from syncwise.runtime.signals import StopRequest, stopped


def _rank0_dies(info) -> None:
    dist.barrier()
    if info.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 1 waits for a peer that is gone: its connection breaks (or the launcher ends it)


def _write_run_id(info, folder: str) -> None:
    from syncwise.runtime.job_store import RUN_ID_ENV, SECRET_ENV

    Path(folder, f"rank{info.rank}").write_text(f"{os.environ[SECRET_ENV]} {os.environ[RUN_ID_ENV]}")


def test_every_launch_is_a_run_of_its_own_though_the_secret_is_kept(monkeypatch, tmp_path):
    """Issue 67 (11): the local launcher keeps a SYNCWISE_JOB_SECRET it finds in the environment (one set for
    torchrun alike), but gives every launch a fresh run id, which every signature covers."""
    monkeypatch.setenv("SYNCWISE_JOB_SECRET", "kept")
    monkeypatch.setenv("SYNCWISE_RUN_ID", "left over")
    seen = []
    for launch in ("a", "b"):
        (tmp_path / launch).mkdir()
        with tempfile.TemporaryDirectory() as out_dir:
            job = launch_local(_rank_main, 2, _write_run_id, (str(tmp_path / launch),), out_dir, 60.0, False, "gloo")
        assert job.exit_code == 0
        ranks = {(tmp_path / launch / f"rank{r}").read_text() for r in range(2)}
        assert len(ranks) == 1  # both ranks of a run sign alike
        seen.append(ranks.pop().split())
    assert seen[0][0] == seen[1][0] == "kept" and len({seen[0][1], seen[1][1], "left over"}) == 3


def test_a_rank_that_dies_without_a_report_is_the_one_named(capsys):
    with tempfile.TemporaryDirectory() as out_dir:
        job = launch_local(_rank_main, 2, _rank0_dies, (), out_dir, 60.0, False, "gloo")
    assert job.exit_code == 1
    assert job.lines[0] == "syncwise: error: rank 0 of 2 died (signal SIGKILL) without a report"
    assert all("raised on rank 1" not in line for line in job.lines)
    assert capsys.readouterr().err.splitlines()[0] == job.lines[0]


def _waits_deep(depth: int, until: threading.Event) -> None:
    if depth:
        _waits_deep(depth - 1, until)
    else:
        until.wait()


def _rank0_aborts(info) -> None:
    """Rank 0 frees one block twice: glibc says so on stderr and aborts, as on a corrupt heap. Beside it 16 threads
    wait 20 calls deep, so the fault dump runs to many more lines than a test's tail of the output shows."""
    dist.barrier()
    if info.rank == 0:
        never = threading.Event()
        for _ in range(16):
            threading.Thread(target=_waits_deep, args=(20, never), daemon=True).start()
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        block = libc.malloc(24)
        libc.free(block)
        libc.free(block)
    dist.barrier()


def test_a_rank_a_fault_ends_prints_where_its_threads_were():
    """A rank ended by glibc's abort (or a segfault) writes no report; Python's fault handler prints its threads'
    stacks on its stderr and the launcher's line says so. In a process of its own: a rank writes to the stderr
    its fork server started with."""
    tests = os.path.dirname(__file__)
    code = ("import tempfile, test_launcher; from dist_harness import _rank_main; "
            "from syncwise.runtime.launcher import launch_local; "
            "job = launch_local(_rank_main, 2, test_launcher._rank0_aborts, (), tempfile.mkdtemp(), 60.0, False, "
            "'gloo'); "
            "raise SystemExit(job.exit_code)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Fatal Python error: Aborted" in proc.stderr and "in _rank0_aborts" in proc.stderr, proc.stderr[-2000:]
    # what glibc said is above the stacks: a test's message shows it first (tests/job_output.py), not only the tail
    assert "double free" not in proc.stderr[-3000:] and "double free" in failed(proc.stderr, 3000)
    assert ("syncwise: error: rank 0 of 2 died (signal SIGABRT) without a report; where its threads were is "
            "printed above it") in proc.stderr.splitlines()


def _run_until_asked_to_stop() -> None:
    """A rank that works until it is asked to stop (the bound only keeps a lost signal from hanging the test:
    the rank then ends with 0 and the assertion below fails)."""
    deadline = time.monotonic() + 120
    while not StopRequest.received and time.monotonic() < deadline:
        time.sleep(0.01)
    if StopRequest.received:
        raise stopped(StopRequest.received, 0, 1, "nothing kept")


@pytest.mark.parametrize("after_rank", [0, 1])
def test_a_signal_while_the_launcher_starts_its_ranks_stops_every_rank(monkeypatch, after_rank):
    """SIGTERM sent to the launcher right after it started rank ``after_rank`` -- while the other is not
    started yet (0) or while the launcher still masks its signals (1). The launcher used to ignore the stop
    signals while starting: a thread torch had started then took the signal and dropped it, and the job ran
    to its end. Now every rank stops (143)."""
    started = []
    start = ForkServerProcess.start

    def start_then_signal(process):
        start(process)
        started.append(process)
        if len(started) == after_rank + 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ForkServerProcess, "start", start_then_signal)
    job = launch_local(_run_until_asked_to_stop, 2)
    assert job.exit_code == 143, job.lines
    assert [p.exitcode for p in started] == [143, 143]


def test_the_rendezvous_port_is_the_launchers_from_before_any_rank_starts():
    """The launcher hosts the job's store (as torchrun's agent does) on a port it holds: another job starting at
    the same moment cannot take it between choosing it and a rank binding it."""
    store = host_store()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))
    store.set("k", "v")
    assert store.get("k") == b"v"


def _what_the_rank_sees(info, name: str) -> tuple:
    return os.environ.get(name), os.getcwd(), torch.get_num_threads(), os.getppid()


def test_ranks_forked_from_one_server_see_the_launcher_as_it_is_at_their_start(monkeypatch, tmp_path):
    """The fork server outlives a launch (its imports are paid once per process): a later job's ranks still get
    the launcher's environment, working folder and thread count of their own start, not the server's."""
    seen = {}
    for threads, value in ((1, "first"), (2, "second")):
        (tmp_path / value).mkdir()
        monkeypatch.chdir(tmp_path / value)
        monkeypatch.setenv("SYNCWISE_TEST_VALUE", value)
        monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
        seen[value] = run_distributed(_what_the_rank_sees, 2, "SYNCWISE_TEST_VALUE")
        assert [rank[:3] for rank in seen[value]] == [(value, str(tmp_path / value), threads)] * 2
    assert len({rank[3] for ranks in seen.values() for rank in ranks}) == 1  # one server forked all four


# A torchrun job's rank: its run id, a message signed there recorded, or a recorded one replayed into its store
TORCHRUN_RANK = """
import os, sys
from pathlib import Path
import torch.distributed as dist
from syncwise.runtime.distributed import init_distributed
from syncwise.runtime.job_store import ForgedMessage, SignedStore, job_secret, run_id

folder, mode = Path(sys.argv[1]), sys.argv[2]
info = init_distributed("gloo")
(folder / f"{mode}.rank{info.rank}").write_text(run_id())
store = dist.HashStore()
if mode == "record" and info.rank == 0:
    SignedStore(store, job_secret()).set("batch/1/0", b"scored batch")
    (folder / "recorded").write_bytes(store.get("batch/1/0"))
if mode == "replay" and info.rank == 0:
    store.set("batch/1/0", (folder / "recorded").read_bytes())
    try:
        SignedStore(store, job_secret()).get("batch/1/0")
        (folder / "replayed").write_text("accepted")
    except ForgedMessage:
        (folder / "replayed").write_text("refused")
dist.destroy_process_group()
"""


def test_two_torchrun_jobs_with_one_secret_do_not_accept_each_other_s_messages(tmp_path):
    """Issue 77 (3): signatures covered torchrun's rendezvous id, whose default is the string 'none' in every
    job, so two torchrun jobs launched with one secret (as torchrun's docs show them, no --rdzv-id) accepted each
    other's recorded messages. Every rank now adds a random nonce at the start: each run's id is its own, its
    ranks agree on it, and a message recorded from the first run does not verify in the second."""
    (tmp_path / "rank.py").write_text(TORCHRUN_RANK)
    env = {**os.environ, "SYNCWISE_JOB_SECRET": "one secret in the launch script", "OMP_NUM_THREADS": "1"}
    env.pop("SYNCWISE_RUN_ID", None)
    for mode in ("record", "replay"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-port", str(_free_port()), str(tmp_path / "rank.py"), str(tmp_path), mode],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, failed(proc.stderr, 2000)
    ids = {mode: {(tmp_path / f"{mode}.rank{r}").read_text() for r in range(2)} for mode in ("record", "replay")}
    assert len(ids["record"]) == len(ids["replay"]) == 1 and ids["record"] != ids["replay"], ids
    assert "none" not in ids["record"] | ids["replay"]
    assert (tmp_path / "replayed").read_text() == "refused"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
