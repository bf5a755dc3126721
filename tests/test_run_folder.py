"""Issue 77 (2): one job a run folder. A second job started on the folder of a running one set the first's logs
aside, replaced its config.yaml and wrote checkpoints beside it; both exited 0. The launcher now holds a lock on the
folder for the job's life: a second `syncwise train` or `syncwise sft` there is one line naming the folder and the
holder's pid, and touches nothing; the lock goes with its process however it ends, so a folder a killed job left
is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from job_output import failed
from syncwise.runtime.run_folder import LOCK_NAME, RunFolderLock, RunFolderRefused

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
HOLD = ("import sys\nfrom syncwise.runtime.run_folder import RunFolderLock\n"
        "RunFolderLock(sys.argv[1], 'train.out_dir').acquire()\nprint('held', flush=True)\nsys.stdin.read()\n")


def _holder(folder: Path) -> subprocess.Popen:
    """Another process holding the folder's lock until its stdin closes (or it is killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=ENV)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_folder_held_by_a_live_process_is_refused_and_taken_over_once_it_dies(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(RunFolderRefused, match=rf"^sft.out_dir: {tmp_path / 'run'} is in use by another job "
                                                rf"\(pid {holder.pid} on "):
            RunFolderLock(tmp_path / "run", "sft.out_dir").acquire()
    finally:
        holder.kill()  # SIGKILL: no code of its own releases anything
        holder.wait()
    assert f"pid {holder.pid}" in (tmp_path / "run" / LOCK_NAME).read_text()  # the stale file is still there
    with RunFolderLock(tmp_path / "run", "sft.out_dir"):
        assert f"pid {os.getpid()}" in (tmp_path / "run" / LOCK_NAME).read_text()
    with RunFolderLock(tmp_path / "run", "sft.out_dir"):  # released on exit: taken again
        pass
    assert (tmp_path / "run" / LOCK_NAME).is_file()  # a folder the lock did not make keeps its lock file
    # a folder (and parents) the lock made, where nothing else was written -- a job refused before any rank -- goes
    with RunFolderLock(tmp_path / "new" / "run", "train.out_dir"):
        assert (tmp_path / "new" / "run" / LOCK_NAME).is_file()
    assert not (tmp_path / "new").exists()
    with RunFolderLock(tmp_path / "kept" / "run", "train.out_dir"):
        (tmp_path / "kept" / "run" / "metrics.jsonl").write_text("{}\n")
    assert (tmp_path / "kept" / "run" / "metrics.jsonl").is_file()


def test_a_second_job_on_a_running_job_s_folder_is_one_line_and_touches_nothing(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "syncwise", "train", f"train.out_dir={out}", "train.steps=200",
                              "train.progress=false", "rl.prompts_per_rank=4", "rl.samples_per_prompt=4",
                              "train.export=false"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):  # an event: the first step logged
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        config = (out / "config.yaml").read_text(), (out / "config.yaml").stat().st_mtime_ns
        for job, key in (("train", "train.out_dir"), ("sft", "sft.out_dir")):
            second = subprocess.run([sys.executable, "-m", "syncwise", job, f"{key}={out}"], env=ENV,
                                    capture_output=True, text=True, timeout=300)
            assert second.returncode == 2, failed(second.stderr, 2000)
            assert second.stderr.strip() == (f"syncwise: error: {key}: {out} is in use by another job (pid "
                                             f"{first.pid} on {os.uname().nodename}); wait for it, stop it, or give "
                                             "this job another folder"), second.stderr
        assert config == ((out / "config.yaml").read_text(), (out / "config.yaml").stat().st_mtime_ns)
        assert not list(out.glob("*.old-*")), list(out.iterdir())  # the running job's logs not set aside
    finally:
        os.killpg(first.pid, signal.SIGINT)
        first.communicate(timeout=300)
