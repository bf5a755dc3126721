"""`syncwise plan` against bytes computed by hand for qwen2-test (P = 427,136 parameters: root 131,200
= embed 65,536 + lm_head 65,536 + norm 128; two decoder layers of 147,968; every dim 0 even)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli_harness import run_cli
from job_output import failed
from syncwise.memory.plan import PlanInput, format_plan, load_hf_config, make_plan
from syncwise.models import preset_config

P, ROOT = 427_136, 131_200
LAYERS = P - ROOT


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-test")
    preset_config("qwen2-test").save_pretrained(path)
    return path


def _plan(config_dir, **kw):
    inp = PlanInput(
        model=str(config_dir), world_size=2, microbatches=4, param_dtype="float32", reduce_dtype="float32",
        device_memory_gib=1.0, bandwidth_gbps=1.0, latency_us=0.0, **kw,
    )
    return make_plan(inp)


def test_plan_bytes_and_counts_by_hand(config_dir):
    plan = _plan(config_dir)
    assert (plan.num_params, plan.num_units) == (P, 3)
    shard = P // 2
    assert plan.base_bytes == shard * 4 + shard * 4 + shard * 8  # params, grads, AdamW (fp32, sharded)
    modes = {m.mode: m for m in plan.modes}
    assert list(modes) == ["deferred_unsharded", "deferred", "per_microbatch"]

    per_mb, deferred, unsharded = modes["per_microbatch"], modes["deferred"], modes["deferred_unsharded"]
    assert per_mb.retained_grad_bytes == 4 * P // 2 and per_mb.extra_bytes == 0
    assert deferred.retained_grad_bytes == 4 * P and deferred.extra_bytes == 4 * P // 2
    assert unsharded.unsharded_param_bytes == 4 * P and unsharded.extra_bytes == 4 * P // 2 + 4 * P

    assert per_mb.collectives == {"all_gather": 4 * 5, "reduce_scatter": 4 * 3, "all_reduce": 0}
    assert deferred.collectives == {"all_gather": 4 * 5, "reduce_scatter": 3, "all_reduce": 0}
    assert unsharded.collectives == {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 0}
    gathered_per_microbatch = (P + LAYERS) * 4  # every unit for forward, the layers again for backward
    assert per_mb.collective_bytes == {"all_gather": 4 * gathered_per_microbatch, "reduce_scatter": 4 * 4 * P,
                                       "all_reduce": 0}
    assert deferred.collective_bytes["reduce_scatter"] == 4 * P
    assert unsharded.collective_bytes["all_gather"] == 4 * P
    # Ring, alpha = 0, 1 GB/s: (g - 1) / g of the bytes cross each link.
    assert per_mb.comm_time_s == pytest.approx((4 * gathered_per_microbatch + 16 * P) / 2 / 1e9)
    assert deferred.comm_time_s == pytest.approx((4 * gathered_per_microbatch + 4 * P) / 2 / 1e9)


def test_plan_auto_choice_follows_budget(config_dir):
    base = (P // 2) * 16
    for budget, expected in [
        (base + 4 * P // 2 + 4 * P, "deferred_unsharded"),
        (base + 4 * P // 2, "deferred"),
        (base + 1, "per_microbatch"),
    ]:
        plan = _plan(config_dir, budget_fraction=budget / 2**30)
        assert plan.auto_choice == expected, (budget, plan.auto_reason)
        assert {m.mode: m.fits for m in plan.modes}[expected]


def test_plan_hsdp_replica_deferred(config_dir):
    inp = PlanInput(model=str(config_dir), world_size=4, replicas=2, microbatches=4, param_dtype="float32",
                    device_memory_gib=1.0, bandwidth_gbps=1.0, latency_us=0.0)
    modes = {m.mode: m for m in make_plan(inp).modes}
    replica = modes["replica_deferred"]
    assert replica.collectives == {"all_gather": 20, "reduce_scatter": 12, "all_reduce": 3}
    assert replica.collective_bytes["all_reduce"] == 4 * P // 2  # the shard each replica group all-reduces
    assert replica.extra_bytes == 0
    assert modes["per_microbatch"].collectives["all_reduce"] == 12


def test_builtin_shapes_have_their_published_sizes():
    from syncwise.memory.plan import sharded_model_for

    sizes = {"qwen3-4b": 4.022e9, "llama-3-8b": 8.030e9, "qwen2.5-7b": 7.616e9, "llama-3.2-1b": 1.236e9}
    for name, params in sizes.items():
        model = sharded_model_for(load_hf_config(name), 8, "bfloat16", "float32")
        assert model.num_params == pytest.approx(params, rel=2e-3), name


def test_a_mixture_of_experts_plan_counts_every_expert_held_and_the_active_ones_apart():
    """Qwen3-30B-A3B (its model card: 30.5B parameters, 3.3B activated): every expert is held, trained and
    sharded; a token uses 8 of each layer's 128."""
    plan = make_plan(PlanInput("qwen3-30b-a3b", world_size=8, microbatches=4))
    assert plan.num_params == 30_532_122_624 and plan.trainable_params == plan.num_params
    assert plan.active_params == plan.num_params - 48 * 120 * 3 * 768 * 2048  # 120 of 128 experts idle a token
    assert "30.532B parameters (3.353B active a token: a mixture of experts)" in format_plan(plan)


