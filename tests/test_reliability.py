"""Reliability on real gloo ranks: ranks with different memory budgets choose alike, a failing
forward-only pass costs training nothing, frozen units and forward-only passes follow the formula, DDP is
counted once. One process group runs it all (scenarios_reliability.py)."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from scenarios_reliability import TIGHT_BUDGET, reliability_suite

UNITS = 3


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(reliability_suite, 2)


def test_auto_budget_is_the_minimum_over_ranks(ranks):
    """Rank 0 could hold everything, rank 1 no mode's extra: both run per_microbatch, with the same budget; the
    collectives match the formula on both (with per-rank budgets they would differ, and hang)."""
    for steps in (r["budgets"] for r in ranks):
        assert [m["sync/mode"] for m in steps] == ["per_microbatch"] * 3
        assert all(m["memory/budget_bytes"] == TIGHT_BUDGET for m in steps)
        assert "=> per_microbatch" in steps[0]["sync/decision"]
        for m in steps:
            assert m["comm/reduce_scatter_count"] == m["comm/expected_reduce_scatter_count"] == 3 * UNITS


def test_a_failing_clean_up_never_hides_the_steps_own_error(ranks):
    """Issue 59 (2): the forward's error reaches the caller as itself -- its type and message, one line -- and the
    clean-up that failed after it is said beside it, not over it. With the real clean-up the engine trains on."""
    for r in ranks:
        out = r["failing_clean_up"]
        kind, message, line = out["raised"]
        assert (kind, message) == ("RuntimeError", "failure inside the model's forward")
        assert line == ("RuntimeError: failure inside the model's forward; the step's clean-up (gradients dropped, "
                        "FSDP's iteration state reset) failed as well (AttributeError: 'FSDPQwen2ForCausalLM' object "
                        "has no attribute 'reset_iter_state')")
        assert out["real_clean_up"] == "RuntimeError: failure inside the model's forward"
        assert out["loss_after_failure"] == pytest.approx(out["loss_clean"], rel=1e-6)
        assert out["max_param_diff"] <= 1e-6


def test_failing_forward_only_passes_leave_training_alone(ranks):
    for r in ranks:
        out = r["forward_only_failures"]
        assert out["errors"][0] == "evaluation loss failed"
        assert "batch['input_ids']: ids must lie in [0, 512)" in out["errors"][1] or "invalid on 1 other" in (
            out["errors"][1])
        assert out["errors"][2] == "failure inside the model's forward"
        assert out["grads_kept"] == 27 and out["grads_unchanged"]
        assert out["max_param_diff"] == 0.0
        assert torch.equal(out["failing_log_probs"], out["clean_log_probs"])


@pytest.mark.parametrize(("mode", "reduce_scatters"), [("per_microbatch", 3 * (UNITS - 1)), ("deferred", UNITS - 1)])
def test_frozen_unit_is_never_reduce_scattered(ranks, mode, reduce_scatters):
    out = ranks[0]["frozen"][mode]
    m = out["metrics"]
    assert m["comm/reduce_scatter_count"] == m["comm/expected_reduce_scatter_count"] == reduce_scatters
    assert m["comm/all_gather_count"] == m["comm/expected_all_gather_count"] == 3 * (2 * UNITS - 1)
    assert out["frozen_grads"] == 0
    assert out["retained"] == out["predicted_retained"]  # frozen parameters hold no gradient bytes


def test_forward_only_pass_follows_the_schedule_and_frees_the_root(ranks):
    for r in ranks:
        out = r["forward_only_collectives"]
        assert out["counted"] == out["expected"]
        assert out["counted"]["all_gather"] == 1 + (UNITS - 1) * 3  # root once, the layers per micro-batch
        assert out["gathered_after"] == 0 and out["reference_gathered"] == 0
        m = out["next_step"]
        assert m["comm/all_gather_count"] == m["comm/expected_all_gather_count"] == 3 * (2 * UNITS - 1)


def test_ddp_all_reduces_are_counted_once(ranks):
    out = ranks[0]["ddp"]
    normaliser = (3 + 2 * 2) * 8  # the engine's batch-statistics all-reduce: float64, 3 sums + 2 per rank
    assert out["bytes"] == out["num_microbatches"] * 4 * out["params"] + normaliser
