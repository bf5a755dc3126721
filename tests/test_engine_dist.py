"""The engine on real gloo ranks: step metrics, recovery from an exception mid-step, forward-only
passes, bad input on one rank, and state dicts. One process group runs it all (scenarios.engine_suite)."""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from numerics import FP32_RTOL, assert_close
from scenarios import engine_suite


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(engine_suite, 2)


@pytest.fixture(scope="module")
def results(ranks):
    return ranks[0]


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
@pytest.mark.parametrize("mode", ["per_microbatch", "deferred"])
def test_train_batch_counts_equal_expected(results, strategy, mode):
    metrics = results[("metrics", strategy, mode)]
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert metrics[f"comm/{kind}_count"] == metrics[f"comm/expected_{kind}_count"], kind
    units, n = 3, metrics["train/num_microbatches"]
    assert metrics["comm/reduce_scatter_count"] == (units if mode == "deferred" else n * units)
    assert metrics["sync/mode"] == mode
    assert metrics["comm/reduce_scatter_bytes"] > 0 and metrics["comm/all_gather_bytes"] > 0


def test_train_batch_metrics_are_global(ranks):
    """Loss is the full-batch token mean, reduced over ranks: every rank reports the same value."""
    a, b = (r[("metrics", "fsdp2", "deferred")] for r in ranks)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)  # one all-reduced value: the same to ~1 ulp
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-6)
    assert 0 < a["loss"] < 10


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1", "ddp"])
def test_exception_in_second_microbatch_restores_state(results, strategy):
    r = results[("recovery", strategy)]
    assert r["error"] == "injected failure in micro-batch 2"
    assert r["flags_restored"]
    assert r["grads_after_error"] == 0
    for name, value in r["clean_params"].items():
        assert_close(r["faulty_params"][name], value, FP32_RTOL, name)
    assert r["faulty_metrics"]["loss"] == pytest.approx(r["clean_metrics"]["loss"], rel=FP32_RTOL)


def test_forward_only_pass(results):
    r = results["forward_only"]
    assert r["log_probs"].shape == (5, 15)
    valid = r["target_mask"].bool()
    assert_close(r["log_probs"][valid], r["reference"][valid], FP32_RTOL, "log-probs in the original sample order")
    assert r["counts"]["reduce_scatter"] == 0
    assert r["grads"] == 0
    assert r["flags_on"]
    assert r["loss"] > 0


def test_bad_input_on_one_rank_raises_on_every_rank(ranks):
    assert "needs key 'input_ids'" in ranks[1]["bad_input_error"]
    assert "invalid on 1 other rank" in ranks[0]["bad_input_error"]


def test_a_key_the_loss_reads_is_checked_on_every_rank_before_any_collective(ranks):
    assert ranks[1]["missing_key"] == ("batch['advantages']: missing; the policy loss (rl.loss.kind=ppo) needs it "
                                       "([B] or [B, T-1])")
    assert "invalid on 1 other rank" in ranks[0]["missing_key"]
    assert ranks[0]["wrong_layout"] == "batch['old_log_probs']: shape (6, 16) is not [B, T-1] (input_ids is (6, 16))"
    assert "invalid on 1 other rank" in ranks[1]["wrong_layout"]


def test_uneven_sample_counts_run_the_same_microbatches(ranks):
    """6 samples vs 2 (micro_batch_size 2): both ranks run 3 micro-batches, no hang, collectives match."""
    for r in ranks:
        m = r["uneven"]
        assert m["train/num_microbatches"] == 3
        assert m["comm/reduce_scatter_count"] == m["comm/expected_reduce_scatter_count"]


def test_engine_trains_after_input_errors(results):
    metrics = results["after_errors"]
    assert metrics["train/skipped"] == 0
    assert metrics["comm/reduce_scatter_count"] == metrics["comm/expected_reduce_scatter_count"]


def test_state_dict_round_trip(results):
    assert results["state_dict_equal"]
    assert results["state_dict_step"] == (2, 2)  # the step after the input errors and the uneven one


def test_the_engine_describes_its_model_once(results):
    """Issue 77 (left from earlier): the model's decoder layer classes are found once (the features), not again
    by activation checkpointing, FSDP2's wrapping and auto's calibrating meter; its FLOPs counted once."""
    assert results["described"]["layer_classes"] == 1 and results["described"]["matmul_params"] == 1, results
    assert results["described"]["flops"] > 0