def test_plan_command(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "syncwise", "plan", "qwen3-4b", "--world-size", "8",
                         "--device-memory-gib", "64"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "qwen3-4b: 4.022B parameters in 37 FSDP units" in ok.stdout
    assert "auto would choose:" in ok.stdout
    bad = run_cli(["plan", "gpt-17"])
    assert bad.returncode == 2 and "not a built-in shape" in bad.stderr


@pytest.mark.parametrize("world_size", [2, 4])
def test_predicted_peak_within_10_percent_of_the_engines_measured_peak(world_size):
    """Parameters, gradients, AdamW, activations from the shapes (with and without checkpointing) and what
    FSDP2 has in flight: the plan's per_microbatch peak against the engine's, measured by the tracker."""
    from dist_harness import run_distributed
    from scenarios_plan import MICROBATCHES, measured_peaks

    for row in run_distributed(measured_peaks, world_size)[0]:
        preset, seq_len, size, checkpointing, fused = row["shape"]
        plan = make_plan(PlanInput(model=preset, world_size=world_size, microbatches=MICROBATCHES,
                                   param_dtype="float32", reduce_dtype="float32", seq_len=seq_len,
                                   micro_batch_size=size, activation_checkpointing=checkpointing,
                                   fused_lm_head=fused),
                         hf_config=preset_config(preset))
        predicted = next(m for m in plan.modes if m.mode == "per_microbatch").peak_bytes
        assert predicted == pytest.approx(row["peak"], rel=0.10), (row["shape"], predicted, row["peak"])


def test_plan_picks_partial_when_full_deferral_does_not_fit():
    """The worked example of docs/perf_tuning.md: Qwen3-4B on 8 devices of 16 GB, 4096 tokens, checkpointed."""
    proc = run_cli(["plan", "qwen3-4b", "--world-size", "8", "--device-memory-gib", "16", "--seq-len", "4096",
                    "--micro-batch-size", "1", "--activation-checkpointing"])
    assert proc.returncode == 0, proc.stderr
    choice = proc.stdout.split("auto would choose: ")[1].split(",")[0]  # then the LM head's path
    assert choice.startswith("partial("), proc.stdout
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert "NO" in rows["deferred"] and "yes" in rows[choice] and "partial(1)" in rows


def test_partial_rows_reduce_scatter_k_plus_the_rest_every_microbatch(config_dir):
    plan = _plan(config_dir)  # 3 units, 4 micro-batches
    assert [m.mode for m in plan.partial] == ["partial(2)", "partial(1)"]
    for row, k in zip(plan.partial, (2, 1), strict=True):
        assert row.collectives["reduce_scatter"] == k + (3 - k) * 4
    assert plan.partial[1].extra_bytes == 4 * ROOT // 2  # the root is the smallest unit: deferred first


@pytest.mark.parametrize(("flag", "message"), [
    (["--seq-len", "-1"], "--seq-len must be >= 0"),
    (["--budget-fraction", "1.5"], "--budget-fraction must be in (0, 1]"),
    (["--micro-batch-size", "0"], "--micro-batch-size >= 1"),
    (["--calibrate", "--nproc", "1"], "--calibrate needs --nproc >= 2"),
    (["--auto-cap"], "--auto-cap needs --seq-len"),
    (["--fused-lm-head", "maybe"], "--fused-lm-head: 'maybe' is not one of auto, true, false"),
])
def test_plan_flags_out_of_range_are_one_line(flag, message):
    proc = run_cli(["plan", "qwen3-4b", *flag])
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_calibrate_fits_latency_and_bandwidth_and_says_so(config_dir):
    proc = subprocess.run([sys.executable, "-m", "syncwise", "plan", str(config_dir), "--world-size", "2",
                           "--calibrate", "--json"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    plan = json.loads(proc.stdout)
    assert plan["links_measured"] is True and plan["bandwidth_gbps"] > 0 and plan["latency_us"] >= 0


def test_rollout_copy_is_in_every_modes_base_and_sampling_has_its_own_peak():
    """GRPO: the rollout copy (the whole model in its dtype) is resident while training, so it is in the
    base of every mode and can change auto's choice; sampling's KV cache and kept scores count once."""
    common = dict(model="qwen3-4b", world_size=8, device_memory_gib=40, seq_len=4096, micro_batch_size=1,
                  activation_checkpointing=True)
    without = make_plan(PlanInput(**common))
    rollout = dict(rollout_sequences=64, rollout_prompt_len=512, rollout_new_tokens=1024, rollout_dtype="bfloat16")
    plan = make_plan(PlanInput(**common, **rollout))
    r = plan.rollout
    assert r.copy_bytes == plan.num_params * 2
    assert plan.base_bytes == without.base_bytes + r.copy_bytes
    for m, w in zip(plan.modes, without.modes, strict=True):
        assert m.peak_bytes == w.peak_bytes + r.copy_bytes and m.extra_bytes == w.extra_bytes
    # qwen3-4b: 36 layers, 8 KV heads of 128; K and V for 64 x (512 + 1024) tokens in bf16
    assert r.kv_cache_bytes == 2 * 36 * 8 * 128 * 64 * 1536 * 2
    assert r.scores_bytes == 64 * (151936 * (2 + 8) + 1024 * 4)  # one step's logits (compact sampler)
    assert r.fits
    # the copy takes the room of the gathered parameters (the LM head's path is auto's too: the logits fit)
    assert without.auto_choice == "deferred_unsharded, logits materialised"
    assert plan.auto_choice == "deferred, logits materialised"
    hf = make_plan(PlanInput(**common, **rollout, rollout_sampler="generate")).rollout
    assert hf.scores_bytes == 3 * 64 * 1024 * 151936 * 4  # generate: fp32 scores of every step, kept
    assert not hf.fits and hf.kv_cache_bytes == r.kv_cache_bytes
    vllm = make_plan(PlanInput(**common, **rollout, rollout_sampler="vllm")).rollout
    assert vllm.kv_cache_bytes == r.kv_cache_bytes  # 1536 tokens: whole 16-token blocks already
    assert vllm.scores_bytes == 3 * 64 * 151936 * 4 and vllm.copy_bytes == r.copy_bytes
    assert make_plan(PlanInput(**common)).rollout is None


def test_rollout_ranks_plan_each_role_apart():
    """dist.rollout_ranks (issue 48): the trainers shard over their own ranks with no rollout copy beside them --
    each mode's base and peak is the colocated job's on as many ranks, less the copy -- and a rollout rank holds
    the engine alone: the copy, the KV cache, the logits."""
    common = dict(model="qwen3-4b", device_memory_gib=40, seq_len=4096, micro_batch_size=1,
                  activation_checkpointing=True, rollout_sequences=64, rollout_prompt_len=512,
                  rollout_new_tokens=1024, rollout_dtype="bfloat16")
    colocated = make_plan(PlanInput(world_size=6, **common))
    split = make_plan(PlanInput(world_size=8, rollout_ranks=2, **common))
    copy = colocated.rollout.copy_bytes
    assert split.base_bytes == colocated.base_bytes - copy
    for m, c in zip(split.modes, colocated.modes, strict=True):
        assert m.peak_bytes == c.peak_bytes - copy and m.collectives == c.collectives
    r = split.rollout
    assert r.peak_bytes == copy + r.kv_cache_bytes + r.scores_bytes < colocated.rollout.peak_bytes
    proc = run_cli(["plan", "qwen3-4b", "--world-size", "8", "--rollout-ranks", "2", "--rollout-sequences", "64",
                    "--rollout-prompt-len", "512", "--rollout-new-tokens", "1024"])
    assert proc.returncode == 0, proc.stderr
    assert "ranks 6 training + 2 rollout rank(s) of their own" in proc.stdout
    assert "per trainer rank: base" in proc.stdout and "a rollout rank, the engine alone (64 sequences" in proc.stdout
    bad = run_cli(["plan", "qwen3-4b", "--world-size", "4", "--rollout-ranks", "3", "--rollout-sequences", "8",
                   "--rollout-new-tokens", "8"])
    assert bad.returncode == 2
    assert "--rollout-ranks 3 of --world-size 4: at least as many ranks must train" in bad.stderr


def test_rollout_flags_need_new_tokens():
    with pytest.raises(ValueError, match="--rollout-sequences needs --rollout-new-tokens"):
        make_plan(PlanInput(model="qwen2-tiny", rollout_sequences=8))


def test_ppo_plan_predicts_both_models_peaks_within_10_percent():
    """``plan --critic``: the actor's and the critic's per_microbatch peaks, each with the other model held
    beside it, against the engines' measured peaks (actor and critic built side by side, 2 ranks)."""
    from dist_harness import run_distributed
    from scenarios_plan import MICROBATCHES, measured_ppo_peaks

    for row in run_distributed(measured_ppo_peaks, 2)[0]:
        preset, seq_len, size = row["shape"]
        plan = make_plan(PlanInput(model=preset, world_size=2, microbatches=MICROBATCHES, param_dtype="float32",
                                   reduce_dtype="float32", seq_len=seq_len, micro_batch_size=size, critic=True),
                         hf_config=preset_config(preset))
        for name, model_plan in (("actor", plan), ("critic", plan.critic)):
            predicted = next(m for m in model_plan.modes if m.mode == "per_microbatch").peak_bytes
            assert predicted == pytest.approx(row[name], rel=0.10), (row["shape"], name, predicted, row[name])
        assert plan.held_outside_bytes > 0 and plan.critic.held_outside_bytes > plan.held_outside_bytes * 0.5


def test_plan_command_with_a_critic_shows_both_models_and_auto_pair():
    proc = run_cli(["plan", "qwen2.5-0.5b", "--critic", "--seq-len", "1024", "--device-memory-gib", "24"])
    assert proc.returncode == 0, proc.stderr
    assert "critic (the same decoder with a one-output value head)" in proc.stdout
    assert "auto would choose: actor " in proc.stdout and ", critic " in proc.stdout


def test_plan_chooses_the_head_and_cap_with_the_mode_as_the_engine_does():
    """--auto-cap with --seq-len: the step's sequences split under each power-of-two cap; auto's choice of
    sync mode, LM head's path and cap and its runner-up, printed; a smaller device moves the choice."""
    def plan_at(gib: float):
        return make_plan(PlanInput(model="qwen3-4b", world_size=8, seq_len=2048, micro_batch_size=2, auto_cap=True,
                                   device_memory_gib=gib))

    ample, small = plan_at(80), plan_at(40)
    assert ample.auto_choice == "deferred_unsharded, logits materialised, 8192-token cap"
    assert ample.auto_runner_up == "deferred_unsharded, logits materialised, 4096-token cap"
    assert ample.auto_predicted_peak <= ample.budget_bytes
    assert small.auto_choice.startswith("partial(") and "fused head" in small.auto_choice
    assert small.auto_predicted_peak <= small.budget_bytes < ample.auto_predicted_peak
    proc = run_cli(["plan", "qwen3-4b", "--seq-len", "2048", "--micro-batch-size", "2", "--auto-cap"])
    assert proc.returncode == 0, proc.stderr
    assert f"auto would choose: {ample.auto_choice} (predicted peak" in proc.stdout
    assert f"runner-up: {ample.auto_runner_up}" in proc.stdout
