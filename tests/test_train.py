"""`syncwise train` (GRPO) as a user runs it: on 2 local ranks, checkpoints and resume, resharding to 1
rank, Hugging Face export, TensorBoard logs, and a two-node torchrun launch on loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_harness import run_cli
from job_output import failed
from syncwise.config import load_config, packaged_config
from syncwise.metrics import read_jsonl
from syncwise.models.checkpoint_files import read_safetensors
from syncwise.runtime.job_store import free_port

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
SHORT = ["train.progress=false", "rl.prompts_per_rank=4", "rl.samples_per_prompt=4", "optim.warmup_steps=0"]


def _train(out: Path, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "syncwise", "train", f"train.out_dir={out}", f"dist.nproc={nproc}", *SHORT,
         *overrides],
        env=ENV, capture_output=True, text=True, timeout=900,
    )
    if proc.returncode:  # the whole of it beside the job's folder (a rank's fault dump runs to many lines)
        (out.parent / f"{out.name}.stderr.txt").write_text(proc.stderr)
    assert proc.returncode == 0, proc.stdout[-2000:] + failed(proc.stderr, 4000)
    return proc


def _weights(export: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(export)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted 6 steps; the same job stopped after 3 and resumed to 6; the 3-step checkpoint of the
    2-rank run loaded on 1 rank."""
    root = tmp_path_factory.mktemp("grpo")
    full = _train(root / "full", "train.steps=6", "train.checkpoint_every=3", "train.logger=tensorboard")
    _train(root / "split", "train.steps=3", "train.checkpoint_every=3")
    shutil.copytree(root / "split" / "export", root / "export_at_3")  # the 2-rank parameters at step 3
    resumed = _train(root / "split", "train.steps=6", "train.checkpoint_every=3", "train.resume=auto")
    one_rank = _train(
        root / "one", "train.steps=3", f"train.resume={root / 'split' / 'checkpoints' / 'step_000003'}", nproc=1,
    )
    return {"root": root, "full": full, "resumed": resumed, "one_rank": one_rank}


