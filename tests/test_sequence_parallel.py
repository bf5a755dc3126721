"""Issue 78: Ulysses sequence parallelism (``dist.sequence_parallel``). On 2 gloo ranks (N = 2) and 4 (dp 2 x sp 2,
and N = 4 with a shard all padding), against one plain process on every rank's rows at once: per-token log-probs
(a critic's values), losses and every gradient equal within fp32 tolerance -- SFT, GRPO's clipped loss (token-mean,
seq-mean-token-sum, with an entropy bonus), GSPO and PPO's critic; packed rows crossing shard borders and lengths N
does not divide; a Llama with one key/value head; GPT-2's learned positions; a tied Qwen2 with LoRA, all saved with
``save_pretrained``; activation checkpointing. The all-to-alls are counted against the formula. Then the memory:
a 16k-token SFT sequence's measured peak at N = 2 against N = 1, and auto's choice; bad input in one line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from cli_harness import run_cli
from dist_harness import run_distributed
from numerics import assert_all_close, assert_close
from scenarios_ulysses import LENGTHS, resume_across_sizes, sequence_parallel_suite
from syncwise.config import load_config
from syncwise.engine.sequence_parallel import resolve_split
from syncwise.runtime.distributed import DistInfo
from user_models import save_model_dir

QWEN = "model.preset=qwen2-test"
PAIRS = {  # name -> (model, N, loss, extra keys); the model directories are filled in by the fixture
    "sft": (QWEN, 2, "sft:token-mean", ("engine.fused_lm_head=true",)),
    "grpo token-mean": (QWEN, 2, "ppo:token-mean", ("engine.fused_lm_head=true",)),
    "grpo seq-mean-token-sum": (QWEN, 2, "ppo:seq-mean-token-sum", ()),
    "gspo": (QWEN, 2, "gspo:seq-mean-token-mean", ()),
    "critic": (QWEN, 2, "value", ()),
    "gpt2": ("gpt2", 2, "sft:token-mean", ()),
    "llama one kv head": ("llama", 2, "ppo:token-mean", ()),
    "qwen2 tied lora": ("qwen2", 2, "sft:seq-mean-token-mean", ("model.lora.rank=4",)),
    "checkpointed, logits": (QWEN, 2, "sft:token-mean", ("engine.activation_checkpointing=true",
                                                         "engine.fused_lm_head=false")),
}
FOURS = {
    "dp2 x sp2 grpo": (QWEN, 2, "ppo:token-mean", ()),
    "dp2 x sp2 critic": (QWEN, 2, "value", ()),
    "sp4, one sequence a micro-batch": (QWEN, 4, "ppo:seq-mean-token-sum", ("engine.micro_batch_size=1",)),
}


def _with_dirs(cases: dict, dirs: dict) -> dict:
    return {name: (f"model.path={dirs[model]}" if model in dirs else model, size, kind, extra)
            for name, (model, size, kind, extra) in cases.items()}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"gpt2": save_model_dir(root, "gpt2"), "llama": save_model_dir(root, "llama", heads=2),
            "qwen2": save_model_dir(root, "qwen2")}


@pytest.fixture(scope="module")
def on_two(model_dirs):
    return run_distributed(sequence_parallel_suite, 2, _with_dirs(PAIRS, model_dirs))


@pytest.fixture(scope="module")
def on_four():
    return run_distributed(sequence_parallel_suite, 4, FOURS)


def _check_case(results: list, name: str) -> None:
    ranks, reference = len(results), results[0][name]["reference"]
    for rank in range(ranks):  # each rank's rows' log-probs (values), as one process computes them
        got, expected = results[rank][name]["values"], reference["values"][rank]
        width = min(got.shape[1], expected.shape[1])
        assert_close(got[:, :width], expected[:, :width], what=f"{name}: rank {rank}'s per-token values")
    total = sum(results[rank][name]["loss"] for rank in range(ranks))  # each rank reports its share
    assert total == pytest.approx(reference["loss"], rel=1e-5), name
    grads = results[0][name]["grads"]
    trained = [key for key, grad in reference["grads"].items() if grad is not None]
    assert trained, name
    for key in trained:
        assert_close(grads[key], reference["grads"][key], what=f"{name}: {key}")


@pytest.mark.parametrize("name", list(PAIRS))
def test_two_ranks_equal_one_process(on_two, name):
    _check_case(on_two, name)


@pytest.mark.parametrize("name", list(FOURS))
def test_four_ranks_equal_one_process(on_four, name):
    _check_case(on_four, name)


@pytest.mark.parametrize("name", ["sft", "checkpointed, logits"])
def test_all_to_alls_match_the_formula(on_two, name):
    """Per non-empty micro-batch: 2 exchanges a layer forward (q/k/v together, the output back), 2 backward, 2 more
    in backward's recomputation when checkpointed, and 1 for the loss's log-probs; FSDP's own collectives as
    without sequence parallelism (its audit raised nothing)."""
    r = on_two[0][name]
    per_microbatch = 2 * r["layers"] * (3 if "checkpointed" in name else 2) + 1
    assert r["counts"]["all_to_all"] == r["microbatches"] * per_microbatch
    assert r["microbatches"] == 2  # the group's 6 rows, 4 a micro-batch


def test_rows_cross_shard_borders():
    """The cases above pack rows whose sequences straddle the shard border: no length the sizes divide."""
    for lengths in LENGTHS:
        assert sum(lengths) % 2 or any(n % 2 for n in lengths)


def _sft(tmp_path, name: str, *keys: str) -> dict:
    out = tmp_path / name
    environ = {**os.environ, "HF_HUB_OFFLINE": "1"}
    environ.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-m", "syncwise", "sft", f"model.path={tmp_path / 'qwen2'}", "sft.task=progression",
         "sft.min_len=16000", "sft.max_len=16384", "sft.max_length=16384", "sft.steps=1", "sft.batch_size=2",
         "engine.micro_batch_size=1", "sft.export=false", "sft.progress=false", f"sft.out_dir={out}", *keys],
        cwd=tmp_path, capture_output=True, text=True, env=environ, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def test_long_sequence_peak_halves_and_auto_chooses_two(tmp_path):
    """A 16k-token SFT sequence: the job's own measured peak at N = 2 is at most 0.6x of N = 1's, the loss the same;
    with a budget that holds 3/4 of N = 1's peak, auto chooses N = 2 and says why (the job's first line)."""
    save_model_dir(tmp_path, "qwen2", positions=16500)
    one = _sft(tmp_path, "one", "dist.sequence_parallel=1")
    two = _sft(tmp_path, "two", "dist.sequence_parallel=2")
    assert two["batch/real_tokens"] == one["batch/real_tokens"] > 32000
    assert two["memory/peak_measured"] and one["memory/peak_measured"]
    assert two["memory/peak_bytes"] <= 0.6 * one["memory/peak_bytes"], (two["memory/peak_bytes"],
                                                                         one["memory/peak_bytes"])
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    # auto, as the job resolves it before building its engines, for a budget that holds 3/4 of N = 1's peak
    config = load_config(None, [f"model.path={tmp_path / 'qwen2'}", "dist.sequence_parallel=auto",
                                f"sync.memory_budget={int(0.75 * one['memory/peak_bytes'])}"])
    with contextlib.redirect_stdout(io.StringIO()) as said:
        resolve_split(config, DistInfo(0, 2, 0, torch.device("cpu")), int(one["batch/real_tokens"]) // 2)
    assert config.dist.sequence_parallel == 2
    assert "dist.sequence_parallel=auto: 2 (the fewest ranks per sequence" in said.getvalue()


@pytest.mark.parametrize(("keys", "says"), [
    (["dist.sequence_parallel=3"], "dist.sequence_parallel=3 does not divide the 2 ranks that train (dist.nproc)"),
    (["dist.sequence_parallel=0"], "dist.sequence_parallel: must be > 0, got 0"),
    (["dist.sequence_parallel=many"], "dist.sequence_parallel: a number of ranks (1: off) or auto, got 'many'"),
    (["dist.sequence_parallel=8", "dist.nproc=8"],
     "dist.sequence_parallel=8: Qwen2 cannot be split: its 4 attention heads are not a multiple of "
     "dist.sequence_parallel=8"),
    (["dist.sequence_parallel=2", "dist.nproc=4", "dist.rollout_ranks=1", "rl.off_policy_lag=1"],
     "dist.sequence_parallel=2 does not divide the 3 ranks that train (dist.nproc)"),
])
def test_bad_input_is_one_line_before_any_rank_starts(keys, says):
    result = run_cli(["train", "model.preset=qwen2-test", *keys])
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("keys", [(), ("dist.nproc=4", "dist.rollout_ranks=2", "rl.off_policy_lag=1")],
                         ids=["colocated", "rollout ranks"])
def test_grpo_job_trains_through_the_groups(tmp_path, keys):
    """The built-in GRPO task with dist.sequence_parallel=2, colocated and with rollout ranks of their own (the
    trainers, the default group among themselves, form the groups): rollouts, the old log-probs and the updates go
    through the groups (every step exchanges) and it trains. (The whole 200-step colocated demo learns as without it:
    mean reward 0.373 over the first 10 steps, 0.889 over the last 10, against the demo's 0.373 and 0.888.)"""
    environ = {**os.environ, "HF_HUB_OFFLINE": "1"}
    environ.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, "-m", "syncwise", "train", "dist.sequence_parallel=2", "train.steps=3",
                             "train.progress=false", "train.export=false", f"train.out_dir={tmp_path / 'job'}", *keys],
                            cwd=tmp_path, capture_output=True, text=True, env=environ, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dist.sequence_parallel=2: each packed row split across 2 consecutive ranks" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["comm/all_to_all_count"] > 0 and 0 <= row["reward/mean"] <= 1 for row in rows)
    assert rows[0]["train/grad_norm"] > 0


def test_a_checkpoint_resumes_with_another_size(tmp_path):
    """FSDP shards over every rank whatever N is, so a DCP checkpoint taken at N = 2 resumes at N = 1 where it
    stopped: after the next step, the parameters of a job that never stopped, at N = 1."""
    result = run_distributed(resume_across_sizes, 2, str(tmp_path))[0]
    assert result["steps"] == 2
    assert_all_close(result["resumed"], result["whole"], what="resumed at another N")


def test_a_groups_batches_that_do_not_join_raise_on_every_rank(on_two):
    """Rank 1 leaves out a key rank 0 gives: both raise a one-line error, none waits in a collective (the plan's
    all-reduce carries it)."""
    said = [on_two[rank]["keys that do not join"] for rank in range(2)]
    assert "differ from those of rank" in said[0] and "every rank must give the same keys" in said[0]
    assert "invalid on 1 other rank(s)" in said[1] or "differ from those of rank" in said[1]
