"""`syncwise bench` as a smoke run: valid JSON, collective counts equal to the formula, plots written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from job_output import failed
from syncwise.memory.schedule import expected_collectives


def _bench(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """``syncwise bench *args`` in a process of its own, offline; it must succeed (its stderr's tail if not)."""
    proc = subprocess.run([sys.executable, "-m", "syncwise", "bench", *args], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=timeout)
    assert proc.returncode == 0, failed(proc.stderr, 4000)
    return proc


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench"
    _bench("--presets", "qwen2-test", "--microbatches", "2", "3", "--warmup", "1", "--repeats", "2", "--seq-len", "16",
           "--out", str(out))
    data = json.loads((out / "bench.json").read_text())
    records = data["records"]
    configs = {(r["microbatches"], r["config"]) for r in records}
    for n in (2, 3):
        for config in ("per_microbatch", "deferred", "deferred_unsharded", "auto", "raw_fsdp2", "compute_floor",
                       "lora8:per_microbatch", "lora8:deferred", "lora8:deferred_unsharded"):
            assert (n, config) in configs
    for r in records:
        assert len(r["step_time_samples_s"]) == 2 and r["step_time_median_s"] > 0
        if r["config"] in ("raw_fsdp2", "compute_floor"):
            continue
        mode = r["mode_run"]  # auto's last timed step runs its chosen mode
        trainable = 2 if r["config"].startswith("lora") else 3  # LoRA: the root (embeddings, LM head) is frozen
        expected = expected_collectives(mode, r["microbatches"], 3, unsharded_forward=True, engine_all_reduces=3,
                                        trainable_units=trainable)
        assert {k: r[f"comm/{k}_count"] for k in expected} == expected, (r["config"], r["microbatches"])
        assert r["ratio_to_per_microbatch"] > 0 and r["ratio_to_floor"] > 0
    auto = [r for r in records if r["config"] == "auto"]
    assert all(r["auto_choice"] == "deferred_unsharded" for r in auto)  # ample memory for a 0.4M model
    assert "engine_overhead_vs_raw" in next(r for r in records if r["config"] == "deferred")
    for name in ("step_time.png", "bytes.png", "memory.png"):
        assert (out / name).stat().st_size > 5_000
    table = (out / "bench.md").read_text()
    assert "| qwen2-test (0.4M) | 3 | deferred |" in table and "auto chose deferred_unsharded" in table
    lora = {r["config"]: r for r in records if r["microbatches"] == 3}
    # LoRA holds the adapters' gradients: a small fraction of the whole model's
    assert lora["lora8:deferred"]["memory/retained_grad_bytes"] < lora["deferred"]["memory/retained_grad_bytes"] / 5
    assert "lora8:deferred/deferred step" in table
    # the roofline: useful FLOPs over the step time over the GEMM rate measured in the same run
    for r in records:  # (the bound: a busy machine can time the matmul slower than the steps ran; 3x is a bug)
        assert 0 < r["fraction_of_gemm_peak"] < 3 and r["fraction_of_gemm_peak"] == pytest.approx(
            r["useful_flops_per_step"] / r["step_time_median_s"] / (r["gemm_flops_per_s"] * r["world_size"]))
    assert "| of GEMM peak |" in table and "of the GEMM peak (" in table


def test_bench_rl_workload_smoke(tmp_path):
    """`syncwise bench --workload rl`: every configuration on the long-tailed and the uniform data, with real
    tokens per second, padding fraction and measured peaks (ratios are measured, not asserted here)."""
    out = tmp_path / "bench_rl"
    _bench("--workload", "rl", "--presets", "qwen2-test", "--sequences", "6", "--warmup", "1", "--repeats", "1",
           "--out", str(out))
    from syncwise.jobs.bench.rl import HAND_WRITTEN, RL_CONFIGS, UNIFORM_CONFIGS

    records = json.loads((out / "bench_rl.json").read_text())["records"]
    assert {(r["data"], r["config"]) for r in records} == (
        {("rl", c) for c in RL_CONFIGS} | {("uniform", c) for c in UNIFORM_CONFIGS} | {("rl", c) for c in HAND_WRITTEN}
    )
    by_config = {r["config"]: r for r in records if r["data"] == "rl"}
    for name, (mirrors, mode, _) in HAND_WRITTEN.items():  # the same data and split as the engine it mirrors
        baseline, engine = by_config[name], by_config[mirrors]
        assert baseline["real_tokens_per_step"] == engine["real_tokens_per_step"]
        assert baseline["microbatches"] == engine["microbatches"] and engine["sync_mode"] == mode
        assert engine["engine_vs_hand_written"] > 0
    for r in (r for r in records if r["config"] not in HAND_WRITTEN):
        assert r["real_tokens_per_s"] > 0 and r["peak_measured"] == 1 and r["peak_bytes"] > 0
        assert r["real_tokens_per_step"] == next(x for x in records if x["data"] == r["data"])["real_tokens_per_step"]
        packed = not r["config"].startswith("padded")
        assert (r["padding_fraction"] == 0.0) if packed or r["data"] == "uniform" else r["padding_fraction"] > 0.2
    summary = (out / "bench_rl.md").read_text()
    assert "packed / padded real tokens per second" in summary and "target >= 1.70" in summary
    assert "engine / hand-written packed loop step time, deferred " in summary
    assert "fused LM head / materialised logits step time, deferred " in summary
    assert "engine / hand-written packed loop step time, per_microbatch " in summary
    assert "LM head auto / materialised logits step time, per_microbatch " in summary
    assert "defaults / fastest hand-set configuration" in summary
    defaults = by_config["defaults (sync mode, LM head and token cap auto)"]
    assert defaults["sync_mode"] == "deferred_unsharded" and not defaults["fused_lm_head"]  # ample memory
    for r in records:  # beside the hand-written loops' too (the bound: as in test_bench_smoke)
        assert 0 < r["fraction_of_gemm_peak"] < 3 and r["fraction_of_gemm_peak"] == pytest.approx(
            r["useful_flops_per_step"] / r["step_time_median_s"] / (r["gemm_flops_per_s"] * 2))
    assert defaults["settle_steps"] == 2 and defaults["settle_s"] > 0  # nothing timed: decide, measure the choice
    # issue 62 (13): the defaults beside the hand-written loop of their sync mode, in turn, 24 steps each, a line
    drifted = {r["config"]: r["drift"] for r in records if "drift" in r}
    assert set(drifted) == {"defaults (sync mode, LM head and token cap auto)",
                            "hand-written packed loop, 512-token cap, deferred_unsharded"}
    for d in drifted.values():
        assert len(d["wall_s"]) == len(d["cpu_s"]) == 24 and set(d["wall"]) >= {"slope_s_per_step", "drift", "flat"}
    assert "step time over 24 steps in turn: slope" in summary and "rank 0's CPU seconds over 24 steps" in summary
    assert "auto settled in 2 steps" in summary
    assert "hand-written packed loop, 512-token cap: " in summary and "of the GEMM peak" in summary
    flops = {r["useful_flops_per_step"] for r in records if r["data"] == "rl"}
    assert len(flops) == 1  # the same work on every row of the same data
    for r in (r for r in records if r["config"] not in HAND_WRITTEN):  # the engine's metric, from its plan
        assert r["engine_useful_flops"] == pytest.approx(r["useful_flops_per_step"], rel=1e-9)


def test_bench_loss_workload(tmp_path):
    """`syncwise bench --workload loss`: the chunked log-prob path and the plain autograd one side by side
    (ratios measured, not asserted: speed targets live in the bench, not in tests)."""
    _bench("--workload", "loss", "--quick", "--repeats", "1", "--out", str(tmp_path), timeout=600)
    records = json.loads((tmp_path / "bench_loss.json").read_text())["records"]
    whats = {"log-probs", "log-probs + entropy"}
    whats |= {f"{head} + {what}, {how}" for what in whats for head in ("LM head", "frozen LM head")
              for how in ("logits materialised", "fused")}
    assert {(r["what"], r["temperature"]) for r in records} == {(what, 1.0) for what in whats}
    assert all(r["plain_s"] > 0 and r["syncwise_s"] > 0 and r["ratio"] > 0 for r in records)
    summary = (tmp_path / "bench_loss.md").read_text()
    assert "slowest syncwise / plain ratio" in summary and "LM head + log-probs, T 1.0: fused / materialised" in summary


def test_bench_grpo_workload_quick(tmp_path):
    """`syncwise bench --workload grpo --quick`: whole `syncwise train` jobs on the repeat task per
    configuration (partial rollouts among them), each step's phases within its time, the imbalance balanced, the
    table and the plot."""
    out = tmp_path / "bench_grpo"
    _bench("--workload", "grpo", "--quick", "--out", str(out))
    from syncwise.jobs.bench.grpo import QUICK_CONFIGS

    report = json.loads((out / "bench_grpo.json").read_text())
    results = report["results"]
    assert list(results) == list(QUICK_CONFIGS)
    for name, r in results.items():
        assert r["steps"] == 3 and 0 < sum(r["phases_s"].values()) <= r["step_s"] * 1.5
        assert r["rollout_tokens_per_s"] > r["end_to_end_tokens_per_s"] > 0
        balanced = "balanced" in name and "unbalanced" not in name
        assert (r["imbalance_after"] <= r["imbalance_before"]) if balanced else (
            r["imbalance_after"] == r["imbalance_before"])
    assert results[QUICK_CONFIGS[0]]["speedup"] == 1.0
    # like with like (issue 28.5): the compact configurations did the very same work, response for response;
    # the headline is end-to-end tokens/s, so a configuration that samples shorter responses gains nothing
    first, *others, partial = QUICK_CONFIGS[1:]
    assert all(results[name]["same_responses_as"] == first for name in others)
    assert results[first]["response_tokens"] == results[others[0]]["response_tokens"]
    # partial rollouts sample other groups at other times (the long tail carried): other work, its own fill
    assert results[partial]["same_responses_as"] is None
    assert all(0 < r["decode_fill"] <= 1 for r in results.values())
    for r in results.values():
        assert r["speedup"] == pytest.approx(r["end_to_end_tokens_per_s"]
                                             / results[QUICK_CONFIGS[0]]["end_to_end_tokens_per_s"])
    assert "| 1. generate, unbalanced (before) |" in (out / "bench_grpo.md").read_text()
    assert all(0 < r["update_fraction_of_gemm_peak"] < 3 for r in results.values())  # bound: test_bench_smoke
    assert "Update of GEMM peak: the update's useful FLOPs per second over" in (out / "bench_grpo.md").read_text()
    assert (out / "grpo_phases.png").stat().st_size > 10_000


def test_bench_sft_workload_quick(tmp_path):
    """`syncwise bench --workload sft --quick`: syncwise sft's steps beside train_batch alone on the same
    batches, and the data path timed inside the step."""
    out = tmp_path / "bench_sft"
    _bench("--workload", "sft", "--quick", "--out", str(out))
    result = json.loads((out / "bench_sft.json").read_text())["result"]
    assert result["steps_per_kind"] == 8 and result["rows"] == 4000 and result["batch_size"] == 16
    medians = result["medians_s"]
    assert result["ratio"] == pytest.approx(medians["syncwise sft step"] / medians["train_batch alone"])
    assert 0 < result["data_s"] < medians["syncwise sft step"]
    assert "the data path's share of a step" in (out / "bench_sft.md").read_text()
    assert all(0 < f < 3 for f in result["fraction_of_gemm_peak"].values()) and result["gemm_flops_per_s"] > 0


def test_bench_long_workload_quick(tmp_path):
    """Issue 78: `syncwise bench --workload long --quick`: SFT steps on a long sequence at dist.sequence_parallel
    N = 1 and 2 side by side -- the measured peak per rank (N = 2 below N = 1's, the memory model's prediction
    within 15% of it), tokens/s, the all-to-alls' share (none at N = 1) and the longest length fitting the budget
    (longer at N = 2)."""
    out = tmp_path / "bench_long"
    _bench("--workload", "long", "--quick", "--out", str(out))
    result = json.loads((out / "bench_long.json").read_text())["result"]
    one, two = result["rows"]
    assert (one["size"], two["size"]) == (1, 2) and two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["peak_bytes"] < 0.75 * one["peak_bytes"]
    for row in (one, two):
        assert row["predicted_peak_bytes"] == pytest.approx(row["peak_bytes"], rel=0.15)
        assert row["tokens_per_s"] > 0
    assert one["all_to_all_share"] == 0 < two["all_to_all_share"] < 1 and two["all_to_all_bytes"] > 0
    assert two["longest_fitting"] > one["longest_fitting"]
    assert "| 2 |" in (out / "bench_long.md").read_text()


def test_the_moe_bench_compares_a_dense_model_of_the_same_active_size(tmp_path):
    """Issue 79: `syncwise bench --workload moe`'s models, saved with save_pretrained as its jobs load them: the dense
    row's parameters are the MoE's active ones but for the routers (a token's matmuls alike), its experts 4x more."""
    from transformers import AutoModelForCausalLM

    from syncwise.jobs.bench.moe import ROWS, write_models
    from syncwise.models.moe import active_parameters

    paths = write_models(tmp_path)
    moe, dense = (AutoModelForCausalLM.from_pretrained(paths[name]) for name in ("moe", "dense"))
    routers = sum(layer.mlp.gate.weight.numel() for layer in moe.model.layers)
    active = active_parameters((p.shape for p in moe.parameters()), moe.config)
    assert active - routers == sum(p.numel() for p in dense.parameters())
    assert sum(p.numel() for p in moe.parameters()) > active
    assert next(iter(ROWS)).startswith("dense") and {keys for _, keys in ROWS.values()} >= {
        ("rl.router_replay=true",), ("rl.router_replay=false",)}


def test_bench_dpo_workload_quick(tmp_path):
    """`syncwise bench --workload dpo --quick` without --trl-python: syncwise dpo's side alone on the example's
    pairs and model, its steps trained in one pass, the reference's share of a step said."""
    out = tmp_path / "bench_dpo"
    _bench("--workload", "dpo", "--quick", "--out", str(out))
    result = json.loads((out / "bench_dpo.json").read_text())["result"]
    assert "TRL" not in result and len(result["per_round"]["syncwise"]) == 1
    ours = result["syncwise"]
    assert ours["pairs_per_s"] == pytest.approx(16 / ours["median_step_s"]) and 0 < ours["score_share"] < 1
    assert "| syncwise |" in (out / "bench_dpo.md").read_text()
    steps = [json.loads(line) for line in (out / "jobs" / "syncwise_0" / "metrics.jsonl").read_text().splitlines()]
    assert [step["dpo/one_pass"] for step in steps] == [1.0] * 6


def test_bench_rl_profile_has_the_default_step_beside_the_fixed_ones(tmp_path):
    """`syncwise bench --workload rl --profile`: torch.profiler's operator tables of one packed step, the
    defaults' (once auto has settled) beside the fixed 512-token cap with the head fused and materialised."""
    out = tmp_path / "profile"
    _bench("--workload", "rl", "--profile", "--presets", "qwen2-test", "--sequences", "4", "--out", str(out),
           timeout=600)
    text = (out / "profile.md").read_text()
    for label in ("engine.fused_lm_head=true, engine.max_tokens_per_micro_batch=512",
                  "engine.fused_lm_head=false, engine.max_tokens_per_micro_batch=512",
                  "the defaults (LM head and token cap auto)"):
        assert label in text
    assert text.count("aten::mm") >= 3 and text.count("Self CPU time total") == 3


def test_the_gpu_workload_runs_its_parts_on_a_cpu(tmp_path):
    """Issue 59 (4): `syncwise bench --workload gpu` is written to run first time on a GPU; here every part but
    CUDA itself runs (--quick on a machine without CUDA): the engine rows -- the defaults, fixed caps with either
    head, activation checkpointing, padded rows and the hand-written loop -- with tokens/s, useful FLOP/s against
    the GEMM rate of the same run and auto's prediction, then the GRPO rows; one report. Without --quick, one
    line and exit 2."""
    from cli_harness import run_cli
    from syncwise.jobs.bench.gpu import DEFAULTS, GPU_CONFIGS

    refused = run_cli(["bench", "--workload", "gpu", "--out", str(tmp_path / "no")])
    assert refused.returncode == 2 and refused.stderr.startswith("syncwise: error: bench --workload gpu needs a CUDA")
    out = tmp_path / "gpu"
    _bench("--workload", "gpu", "--quick", "--out", str(out))
    data = json.loads((out / "bench_gpu.json").read_text())
    assert data["cuda_tests"] == {"skipped": "no CUDA device: the CPU check"}
    rows = {r["config"]: r for r in data["records"]}
    assert list(rows) == list(GPU_CONFIGS)
    for r in rows.values():
        assert r["step_s"] > 0 and r["real_tokens_per_s"] > 0 and 0 < r["fraction_of_gemm"] < 1
        assert r["useful_flops_per_s"] == pytest.approx(r["useful_flops_per_step"] / r["step_s"])
    assert 1.0 <= round(rows[DEFAULTS]["predicted_over_measured"], 3) <= 1.10
    assert list(data["grpo"]) == ["compact sampler, balanced"]
    table = (out / "bench_gpu.md").read_text()
    assert "| qwen2-tiny | hand-written packed FSDP2 loop" in table and "GRPO steps" in table
    assert "the defaults' real tokens/s over the hand-written loop's" in table


def test_bench_load_workload_quick(tmp_path):
    """Issue 60: `syncwise bench --workload load --quick`: loading a bf16 model.path whole on every rank (as before)
    beside each rank reading its own shards from the meta device, per rank. The whole way holds at least the
    fp32 model on every rank; the meta way at least its shards, and less than the whole way."""
    out = tmp_path / "bench_load"
    proc = _bench("--workload", "load", "--quick", "--out", str(out))
    result = json.loads((out / "bench_load.json").read_text())
    model, rows = result["model"], result["results"]
    assert list(rows) == ["whole, 2 ranks", "meta, 2 ranks"]
    whole, meta = rows["whole, 2 ranks"], rows["meta, 2 ranks"]
    assert whole["seconds"] > 0 and meta["seconds"] > 0
    assert whole["load_peak_bytes"] >= 0.95 * model["bytes"]
    assert 0.95 * model["bytes"] / 2 <= meta["load_peak_bytes"] < whole["load_peak_bytes"]
    assert "meta / whole load peak per rank" in (out / "bench_load.md").read_text()
    assert "read into this rank's shards" in proc.stdout


def test_a_step_time_slope_and_its_noise():
    """Issue 62 (13): the drift figure -- the least-squares line's rise over the run relative to the median, and
    its 95% half-width from the scatter about the line."""
    from syncwise.jobs.bench.drift import slope_of

    rising = slope_of([7.15, 7.78, 8.53, 9.27, 9.91])  # the first run
    assert rising["slope_s_per_step"] == pytest.approx(0.7, abs=0.01)
    assert rising["drift"] == pytest.approx(4 * rising["slope_s_per_step"] / 8.53) and not rising["flat"]
    flat = slope_of([1.0, 1.2, 0.9, 1.1, 1.0, 0.8, 1.2, 1.0])
    assert abs(flat["drift"]) < flat["noise"] and flat["flat"]
    line = slope_of([2.0 + 0.01 * i for i in range(20)])  # no scatter: no noise; +0.19 s over 2.095 s is 9%
    assert line["noise"] == pytest.approx(0.0, abs=1e-9) and line["drift"] == pytest.approx(0.19 / 2.095)
    assert not line["flat"]


def test_bench_grpo_takes_your_own_job(tmp_path):
    """Issue 61: `bench --workload grpo --job KEY=VALUE ...` -- a user's own job's keys go into every
    configuration after the row's (so a multi-turn recipe is measured mode against mode), and with model.path
    the configurations start from that model, no warm start."""
    from syncwise.jobs.bench.grpo import GRPOBenchSpec, _job_config

    job = ["model.path=runs/sft_guess/export", "rl.dataset=data/guess/prompts.jsonl",
           "rl.environment=syncwise.environments:GuessNumber", "rl.max_turns=5", "rl.prompts_per_rank=4"]
    spec = GRPOBenchSpec(out_dir=str(tmp_path), job=job)
    assert spec.own_model == "runs/sft_guess/export" and GRPOBenchSpec().own_model is None
    config = _job_config(spec, "compact, balanced, partial rollouts", tmp_path / "job", tmp_path / "ignored")
    assert config["model"]["path"] == "runs/sft_guess/export" and config["rl"]["prompts_per_rank"] == 4
    assert config["rl"]["environment"] == "syncwise.environments:GuessNumber" and config["rl"]["max_staleness"] == 1
    assert config["optim"]["lr"] == 0 and config["rl"]["max_turns"] == 5


def test_the_regression_bench_runs_two_trees_abba_and_prints_the_ratio_per_phase(tmp_path):
    """Issue 71's guard, its mechanics on a tiny job: the earlier tree (here this one, as a checkout) and the current
    one, A B B A, per phase per token; a tree against itself is within the run-to-run noise of a few steps."""
    from pathlib import Path

    out = tmp_path / "regression"
    tree = Path(__file__).resolve().parents[1]
    proc = _bench("--workload", "regression", "--against-tree", str(tree), "--repeats", "1", "--warmup", "0",
                  "--out", str(out), "--job", "train.steps=3", "rl.prompts_per_rank=2", "rl.samples_per_prompt=2",
                  "train.checkpoint_every=0", "train.export=false")
    data = json.loads((out / "bench_regression.json").read_text())
    assert len(data["runs"]["earlier"]) == len(data["runs"]["current"]) == 2
    ratios = data["ratios"]
    assert {"step", "rollout", "update", "response_length"} <= set(ratios)
    assert ratios["response_length"]["ratio"] == 1.0  # the same tree samples the same responses
    assert 0.2 < ratios["step"]["ratio"] < 5.0
    assert "| step |" in proc.stdout and "ratio = current / earlier" in proc.stdout
    # identical work, said, with each phase's total seconds compared
    assert data["same_responses"] is True and 0.2 < data["totals"]["step"] < 5.0
    assert "same responses in both trees at every measured step" in proc.stdout
