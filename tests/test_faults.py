"""Reliability on real gloo ranks: bad input, non-finite steps and a missing rank give clear errors on
every rank, never a hang, and lose nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dist_harness import run_distributed
from job_output import failed
from scenarios_faults import bad_input_suite, missing_rank, nonfinite_suite
from syncwise.models.checkpoint_files import read_safetensors

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}

EXPECTED = {
    "missing_key": "batch: needs key 'input_ids'",
    "shape_mismatch": "batch['loss_mask']: shape (6, 14) does not match input_ids (6, 16)",
    "length_mismatch": "batch['attention_mask']: first dimension (4,) does not match input_ids' batch size 6",
    "wrong_dtype": "batch['input_ids']: expected an integer dtype, got torch.float32",
    "float_mask": "batch['loss_mask']: expected an integer or bool mask, got torch.float32",
    "empty": "batch: is empty (0 samples)",
    "nan_advantages": "batch['advantages']: 1 non-finite value(s) (NaN or inf)",
}


@pytest.fixture(scope="module")
def bad_input():
    return run_distributed(bad_input_suite, 2)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bad_input_on_one_rank_is_a_clear_error_on_every_rank(bad_input, case):
    rank0, rank1 = (r["errors"][case] for r in bad_input)
    assert EXPECTED[case] in rank1
    assert rank0 == "batch: invalid on 1 other rank(s); see the error raised there"


def test_all_masked_batch_is_an_error_everywhere(bad_input):
    for r in bad_input:
        assert "leaves no target token on any rank" in r["errors"]["all_masked_everywhere"]


def test_bad_input_loses_nothing(bad_input):
    for r in bad_input:
        assert r["unchanged"], "no parameter moved"
        m = r["after"]
        assert m["train/skipped"] == 0 and m["train/step"] == 1
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert m[f"comm/{kind}_count"] == m[f"comm/expected_{kind}_count"]


def test_non_finite_step_is_skipped_and_counted():
    ranks = run_distributed(nonfinite_suite, 2)
    for r in ranks:
        assert r["skipped"]["train/skipped"] == 1 and r["skipped_steps"] == 1
        assert r["unchanged"] and r["grads_left"] == 0
        assert r["next"]["train/skipped"] == 0 and r["next"]["train/step"] == 1


def test_missing_rank_is_a_timeout_error_naming_rank_and_operation(tmp_path):
    rank0, rank1 = run_distributed(missing_rank, 2, str(tmp_path / "rank0_done"), timeout_s=4,
                                   clean_shutdown=False)
    assert rank0["error"] is not None
    assert rank0["error"].startswith(
        "rank 0: the all-reduce of batch statistics (start of the step) did not complete within "
        "dist.timeout_s=4s"
    )
    assert rank1["rank1_saw_rank0_fail"], "rank 1 stayed away until rank 0 had raised"


# A reward that holds both workers at the first rollout of step 4 (after the step-3 checkpoint) on
# torchrun's first attempt, until one of them is gone: the kill lands mid-run however slow the machine.
GATE_REWARD = """
import os, time
from pathlib import Path
from syncwise.models.checkpoint_files import read_safetensors
from syncwise.rl.env.tasks import TASKS

_score = TASKS["target"]().reward_fn
_calls = 0


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def reward(prompt, response, row):
    global _calls
    _calls += 1
    gate = os.environ.get("GATE_DIR")
    if gate and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and _calls == int(os.environ["GATE_AFTER"]) + 1:
        tmp = Path(gate) / f".rank{os.environ['RANK']}"
        tmp.write_text(str(os.getpid()))
        tmp.rename(Path(gate) / f"rank{os.environ['RANK']}")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            pids = [int(p.read_text()) for p in Path(gate).glob("rank*")]
            if len(pids) == 2 and not all(_alive(p) for p in pids):
                raise RuntimeError("the other worker is gone")
            time.sleep(0.05)
    return _score(prompt, response, row)
"""


def test_rank_killed_mid_run_restarts_from_latest_and_matches(tmp_path):
    """torchrun --max-restarts 1: SIGKILL one worker during step 4, after the step-3 checkpoint; the
    restarted job resumes from `latest` and ends with the parameters of an uninterrupted run."""
    (tmp_path / "gate_reward.py").write_text(GATE_REWARD)
    env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV.get('PYTHONPATH', '')}"}
    common = ["train.steps=8", "train.checkpoint_every=3", "train.resume=auto", "train.progress=false",
              "rl.prompts_per_rank=4", "rl.samples_per_prompt=4", "rl.reward_fn=gate_reward:reward"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    clean = subprocess.run(
        launcher + ["-m", "syncwise", "train", f"train.out_dir={tmp_path / 'clean'}", *common],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert clean.returncode == 0, failed(clean.stderr, 3000)

    out, gate = tmp_path / "killed", tmp_path / "gate"
    gate.mkdir()
    job = subprocess.Popen(
        launcher + ["--max-restarts", "1", "-m", "syncwise", "train", f"train.out_dir={out}", *common],
        env={**env, "GATE_DIR": str(gate), "GATE_AFTER": str(3 * 4 * 4)},  # 3 steps of 4 x 4 rewards
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 300
    while len(list(gate.glob("rank*"))) < 2 and time.monotonic() < deadline:
        assert job.poll() is None, job.communicate()
        time.sleep(0.02)
    assert (out / "checkpoints" / "step_000003").is_dir(), "held after the step-3 checkpoint"
    os.kill(int((gate / "rank1").read_text()), signal.SIGKILL)
    stdout, stderr = job.communicate(timeout=600)
    assert job.returncode == 0, failed(stderr, 3000)
    assert "resumed from" in stdout, "the restarted workers continued from a checkpoint"
    a = read_safetensors(tmp_path / "clean" / "export")
    b = read_safetensors(out / "export")
    for name in a:
        assert torch.equal(a[name], b[name]), name