def test_grpo_run_writes_metrics_plot_and_tensorboard(runs):
    out = runs["root"] / "full"
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["train/step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert 0.0 <= r["reward/mean"] <= 1.0 and torch.isfinite(torch.tensor(r["loss"]))
        # 4 prompts x 4 samples of a few tokens: auto's cap (2048 tokens on CPU) holds them in one micro-batch
        # after the first step, which splits at each rank's longest sequence while auto measures
        assert r["train/num_microbatches"] == 1 or r["train/step"] == 1
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert r[f"comm/{kind}_count"] == r[f"comm/expected_{kind}_count"], (r["train/step"], kind)
    assert rows[0]["sync/mode"] == "per_microbatch" and rows[1]["sync/mode"] == "deferred_unsharded"
    assert (out / "curves.png").stat().st_size > 10_000
    assert (out / "phases.png").stat().st_size > 10_000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_every_step_says_where_its_time_went(runs):
    """Disjoint phases of the step (weight refresh, sampling, rewards, reference and old log-probs, the
    update) and the real tokens per second of sampling and of the update."""
    from syncwise.rl.stats import PHASES

    for r in read_jsonl(runs["root"] / "full" / "metrics.jsonl"):
        phases = [r[f"time/{phase}_s"] for phase in PHASES]
        assert all(seconds >= 0 for seconds in phases)
        assert r["time/rollout_s"] > 0 and r["time/update_s"] > 0
        # on-policy (one optimizer step per batch): the old log-probs are the update's own, no extra pass
        assert r["time/old_log_prob_s"] == 0 and r["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert r["time/ref_log_prob_s"] == 0  # no KL reference in this job
        assert sum(phases) <= r["time/step_s"]  # parts of the step, none counted twice
        assert r["rollout/response_tokens"] > 0
        assert r["perf/rollout_tokens_per_s"] == pytest.approx(r["rollout/response_tokens"] / r["time/rollout_s"])
        assert r["perf/update_tokens_per_s"] > 0
        # rl.balance_ranks (on by default): never worse than the batch as sampled
        assert r["batch/rank_token_imbalance_after"] <= r["batch/rank_token_imbalance_before"]
        assert 0 <= r["rollout/uniform_group_fraction"] <= 1
    assert "mean reward: first" in runs["full"].stdout


def test_checkpoints_are_complete_and_latest_points_to_the_newest(runs):
    ckpt = runs["root"] / "full" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step_000006"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000003", "step_000006"]
    assert (ckpt / "step_000006" / "trainer.json").is_file()
    assert {p.name for p in (ckpt / "step_000006").glob("rank*.pt")} == {"rank0.pt", "rank1.pt"}


def test_resumed_run_reproduces_the_uninterrupted_parameters_exactly(runs):
    assert "resumed from" in runs["resumed"].stdout
    full, resumed = _weights(runs["root"] / "full" / "export"), _weights(runs["root"] / "split" / "export")
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    rows = read_jsonl(runs["root"] / "split" / "metrics.jsonl")
    assert [r["train/step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    reference = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in reference]
    # the sampler's random state came back with the checkpoint: the same responses, step for step
    assert [r["rollout/response_tokens"] for r in rows] == [r["rollout/response_tokens"] for r in reference]
    # the resumed run summarises the whole job from metrics.jsonl, not its own 3 steps
    summary = [line for line in runs["resumed"].stdout.splitlines() if line.startswith("mean reward:")]
    want = [line for line in runs["full"].stdout.splitlines() if line.startswith("mean reward:")]
    assert summary[0].split(";")[0] == want[0].split(";")[0] and "first 6 steps" in summary[0]


def test_job_history_keeps_the_last_row_of_each_step(tmp_path):
    from syncwise.metrics import job_history

    log = tmp_path / "metrics.jsonl"
    steps = [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1)]  # a run logged 3 steps, was resumed from step 1
    log.write_text("\n".join(json.dumps({"train/step": s, "v": v}) for s, v in steps))
    assert [(r["train/step"], r["v"]) for r in job_history(log)] == [(1, 0), (2, 1), (3, 1)]


def test_a_fresh_run_in_a_used_folder_starts_its_own_log(runs, tmp_path):
    """Issue 38 (6): a run that does not resume, in the folder of a 6-step job, logs, plots and summarises its
    own 2 steps; the earlier log (and TensorBoard folder) is set aside, not lost. A run resumed from an
    earlier checkpoint keeps the rows up to it and replaces the rest."""
    used = tmp_path / "used"
    shutil.copytree(runs["root"] / "full", used)
    proc = _train(used, "train.steps=2", "train.logger=tensorboard")
    assert [r["train/step"] for r in read_jsonl(used / "metrics.jsonl")] == [1, 2]
    assert [r["train/step"] for r in read_jsonl(used / "metrics.old-1.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert (used / "tensorboard.old-1").is_dir() and (used / "tensorboard").is_dir()
    assert "an earlier run's log in this folder moved to metrics.old-1.jsonl" in proc.stdout
    assert "mean reward: first 2 steps" in proc.stdout
    again = tmp_path / "again"
    shutil.copytree(runs["root"] / "full", again)
    _train(again, "train.steps=4", f"train.resume={again / 'checkpoints' / 'step_000003'}")
    rows = read_jsonl(again / "metrics.jsonl")
    assert [r["train/step"] for r in rows] == [1, 2, 3, 4]
    assert rows[:3] == read_jsonl(runs["root"] / "full" / "metrics.jsonl")[:3]


@pytest.mark.parametrize(("strategy", "mode"), [("fsdp2", "per_microbatch"), ("fsdp1", "per_microbatch"),
                                                ("fsdp1", "deferred")])
def test_resume_runs_the_configured_sync_mode_and_fsdp1_exports(runs, tmp_path, strategy, mode):
    """The checkpoint of an auto run (which chose deferred_unsharded) resumed with an explicit sync.mode, on
    FSDP2 and on FSDP1 (which cannot run deferred_unsharded): the configured mode runs, and FSDP1's export
    at the end of the job loads."""
    from transformers import AutoModelForCausalLM

    auto_rows = read_jsonl(runs["root"] / "split" / "metrics.jsonl")
    assert auto_rows[2]["sync/mode"] == "deferred_unsharded"
    checkpoint = runs["root"] / "split" / "checkpoints" / "step_000003"
    _train(tmp_path, "train.steps=4", f"train.resume={checkpoint}", f"engine.strategy={strategy}",
           f"sync.mode={mode}")
    assert [r["sync/mode"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [mode]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_two_rank_checkpoint_loads_on_one_rank(runs):
    """DCP reshards: the 2-rank step-3 checkpoint, loaded by a 1-rank job, holds the same parameters."""
    assert "fsdp2 on 1 rank(s)" in runs["one_rank"].stdout
    loaded, saved = _weights(runs["root"] / "one" / "export"), _weights(runs["root"] / "export_at_3")
    assert loaded.keys() == saved.keys()
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name


def test_export_loads_with_from_pretrained(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = runs["root"] / "full" / "export"
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    ids = tokenizer("target 3 :", return_tensors="pt")
    assert model(**ids).logits.shape == (1, 3, len(tokenizer))
    # issue 68 (9): a generation_config from the tokenizer's end token, so that generate() stops there
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id is not None
    weights = _weights(export)
    for name, param in model.state_dict().items():
        if name in weights:
            assert torch.equal(param, weights[name])


def test_trainer_sees_what_the_sampler_saw_at_any_temperature(runs, tmp_path):
    """The sampler's per-token log-probs against the trainer's before any update: at T = 1 (the runs
    above) and T = 0.6 within 1e-3 on CPU fp32 -- the training side divides the logits by the same T."""
    rows = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    _train(tmp_path / "cold", "train.steps=3", "train.checkpoint_every=0", "train.export=false", "rl.temperature=0.6")
    cold = read_jsonl(tmp_path / "cold" / "metrics.jsonl")
    for r in rows + cold:
        assert r["rollout/log_prob_diff"] <= 1e-3 and r["rollout/log_prob_diff_max"] < 1e-2, r["train/step"]
        assert r["train/optimizer_steps"] == 1 and r["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_mini_batches_and_epochs_learn_and_move_the_ratio(tmp_path):
    """4 mini-batches x 2 epochs: 8 optimizer steps per rollout batch against old log-probs taken before
    the first; the ratio leaves 1, clipping acts, and the reward still rises."""
    _train(tmp_path / "ppo", "train.steps=20", "train.checkpoint_every=0", "train.export=false",
           "rl.prompts_per_rank=8", "rl.samples_per_prompt=8", "rl.mini_batches=4", "rl.epochs=2",
           "optim.lr=1e-3")
    rows = read_jsonl(tmp_path / "ppo" / "metrics.jsonl")
    assert all(r["train/optimizer_steps"] == 8 for r in rows)
    assert all(r["time/old_log_prob_s"] > 0 for r in rows)  # several steps per batch: the old pass runs
    assert rows[-1]["train/step"] == 20 and max(r["actor/ratio_max"] for r in rows) > 1.2
    assert any(abs(r["actor/ratio_mean"] - 1.0) > 1e-3 for r in rows)
    assert any(r["actor/clip_fraction"] > 0 for r in rows) and all(r["actor/approx_kl"] >= 0 for r in rows)
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


def test_resume_is_exact_with_mini_batches(tmp_path):
    common = ["train.checkpoint_every=2", "rl.mini_batches=2", "rl.epochs=2"]
    _train(tmp_path / "full", "train.steps=4", *common)
    _train(tmp_path / "split", "train.steps=2", *common)
    _train(tmp_path / "split", "train.steps=4", "train.resume=auto", *common)
    full, resumed = _weights(tmp_path / "full" / "export"), _weights(tmp_path / "split" / "export")
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


LEARN = ["train.steps=30", "train.export=false", "rl.prompts_per_rank=8", "rl.samples_per_prompt=8",
         "optim.warmup_steps=5"]


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A reduced budget of the default job: 30 steps, synchronous."""
    out = tmp_path_factory.mktemp("learn")
    _train(out, "train.checkpoint_every=0", *LEARN)
    return read_jsonl(out / "metrics.jsonl")


def _mean_rise(rows: list[dict]) -> tuple[float, float]:
    rewards = [r["reward/mean"] for r in rows]
    return sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10


def test_reward_rises_on_the_default_task(learned):
    """Seeded; measured 0.385 -> 0.798 when written."""
    first, last = _mean_rise(learned)
    assert last > first + 0.2, (first, last)


def _deterministic(row: dict) -> dict:
    """A step's metrics less those that measure the machine (seconds, rates, the memory budget)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "memory/budget", "memory/predicted", "perf/"))
            and k != "train/step_time_s"}


@pytest.fixture(scope="module")
def lagged(tmp_path_factory):
    """The default job's reduced budget with rl.off_policy_lag=2, colocated: its first line and metrics."""
    out = tmp_path_factory.mktemp("lagged")
    proc = _train(out, "train.checkpoint_every=24", "rl.off_policy_lag=2", *LEARN)
    return proc.stdout, read_jsonl(out / "metrics.jsonl"), out


def test_an_off_policy_job_learns_from_lagged_samples_and_resumes_exactly(learned, lagged, tmp_path):
    """Issue 48: rl.off_policy_lag=2 -- step t trains on its own prompts drawn by the policy of step t - 2
    (the first two steps' by the initial policy's), with the decoupled loss (rl.loss.off_policy=auto). The
    first step is the synchronous job's (nothing is stale yet); staleness is min(t, 2) every step; the reward
    rises as the synchronous job's does (measured 0.31 -> 0.79 when written); a job resumed from step 24's
    checkpoint -- which holds each rank's two batches drawn ahead -- gives the uninterrupted job's steps 25-30
    metric for metric."""
    stdout, rows, out = lagged
    assert "off-policy: step t trains on samples drawn by the policy of step t - 2" in stdout
    assert "rl.loss.off_policy=decoupled" in stdout
    assert [r["rollout/staleness_max"] for r in rows] == [min(t, 2) for t in range(30)]
    assert all(r["rollout/dropped_stale"] == 0 for r in rows)
    for key in ("reward/mean", "response/length_mean", "rollout/response_tokens"):
        assert rows[0][key] == learned[0][key], key  # the same samples: step 0's prompts by the initial policy
    assert rows[0]["loss"] == pytest.approx(learned[0]["loss"], rel=1e-5, abs=1e-7)
    assert rows[0]["rollout/behavior_out_of_band"] == 0 and rows[0]["rollout/mismatch_kl"] < 1e-6
    assert max(r["rollout/behavior_out_of_band"] for r in rows[2:]) > 0  # stale: the weights act
    first, last = _mean_rise(rows)
    assert last > first + 0.2, (first, last)
    _assert_resumes_exactly(rows, out, tmp_path / "resumed", "rl.off_policy_lag=2")


def _assert_resumes_exactly(rows: list[dict], out: Path, resumed: Path, *overrides: str) -> None:
    """The job of ``out`` (``rows``, 30 steps of LEARN) resumed from its step-24 checkpoint with ``overrides``:
    steps 25-30 equal the uninterrupted job's, metric for metric."""
    _train(resumed, "train.checkpoint_every=0", f"train.resume={out / 'checkpoints' / 'step_000024'}", *overrides,
           *LEARN)
    again = read_jsonl(resumed / "metrics.jsonl")
    assert [r["train/step"] for r in again] == list(range(25, 31))
    for want, got in zip(rows[24:], again, strict=True):
        assert _deterministic(got) == _deterministic(want), want["train/step"]


ROLLOUT_RANKS = ["dist.rollout_ranks=2", "rl.off_policy_lag=2"]


def _across_roles(row: dict) -> dict:
    """What a job with rollout ranks and the colocated job share: all but the machine's measures, the memory
    budget (split over 4 processes, not 2) and what only the rollout ranks' job reports. The step's measured
    peak is compared apart (:func:`_same_peak`)."""
    return {k: v for k, v in _deterministic(row).items()
            if k not in ("sync/decision", "memory/peak_bytes") and not k.startswith(("rollout_rank/", "weights/"))}


def _same_peak(got: dict, want: dict) -> None:
    """The tracker's peak of a step, within 2%: a clean-clone CI run measured step 1 at 6,149,464 B with rollout
    ranks against 6,220,307 B colocated (1.1%), the same job alone equal -- a race in what the CPU tracker still
    counts, as the meter's notes on gloo's buffers describe, not a difference in the batches."""
    assert got["memory/peak_bytes"] == pytest.approx(want["memory/peak_bytes"], rel=0.02), got["train/step"]


def test_rollout_ranks_train_on_the_colocated_jobs_batches_and_resume_exactly(lagged, tmp_path):
    """Issue 48: dist.nproc=4 dist.rollout_ranks=2 -- two ranks train, two only sample, each serving one trainer
    with the prompts and seeds the trainer's own queue would use, by the weights trainer 0 sends after each step.
    The 30 steps equal the colocated job's with the same lag, metric for metric; the rollout ranks' seconds and
    the weights' bytes are logged (each step the whole model, no unit larger than the largest wrapping unit);
    resumed from its step-24 checkpoint (the trainers fetch the batches drawn ahead into it) the job gives the
    uninterrupted steps 25-30."""
    _, colocated, _ = lagged
    out = tmp_path / "roles"
    proc = _train(out, "train.checkpoint_every=24", *ROLLOUT_RANKS, *LEARN, nproc=4)
    assert "fsdp2 on 2 rank(s)" in proc.stdout
    assert "rollouts by 2 rollout rank(s) of their own (ranks 2-3, compact" in proc.stdout
    rows = read_jsonl(out / "metrics.jsonl")
    for want, got in zip(colocated, rows, strict=True):
        assert _across_roles(got) == _across_roles(want), want["train/step"]
        _same_peak(got, want)
    sent = {r["weights/bytes"] for r in rows}
    assert len(sent) == 1 and 0 < max(r["weights/largest_unit_bytes"] for r in rows) < sent.pop()
    assert all(r["rollout_rank/sample_s"] > 0 and r["time/rollout_s"] == 0 for r in rows)
    resumed = tmp_path / "resumed"
    _train(resumed, "train.checkpoint_every=0", f"train.resume={out / 'checkpoints' / 'step_000024'}",
           *ROLLOUT_RANKS, *LEARN, nproc=4)
    for want, got in zip(rows[24:], read_jsonl(resumed / "metrics.jsonl"), strict=True):
        assert _across_roles(got) == _across_roles(want), want["train/step"]
        _same_peak(got, want)


def test_rollout_ranks_drawing_on_learn_within_their_staleness_and_checkpoint_every_sample(learned, tmp_path):
    """Issue 48: dist.nproc=4 dist.rollout_ranks=2 rl.max_staleness=2 -- the rollout ranks draw partial rollouts
    on, taking each new policy between two rounds, and wait only at the bound. Not deterministic (which round
    takes which version is timing), so what must hold whatever the timing: every trained sample started at most
    two versions before its step; the reward rises as the synchronous job's does; step 24's checkpoint accounts
    for every prompt the rollout ranks took -- trained, posted ahead (in the trainer's queue), in flight (the
    conversations, their indices distinct) or dropped for age and counted (by a step's metrics, or by the step
    under way); resumed from it colocated, the batches posted ahead train first (step 25 then equals the
    uninterrupted job's) and the job goes on within the bound."""
    out, drawing_on = tmp_path / "drawing_on", ["dist.rollout_ranks=2", "rl.max_staleness=2"]
    proc = _train(out, "train.checkpoint_every=24", *drawing_on, *LEARN, nproc=4)
    assert "rollouts by 2 rollout rank(s) of their own (ranks 2-3, compact, drawing on" in proc.stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(0 <= r["rollout/staleness_max"] <= 2 for r in rows) and rows[0]["rollout/staleness_max"] == 0
    assert all(r["rollout_rank/sample_s"] > 0 and r["weights/bytes"] > 0 for r in rows)
    first, last = _mean_rise(rows)
    assert last > first + 0.2, (first, last, _mean_rise(learned))
    per_prompt, per_step = 8, 8  # LEARN's samples per prompt and prompts per rank
    unaccounted, dropped, posted = 0, sum(r["rollout/dropped_stale"] for r in rows[:24]), []
    for rank in (0, 1):
        held = torch.load(out / "checkpoints" / "step_000024" / f"rank{rank}.pt", weights_only=True)["rank_state"]
        queue, pool = held["rollout_queue"], held["partial_rollouts"]
        assert [b["step"] for b in queue["ready"]] == list(range(24, queue["next_step"]))
        indices, posted = [g["index"] for g in pool["groups"]], [*posted, queue["next_step"]]
        assert len(set(indices)) == len(indices) and all(i < pool["admitted"] for i in indices)
        unaccounted += pool["admitted"] - queue["next_step"] * per_step - len(indices)
        dropped += sum(b["decode"]["dropped"] for b in queue["ready"]) + pool["under_way"]["dropped"]
    assert unaccounted * per_prompt == dropped, (unaccounted, dropped)
    # resumed colocated (2 ranks, the same trainers): the batches posted ahead train first, then its own pool
    resumed = tmp_path / "resumed"
    proc = _train(resumed, "train.checkpoint_every=0", f"train.resume={out / 'checkpoints' / 'step_000024'}",
                  "rl.max_staleness=2", *LEARN)
    assert "holds no partial rollouts" not in proc.stdout
    again = read_jsonl(resumed / "metrics.jsonl")
    assert [r["train/step"] for r in again] == list(range(25, 31))
    assert all(r["rollout/staleness_max"] <= 2 for r in again)
    if min(posted) > 24:  # step 24's batches were posted before the checkpoint: the same step 25
        for key in ("reward/mean", "response/length_mean", "rollout/staleness_mean"):
            assert again[0][key] == rows[24][key], key
        assert again[0]["loss"] == pytest.approx(rows[24]["loss"], rel=1e-5, abs=1e-7)


def test_partial_rollouts_learn_within_their_staleness_and_resume_exactly(learned, tmp_path):
    """Issue 48: rl.max_staleness=2 -- each step samples rounds until its groups have finished, the rest carried
    under the next policy (the default task's responses are two tokens: rounds of one). Every trained sample
    started at most two versions before its step, some are stale, none is older; the reward rises as the
    synchronous job's does; a job resumed from step 24's checkpoint -- which holds each rank's groups in flight
    -- gives the uninterrupted job's steps 25-30 metric for metric."""
    partial = tmp_path / "partial"
    proc = _train(partial, "train.checkpoint_every=24", "rl.max_staleness=2", *LEARN)
    assert "partial rollouts carried across steps, each group started at most 2 version(s)" in proc.stdout
    assert "rl.loss.off_policy=decoupled" in proc.stdout
    rows = read_jsonl(partial / "metrics.jsonl")
    assert all(0 <= r["rollout/staleness_max"] <= 2 for r in rows)
    assert rows[0]["rollout/staleness_max"] == 0 and max(r["rollout/staleness_mean"] for r in rows) > 0
    assert all(r["rollout/drawn_tokens"] > 0 for r in rows)
    first, last = _mean_rise(rows)
    assert last > first + 0.2, (first, last)
    _assert_resumes_exactly(rows, partial, tmp_path / "resumed", "rl.max_staleness=2")


def test_a_synchronous_checkpoint_goes_on_off_policy(tmp_path):
    """A synchronous job's checkpoint (no rollouts drawn ahead) resumed with rl.off_policy_lag=1: the first line
    says the step ahead is drawn by the resumed policy; staleness 0, then 1."""
    _train(tmp_path, "train.steps=1")
    proc = _train(tmp_path, "train.steps=3", "train.resume=auto", "rl.off_policy_lag=1")
    assert "the checkpoint holds no rollouts drawn ahead for 2 rank(s): step 2 drawn by the resumed" in proc.stdout
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r.get("rollout/staleness_max") for r in rows] == [None, 0, 1]


def test_skipping_uniform_groups_counts_them_and_still_learns(tmp_path):
    """rl.skip_uniform_groups: groups with one reward for all samples are counted and left out; the job
    trains on the rest (with fewer samples per update) and the reward still rises."""
    _train(tmp_path / "skip", "train.steps=30", "train.checkpoint_every=0", "train.export=false",
           "rl.prompts_per_rank=8", "rl.samples_per_prompt=8", "optim.warmup_steps=5", "rl.skip_uniform_groups=true")
    rows = read_jsonl(tmp_path / "skip" / "metrics.jsonl")
    assert any(r["rollout/uniform_group_fraction"] > 0 for r in rows)
    sampled = 2 * 8 * 8
    for r in rows:  # every group with signal trains, the others do not
        uniform = round(r["rollout/uniform_group_fraction"] * sampled / 8)
        assert r["rollout/trained_samples"] == sampled - 8 * uniform or uniform == sampled // 8, r
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.2, rewards


def test_repeat_task_with_a_warm_start_runs_long_tailed_responses(tmp_path):
    """rl.task=repeat: the job runs its supervised warm start, then samples responses of many lengths
    (up to the task's 100 new tokens), balanced over the ranks; with partial rollouts the decode batch stays
    fuller."""
    job = ["rl.task=repeat", "rl.warm_start_steps=3", "train.steps=3", "train.checkpoint_every=0",
           "train.export=false"]
    proc = _train(tmp_path / "repeat", *job)
    assert "warm start: 3 supervised steps on the task's answers" in proc.stdout
    rows = read_jsonl(tmp_path / "repeat" / "metrics.jsonl")
    assert [r["train/step"] for r in rows] == [1, 2, 3]
    assert all(r["response/length_mean"] > 3 for r in rows)  # the target task's are 2 at most
    # a decode batch run to each rank's longest response is mostly idle at the tail
    fills = [r["rollout/decode_fill"] for r in rows]
    assert all(0.05 < fill < 0.9 for fill in fills), fills
    assert all(r["batch/rank_token_imbalance_after"] <= r["batch/rank_token_imbalance_before"] for r in rows)
    # partial rollouts (issue 48): the tail is carried to the next step in rounds, new prompts join -- fuller
    _train(tmp_path / "partial", *job, "rl.max_staleness=1")
    partial = [r["rollout/decode_fill"] for r in read_jsonl(tmp_path / "partial" / "metrics.jsonl")]
    assert sum(partial) / 3 > sum(fills) / 3 + 0.1, (partial, fills)


def test_bf16_rollout_copy_differs_from_the_trainer_and_the_correction_sees_it(tmp_path):
    """rl.rollout_dtype=bfloat16: the sampler's log-probs differ from the fp32 trainer's by about bf16's
    resolution (fp32: < 1e-6, test above), and the token-level importance weights move off 1. The copy's
    bytes come off auto's budget (the CPU tracker does not see them)."""
    _train(tmp_path / "bf16", "rl.rollout_dtype=bfloat16", "rl.loss.rollout_is=token", "train.steps=2",
           "train.checkpoint_every=0", "train.export=false", "sync.memory_budget=1000000000")
    from transformers import AutoModelForCausalLM

    from syncwise.models import preset_config
    from syncwise.rl.env.tasks import load_tokenizer

    config = load_config(packaged_config("grpo.yaml"))
    hf_config = preset_config(config.model.preset, vocab_size=len(load_tokenizer(config)))
    copy = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)  # as the rollout builds it
    copy_bytes = sum(t.numel() * t.element_size() for t in (*copy.parameters(), *copy.buffers()))
    for r in read_jsonl(tmp_path / "bf16" / "metrics.jsonl"):
        assert 1e-5 < r["rollout/log_prob_diff"] < 0.05, r["rollout/log_prob_diff"]
        assert r["rollout/is_weight_max"] > 1.0 + 1e-4
        assert r["memory/budget_bytes"] == 1_000_000_000 - copy_bytes  # the copy comes off auto's CPU budget


def test_lora_grpo_resumes_exactly_with_the_base_model_as_kl_reference(tmp_path):
    """`syncwise train model.lora.rank=8` with a KL term: the reference is the base model (adapters off, no
    second engine), checkpoints hold the adapters only, a resumed run ends with the uninterrupted run's
    merged weights, and the adapter folder is exported beside them."""
    lora = ["model.lora.rank=8", "rl.loss.kl_coef=0.05", "train.checkpoint_every=2"]
    first = _train(tmp_path / "full", "train.steps=4", *lora)
    # the fused head steps aside for the adapter on lm_head: said once, as the reason, with no source line
    assert first.stderr.count("syncwise: warning: engine.fused_lm_head: a LoRA adapter sits on the output "
                              "layer") == 1, first.stderr
    assert "Engine(" not in first.stderr and "Warning" not in first.stderr
    _train(tmp_path / "split", "train.steps=2", *lora)
    _train(tmp_path / "split", "train.steps=4", "train.resume=auto", *lora)
    full, resumed = _weights(tmp_path / "full" / "export"), _weights(tmp_path / "split" / "export")
    assert full.keys() == resumed.keys() and not any("lora" in k for k in full)  # merged: a plain model
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    rows = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    assert all(r["time/ref_log_prob_s"] > 0 for r in rows)
    # the rollout copy runs the merged weights: it samples from the distribution the trainer scores
    assert all(r["rollout/log_prob_diff"] <= 1e-3 for r in rows)
    assert rows[-1]["actor/kl_loss"] > 0  # the adapters moved the policy away from its base
    assert (tmp_path / "full" / "export" / "adapter" / "adapter_model.safetensors").is_file()
    dcp = tmp_path / "full" / "checkpoints" / "step_000004" / "dcp"
    assert sum(f.stat().st_size for f in dcp.iterdir()) < 0.5 * 12 * sum(v.numel() for v in full.values())


def test_torchrun_two_nodes_on_loopback(tmp_path):
    """Two torchrun nodes of two processes: three trainers (two on node 0, one on node 1) and a rollout rank of
    its own on node 1 (dist.rollout_ranks=1, rl.off_policy_lag=1), which serves all three."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "syncwise", "train", f"train.out_dir={tmp_path / 'multi'}", "train.steps=3",
            "train.checkpoint_every=0", "train.export=false", "dist.rollout_ranks=1", "rl.off_policy_lag=1", *SHORT,
        ]
        procs.append(subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, stdout[-2000:] + failed(stderr, 4000)
    assert "fsdp2 on 3 rank(s)" in outputs[0][0] and "rollouts by 1 rollout rank(s) of their own" in outputs[0][0]
    rows = read_jsonl(tmp_path / "multi" / "metrics.jsonl")
    assert [r["train/step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_user_model_dataset_and_reward_function(tmp_path, fmt):
    """A local HF model directory with its tokenizer, a prompt file and a reward given as an import path."""
    import json

    from syncwise.config import ModelConfig
    from syncwise.models import build_model
    from syncwise.rl.env.tasks import builtin_tokenizer

    tokenizer = builtin_tokenizer()
    model_dir = tmp_path / "model"
    build_model(ModelConfig(preset="llama-grpo"), vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = [{"prompt": f"answer is {d} :", "wanted": str(d)} for d in range(10)]
    if fmt == "jsonl":
        data = tmp_path / "prompts.jsonl"
        data.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = tmp_path / "prompts.parquet"
        pq.write_table(pa.Table.from_pylist(rows), data)
    (tmp_path / "my_rewards.py").write_text(
        "def exact(prompt, response, row):\n    return float(response.split()[:1] == [row['wanted']])\n"
    )
    env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "syncwise", "train", f"model.path={model_dir}", f"rl.dataset={data}",
         "rl.reward_fn=my_rewards:exact", f"train.out_dir={tmp_path / 'out'}", "train.steps=2",
         "train.checkpoint_every=0", "train.export=false", *SHORT],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, failed(proc.stderr, 4000)
    assert f"GRPO on {data}" in proc.stdout
    rows_logged = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(rows_logged) == 2 and all(0.0 <= r["reward/mean"] <= 1.0 for r in rows_logged)


def test_bad_reward_function_is_a_clear_error(tmp_path):
    proc = run_cli(["train", "rl.reward_fn=no_such_module:f", f"train.out_dir={tmp_path}", "train.steps=1", *SHORT])
    assert proc.returncode == 2
    assert "rl.reward_fn: cannot import 'no_such_module:f'" in proc.stderr


def test_a_lagged_step_refreshes_once_draws_ahead_and_lets_the_engine_sleep_after_its_last_draw():
    """The off-policy step's call sequence (a recording rollout, the trainer's own queue logic): step 0 of a
    lag-2 job refreshes once, draws steps 0, 1, 2 and releases the engine (vLLM's sleep on CUDA) only after
    the last -- a sleeping engine cannot sample; later steps draw one batch each; the last steps none."""
    from types import SimpleNamespace

    from syncwise.rl.batches import DrawAhead
    from syncwise.rl.drawing import BatchDrawer
    from syncwise.rl.env.scoring import RewardLogs
    from syncwise.rl.stats import PhaseClock

    calls = []

    def generate(rows, prompt_ids, step, tools, release=True, version=None, seat=None):
        calls.append(("generate", step, release))
        return SimpleNamespace(batch={}, log_probs=None, response_lengths=None, clipped=None, kept_mass=None,
                               tool_counts=None, tool_s=0.0, trajectories=[], decode=None, agent=None)

    config = SimpleNamespace(rl=SimpleNamespace(prompts_per_rank=1), train=SimpleNamespace(log_completions_every=0))
    source = SimpleNamespace(batch_indices=lambda step, rank, world, count: [step], rows=list(range(9)),
                             prompt_ids=list(range(9)), encoded=SimpleNamespace(tools=[None] * 9))
    rollout = SimpleNamespace(sync_weights=lambda: calls.append("refresh"), generate=generate)
    drawer = BatchDrawer(config, (0, 1), rollout, source)
    drawer.score = lambda result, rows, step: (torch.zeros(1), {}, [], RewardLogs())
    batches = DrawAhead(drawer, lag=2, steps=5)
    versions = [batches.take(step, PhaseClock()).version for step in range(5)]
    assert versions == [0, 0, 0, 1, 2]  # step t's batch drawn by the policy of step max(t - 2, 0)
    assert calls == ["refresh", ("generate", 0, False), ("generate", 1, False), ("generate", 2, True),
                     "refresh", ("generate", 3, True), "refresh", ("generate", 4, True)]
