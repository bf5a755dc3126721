"""What a user sees: Ctrl-C and SIGTERM stop `syncwise train` cleanly at a step boundary (locally and under
torchrun), mistakes are caught before any rank starts, and an error in one rank is reported once.

Signals: a process started in the background by a non-interactive shell inherits SIGINT *ignored*, and
so would the job this test starts. Each job is therefore started with SIGINT restored to SIG_DFL in its
own process (``preexec_fn``), or the Ctrl-C tests would prove nothing -- and one test checks that a job
started with SIGINT ignored keeps ignoring it, as a background job should.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_harness import run_cli
from dist_harness import child_pids
from job_output import failed
from syncwise.metrics import read_jsonl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
QUICK = ["train.progress=false", "rl.prompts_per_rank=4", "rl.samples_per_prompt=4", "train.export=false"]
STOPPED = re.compile(r"syncwise: stopped by (SIG\w+) after step (\d+) of 200; checkpoint (\S+); rerun with "
                     r"train\.resume=auto to go on")


def _restore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(cmd: list[str], preexec=_restore_sigint) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=preexec)


def _wait_for_steps(out: Path, steps: int, job: subprocess.Popen) -> None:
    """Until the job has logged ``steps`` steps (an event, not a time)."""
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert job.poll() is None, job.communicate()
        time.sleep(0.05)


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _assert_all_gone(pids: set[int]) -> None:
    """Every process the job started had ended when the launcher returned (issue 62 (12): the ranks' fork server
    still ran for ~3 s after the shell had its prompt back): the ranks, their fork server, multiprocessing's
    resource tracker. Read once, at once: no grace."""
    assert not _alive(pids), [Path(f"/proc/{p}/cmdline").read_text() for p in _alive(pids)]


def _train(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "syncwise", "train", f"train.out_dir={out}", "train.steps=200",
            "train.checkpoint_every=100", *QUICK, *extra]


def _assert_stopped(out: Path, stdout: str, stderr: str, signame: str) -> int:
    """One line says where the checkpoint is; it holds the last step logged; no traceback."""
    lines = [line for line in stdout.splitlines() if line.startswith("syncwise: stopped")]
    assert len(lines) == 1, stdout
    match = STOPPED.fullmatch(lines[0])
    assert match and match.group(1) == signame, lines[0]
    step = int(match.group(2))
    assert [r["train/step"] for r in read_jsonl(out / "metrics.jsonl")][-1] == step
    assert match.group(3) == str(out / "checkpoints" / f"step_{step:06d}")
    assert (out / "checkpoints" / "latest").read_text() == f"step_{step:06d}"
    assert "Traceback" not in stderr
    return step


ROLLOUT_RANKS = ("dist.nproc=4", "dist.rollout_ranks=2", "rl.off_policy_lag=1")
DRAWING_ON = ("dist.nproc=4", "dist.rollout_ranks=2", "rl.max_staleness=1")  # partial rollouts on rollout ranks


@pytest.mark.parametrize(("signame", "target", "roles"), [("SIGINT", "group", ()), ("SIGTERM", "launcher", ()),
                                                          ("SIGINT", "group", DRAWING_ON)],
                         ids=["SIGINT-group", "SIGTERM-launcher", "SIGINT-rollout-ranks-drawing-on"])
def test_signal_stops_at_a_step_boundary_with_a_checkpoint_and_resumes(tmp_path, signame, target, roles):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to the launcher
    alone: exit 130 / 143, the last completed step checkpointed, one line, no process left; resume goes on.
    With rollout ranks drawing partial rollouts on (issue 48) the trainers stop at the boundary, the rollout
    ranks hand over the batches they posted and the conversations in flight for the checkpoint, and end with
    them."""
    out = tmp_path / "run"
    job = _start(_train(out, *roles))
    _wait_for_steps(out, 3, job)
    ranks = set(child_pids(job.pid, descendants=True))
    assert len(ranks) >= 2
    signum = getattr(signal, signame)
    if target == "group":
        os.killpg(job.pid, signum)
    else:
        os.kill(job.pid, signum)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 128 + signum, stderr[-3000:]
    step = _assert_stopped(out, stdout, stderr, signame)
    _assert_all_gone(ranks)

    resumed = subprocess.run(_train(out, "train.resume=auto", f"train.steps={step + 2}", *roles), env=ENV,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, failed(resumed.stderr, 3000)
    assert f"at step {step}" in resumed.stdout
    assert [r["train/step"] for r in read_jsonl(out / "metrics.jsonl")][-3:] == [step, step + 1, step + 2]


def test_background_job_started_with_sigint_ignored_keeps_ignoring_it(tmp_path):
    out = tmp_path / "run"
    job = _start(_train(out), preexec=_ignore_sigint)
    _wait_for_steps(out, 2, job)
    os.killpg(job.pid, signal.SIGINT)
    logged = len((out / "metrics.jsonl").read_text().splitlines())
    _wait_for_steps(out, logged + 2, job)  # still training after the SIGINT
    os.kill(job.pid, signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 143, stderr[-3000:]
    _assert_stopped(out, stdout, stderr, "SIGTERM")


def _rank_pids(launcher: int) -> set[int]:
    """The launcher's ranks: the children of its fork server (the launcher's child that runs
    ``multiprocessing.forkserver``)."""
    ranks = set()
    for pid in child_pids(launcher):
        try:
            if "multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_text():
                ranks.update(child_pids(pid))
        except OSError:
            continue
    return ranks


def _wait_for_ranks(job: subprocess.Popen, count: int = 2) -> set[int]:
    """Until the launcher has started ``count`` ranks (an event: they have not installed their handlers yet)."""
    while len(ranks := _rank_pids(job.pid)) < count:
        assert job.poll() is None, job.communicate()
        time.sleep(0.01)
    return ranks


def _importing_torch(pid: int) -> bool:
    """Whether the process has begun loading torch's library (its memory map): the command line has read
    the config and is importing the job."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_ctrl_c_before_the_ranks_exist_is_one_line_and_130(tmp_path):
    """Issue 28.6: Ctrl-C while the command line imports torch and the job (no rank exists yet) ends with
    one line and 130, never a KeyboardInterrupt traceback."""
    job = _start(_train(tmp_path / "run"))
    while not _importing_torch(job.pid):  # an event, not a time
        assert job.poll() is None, job.communicate()
        time.sleep(0.001)
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert ("syncwise: stopped by SIGINT before the job started" in stderr
            or "syncwise: stopped by SIGINT after step" in stdout), (stdout, stderr)


def test_keyboard_interrupt_while_importing_the_job_is_one_line(monkeypatch, capsys):
    """The same, pinned where the signal lands most often: while the launcher imports torch to start the job."""
    from syncwise.jobs import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "launch", interrupted)
    assert cli.main(["train", "train.steps=1"]) == 130
    err = capsys.readouterr().err
    assert err == "syncwise: stopped by SIGINT before the job started; nothing was trained or saved\n"


def test_help_and_config_errors_do_not_import_torch():
    """Issue 28.6: ``--help``, a config error and a ``plan`` argument error are answered without torch."""
    code = ("import sys; from syncwise.jobs.cli import main\n"
            "for argv in (['train', 'no.such=1'], ['sft', 'sft.bad=1'], ['plan', 'x', '--rollout-sampler', 'y']):\n"
            "    assert main(argv) == 2\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "unknown key 'no'" in proc.stderr and "--rollout-sampler" in proc.stderr
    for argv in (["train", "--help"], ["plan", "--help"]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "syncwise", *argv], env=ENV,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and " torch\n" not in proc.stderr and "| torch\n" not in proc.stderr


@pytest.mark.parametrize(("signame", "target"), [("SIGINT", "group"), ("SIGTERM", "launcher")])
def test_signal_while_ranks_still_import_is_a_clean_stop(tmp_path, signame, target):
    """Ctrl-C (or SIGTERM) the moment the ranks exist, before they could install a handler: the launcher
    started them with the signals blocked, so it waits for them and becomes a stop request -- the first step
    boundary checkpoints, exit 130 / 143, one line, no KeyboardInterrupt traceback, no "rank died"."""
    out = tmp_path / "run"
    job = _start(_train(out))
    ranks = _wait_for_ranks(job)
    signum = getattr(signal, signame)
    os.killpg(job.pid, signum) if target == "group" else os.kill(job.pid, signum)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 128 + signum, stderr[-3000:]
    _assert_stopped(out, stdout, stderr, signame)
    assert "died" not in stderr and "KeyboardInterrupt" not in stderr
    _assert_all_gone(ranks)


def test_second_ctrl_c_kills_the_ranks_and_says_so(tmp_path):
    out = tmp_path / "run"
    job = _start(_train(out))
    _wait_for_steps(out, 2, job)
    ranks = set(child_pids(job.pid, descendants=True))
    os.killpg(job.pid, signal.SIGINT)
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "died" not in stderr
    # Either the ranks were killed first, or they had already stopped at the step boundary:
    assert ("syncwise: stopped by a second SIGINT: ranks killed before a step boundary" in stderr
            or "syncwise: stopped by SIGINT after step" in stdout), (stdout, stderr)
    _assert_all_gone(ranks)


def test_bench_stops_on_sigterm(tmp_path):
    job = _start([sys.executable, "-m", "syncwise", "bench", "--presets", "qwen2-test", "--microbatches", "2",
                  "--warmup", "1", "--repeats", "100000", "--seq-len", "16", "--out", str(tmp_path)])
    ranks = _wait_for_ranks(job)
    os.kill(job.pid, signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 143, stderr[-3000:]
    assert "syncwise: bench stopped by SIGTERM in round" in stdout and "no results written" in stdout
    assert "Traceback" not in stderr
    _assert_all_gone(ranks)


def test_sigint_under_torchrun(tmp_path):
    """torchrun forwards the signal to its workers: they stop at the same step boundary, checkpoint it,
    rank 0 prints the line once and both exit 130; torchrun then reports the signal itself (its own
    warning and exit status 1, not syncwise's)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "syncwise", "train", f"train.out_dir={out}", "train.steps=200", "train.checkpoint_every=100",
           *QUICK]
    job = _start(cmd)
    _wait_for_steps(out, 3, job)
    workers = set(child_pids(job.pid, descendants=True))
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr = job.communicate(timeout=300)
    step = _assert_stopped(out, stdout, "", "SIGINT")
    _assert_all_gone(workers)
    assert f"step {step}" in stdout


# ------------------------------------------------------------------------------------------------
# Mistakes
# ------------------------------------------------------------------------------------------------
def _run(args: list[str], cwd: Path, path: Path | None = None) -> subprocess.CompletedProcess:
    """``syncwise args`` with ``path`` first on PYTHONPATH (where the reward module is)."""
    env = {**ENV, "PYTHONPATH": f"{path}{os.pathsep}{ENV.get('PYTHONPATH', '')}"} if path else ENV
    return subprocess.run([sys.executable, "-m", "syncwise", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mistakes")
    (root / "bad.jsonl").write_text('{"prompt": "target 1 :"}\nnot json\n')
    (root / "noprompt.jsonl").write_text('{"prompt": "target 1 :"}\n\n{"question": "target 2 :"}\n')
    (root / "empty_model").mkdir()
    (root / "rewards.py").write_text(
        "import os\n\ndef flaky(prompt, response, row):\n"
        "    if os.environ['RANK'] == '1':\n        raise KeyError('target_digit')\n    return 0.0\n"
        "\ndef fails_on_rank_3(prompt, response, row):\n"
        "    if os.environ['RANK'] == '3':\n        raise KeyError('target_digit')\n    return 0.0\n"
    )
    return root


MISTAKES = {
    "no model dir": (["model.path=/nonexistent/model"], "syncwise: error: model.path: /nonexistent/model is not a "
                     "directory"),
    "model dir without config": (["model.path={root}/empty_model"], "syncwise: error: model.path: {root}/empty_model "
                                 "has no config.json"),
    "bad jsonl line": (["rl.dataset={root}/bad.jsonl", "rl.reward_fn=rewards:flaky"],
                       "syncwise: error: rl.dataset: {root}/bad.jsonl line 2 is not JSON"),
    "row without prompt": (["rl.dataset={root}/noprompt.jsonl", "rl.reward_fn=rewards:flaky"],
                           "syncwise: error: rl.dataset: {root}/noprompt.jsonl line 3 has no 'prompt'"),
    "dataset without reward": (["rl.dataset={root}/noprompt.jsonl"],
                               "syncwise: config error: rl.dataset needs rl.reward_fn"),
    "reward does not import": (["rl.reward_fn=rewards:nothere"],
                               "syncwise: error: rl.reward_fn: cannot import 'rewards:nothere'"),
    "missing checkpoint": (["train.resume={root}/nowhere"],
                           "syncwise: error: train.resume: checkpoint directory not found: {root}/nowhere"),
    "old flat key": (["rl.clip_high=0.3"], "syncwise: config error: 'rl.clip_high' is now 'rl.loss.clip_high'"),
    "lora target the model lacks": (["model.lora.rank=4", "model.lora.target_modules=qkv"],
                                    "syncwise: error: model.lora.target_modules='qkv': Target modules {{'qkv'}} not "
                                    "found in the base model"),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_mistakes_are_one_line_before_any_rank_starts(files, case):
    """In this process (cli_harness), but the first case, which runs as a user runs it: a process of its own."""
    args, expected = MISTAKES[case]
    args = ["train", *(a.format(root=files) for a in args), f"train.out_dir={files / 'out'}"]
    proc = _run(args, cwd=files, path=files) if case == next(iter(MISTAKES)) else run_cli(args, cwd=files, path=files)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], "one line"
    assert proc.stderr.startswith(expected.format(root=files)), proc.stderr
    assert "GRPO on" not in proc.stdout, "no rank started"


def test_error_on_rank_1_is_reported_once_in_two_lines(files):
    """The reward function fails on rank 1 only: the launcher prints that root cause (not rank 0's
    consequence), names the key, and shows the traceback only when asked."""
    args = ["train", "rl.reward_fn=rewards:flaky", f"train.out_dir={files / 'out_flaky'}", *QUICK]
    proc = _run(args, cwd=files, path=files)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("syncwise: error: rl.reward_fn: raised KeyError: 'target_digit' (prompt 'target")
    assert lines[1:] == ["syncwise: raised on rank 1 of 2; rerun with SYNCWISE_DEBUG=1 (or syncwise --debug) for "
                         "the traceback"]
    debug = _run(["--debug", *args], cwd=files, path=files)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "rewards.py" in debug.stderr and "KeyError" in debug.stderr


def test_an_error_on_a_rollout_rank_ends_the_job_in_two_lines_naming_it(files):
    """Issue 48: with rollout ranks the reward runs where the samples are drawn; it fails on the last one (rank 3
    of 4, a rollout rank): the job ends -- the trainers waiting for its batch are not left hanging -- with that
    root cause, the rank named by its role."""
    args = ["train", "rl.reward_fn=rewards:fails_on_rank_3", f"train.out_dir={files / 'out_rollout'}", *QUICK,
            *ROLLOUT_RANKS]
    proc = _run(args, cwd=files, path=files)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("syncwise: error: rollout rank 3 (of ranks 2-3): rl.reward_fn: raised KeyError: "
                               "'target_digit'"), lines
    assert lines[1:] == ["syncwise: raised on rank 3 of 4; rerun with SYNCWISE_DEBUG=1 (or syncwise --debug) for "
                         "the traceback"]


def test_error_report_names_the_checkpoint_file(tmp_path):
    """An error only a rank can find (a truncated checkpoint shard): one report, the file named."""
    out = tmp_path / "run"
    first = subprocess.run(_train(out, "train.steps=2", "train.checkpoint_every=2"), env=ENV,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, failed(first.stderr, 3000)
    shard = next((out / "checkpoints" / "step_000002" / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    proc = subprocess.run(_train(out, "train.resume=auto"), env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"syncwise: error: {out / 'checkpoints' / 'step_000002' / 'dcp'}: cannot load"), lines


def test_ctrl_c_during_the_warm_start_stops_without_a_checkpoint(tmp_path):
    """rl.warm_start_steps: a stop request is agreed at the next supervised step; nothing is saved yet, and
    the line says so (exit 130, no traceback, no process left)."""
    out = tmp_path / "run"
    job = _start(_train(out, "rl.task=repeat", "rl.warm_start_steps=100000"))
    while "syncwise train: GRPO on" not in job.stdout.readline():  # set-up done; the warm start follows
        assert job.poll() is None, job.communicate()
    ranks = set(child_pids(job.pid, descendants=True))
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 130, stderr[-3000:]
    assert re.search(r"syncwise: stopped by SIGINT after step 0 of 200; during warm-start step \d+ of 100000; "
                     r"nothing saved", stdout), stdout
    assert "Traceback" not in stderr and not (out / "checkpoints" / "latest").exists()
    _assert_all_gone(ranks)
