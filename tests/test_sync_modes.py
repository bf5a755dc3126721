"""Every sync mode on real gloo ranks: gradients equal per_microbatch, collectives equal the formula,
held bytes equal the estimator (measured by FSDPMemTracker), state restored after an exception, and
`auto` choosing and stepping down by memory. FSDP2 at W=2; HSDP on a 2x2 mesh at W=4."""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from numerics import BF16_RTOL, FP32_RTOL, assert_close
from scenarios_modes import FSDP2_MODES, HSDP_MODES, NUM_MICROBATCHES, hsdp_suite, modes_suite
from syncwise.memory.schedule import expected_collectives

UNITS = 3  # qwen2-test: two decoder layers + root


@pytest.fixture(scope="module")
def w2():
    return run_distributed(modes_suite, 2)[0]


@pytest.fixture(scope="module")
def w4():
    return run_distributed(hsdp_suite, 4)[0]


def _close(a: dict, b: dict, rtol: float = FP32_RTOL) -> None:
    for name in a:
        assert_close(a[name], b[name], rtol, name)


@pytest.mark.parametrize("name", list(FSDP2_MODES))
def test_fsdp2_mode_gradients_and_update_match_per_microbatch(w2, name):
    reference = w2[("step", "per_microbatch_bf16" if name.endswith("bf16") else "per_microbatch")]
    rtol = BF16_RTOL if name.endswith("bf16") else FP32_RTOL
    _close(w2[("step", name)]["grads"], reference["grads"], rtol)
    _close(w2[("step", name)]["params"], reference["params"], rtol)


@pytest.mark.parametrize("mode", HSDP_MODES)
def test_hsdp_mode_gradients_and_update_match_per_microbatch(w4, mode):
    _close(w4[("step", mode)]["grads"], w4[("step", "per_microbatch")]["grads"])
    _close(w4[("step", mode)]["params"], w4[("step", "per_microbatch")]["params"])


@pytest.mark.parametrize(
    ("name", "all_gathers", "reduce_scatters"),
    [
        ("per_microbatch", 3 * (2 * UNITS - 1), 3 * UNITS),
        ("deferred", 3 * (2 * UNITS - 1), UNITS),
        ("deferred_unsharded", UNITS, UNITS),  # gathered once, kept through forward and backward
        ("deferred_unsharded_reshard_fwd", UNITS + 3 * (UNITS - 1), UNITS),
    ],
)
def test_fsdp2_collectives_exact(w2, name, all_gathers, reduce_scatters):
    m = w2[("step", name)]["metrics"]
    assert (m["comm/all_gather_count"], m["comm/reduce_scatter_count"], m["comm/all_reduce_count"]) == (
        all_gathers, reduce_scatters, 3,
    )
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert m[f"comm/{kind}_count"] == m[f"comm/expected_{kind}_count"]


@pytest.mark.parametrize(
    ("mode", "reduce_scatters", "replica_all_reduces"),
    [
        ("per_microbatch", 3 * UNITS, 3 * UNITS),
        ("deferred", UNITS, UNITS),
        ("deferred_unsharded", UNITS, UNITS),
        ("replica_deferred", 3 * UNITS, UNITS),  # shard-group reduce-scatter every time, replicas once
    ],
)
def test_hsdp_collectives_exact(w4, mode, reduce_scatters, replica_all_reduces):
    m = w4[("step", mode)]["metrics"]
    assert m["comm/reduce_scatter_count"] == reduce_scatters
    assert m["comm/all_reduce_count"] == 3 + replica_all_reduces
    expected = expected_collectives(
        mode, NUM_MICROBATCHES, UNITS, hsdp=True, unsharded_forward=True, engine_all_reduces=3
    )
    assert {k: m[f"comm/{k}_count"] for k in expected} == expected


def _assert_estimate(result: dict, baseline: dict) -> None:
    assert result["retained_grad_bytes"] == result["predicted_retained"]
    assert result["unsharded_param_bytes"] == result["predicted_unsharded"]
    held_extra = result["held_between_microbatches"] - baseline["held_between_microbatches"]
    assert held_extra == pytest.approx(result["predicted_extra"], rel=0.05, abs=64)


@pytest.mark.parametrize("name", list(FSDP2_MODES))
def test_fsdp2_estimator_matches_tracker_within_5_percent(w2, name):
    baseline = w2[("step", "per_microbatch_bf16" if name.endswith("bf16") else "per_microbatch")]
    _assert_estimate(w2[("step", name)], baseline)


@pytest.mark.parametrize("mode", HSDP_MODES)
def test_hsdp_estimator_matches_tracker_within_5_percent(w4, mode):
    _assert_estimate(w4[("step", mode)], w4[("step", "per_microbatch")])


def test_deferral_extra_is_the_unsharded_fp32_gradient(w2):
    """deferred holds 4 bytes x every parameter instead of a 1/W shard: +4P(1 - 1/W) at W=2."""
    params = 427_136
    assert w2[("step", "deferred")]["predicted_extra"] == 4 * params // 2
    assert w2[("step", "deferred_unsharded")]["predicted_extra"] == 4 * params // 2 + 4 * params
    assert w2[("step", "deferred_unsharded_bf16")]["predicted_extra"] == 4 * params // 2 + 2 * params


@pytest.mark.parametrize("name", list(FSDP2_MODES))
def test_flags_restored_after_each_microbatch(w2, name):
    assert w2[("step", name)]["flags_restored"]


def test_state_restored_after_exception_in_every_mode(w2, w4):
    cases = [v for k, v in w2.items() if k[0] == "recovery"] + [w4[("recovery", "replica_deferred")]]
    assert len(cases) == 4
    for case in cases:
        assert case["error"] == "injected failure in micro-batch 2"
        assert case["flags_restored"], "sync and reshard flags are back"
        assert case["max_param_diff"] < 1e-6
        assert case["faulty_metrics"]["loss"] == pytest.approx(case["clean_metrics"]["loss"], rel=FP32_RTOL)


def test_auto_picks_by_budget(w2):
    base, medium, tight = w2["auto_budgets"]
    assert tight < medium
    picks = {b: [m["sync/mode"] for m in w2[("auto", b)]] for b in ("ample", "medium", "tight")}
    assert picks == {
        "ample": ["per_microbatch", "deferred_unsharded", "deferred_unsharded"],
        "medium": ["per_microbatch", "deferred", "deferred"],
        "tight": ["per_microbatch"] * 3,
    }
    decision = w2[("auto", "medium")][0]["sync/decision"]
    # its unsharded gradient (+834.25 KiB) and every unit's gathered parameters but the root's (+1.94 MiB over
    # per_microbatch), with what every mode holds from a step's second micro-batch on and auto's base (a step of one
    # micro-batch's peak) lacks -- per_microbatch's gradient shards: +2.76 MiB
    assert "deferred_unsharded needs +2.76 MiB" in decision and "=> deferred" in decision
    for step in w2[("auto", "medium")]:
        assert step["memory/peak_bytes"] <= step["memory/budget_bytes"]
        assert step["comm/reduce_scatter_count"] == step["comm/expected_reduce_scatter_count"]


def test_auto_steps_down_when_a_measured_peak_exceeds_the_budget(w2):
    steps = w2[("auto", "step_down")]
    assert [m["sync/mode"] for m in steps] == ["per_microbatch", "deferred", "deferred", "per_microbatch"]
    over = steps[2]
    assert over["memory/peak_bytes"] > over["memory/budget_bytes"] and over["memory/peak_measured"] == 1
    assert "stepping down" in over["sync/decision"] and over["sync/next_mode"] == "per_microbatch"
    assert all(m["train/skipped"] == 0 for m in steps)


def test_silent_noop_is_detected_by_counting(w2):
    r = w2["silent_noop"]
    assert len(r["warnings"]) == 1, "warned once, not every step"
    assert "sync.mode=deferred: counted collectives" in r["warnings"][0]
    assert "'reduce_scatter': 9" in r["warnings"][0] and "'reduce_scatter': 3" in r["warnings"][0]
    assert r["strict_error"] is not None and "differ from the expected" in r["strict_error"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["engine.strategy=fsdp1", "sync.mode=deferred_unsharded"], "needs engine.strategy=fsdp2"),
        (["engine.strategy=ddp", "sync.mode=deferred_unsharded"], "needs engine.strategy=fsdp2"),
        (["engine.strategy=fsdp2", "sync.mode=replica_deferred"], "engine.hsdp_replicas > 1"),
        (["engine.strategy=fsdp1", "engine.hsdp_replicas=2", "sync.mode=replica_deferred"], "strategy=fsdp2"),
    ],
)
def test_unsupported_mode_combinations_are_config_errors(overrides, message):
    from syncwise.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_check_mode_lists_the_allowed_modes():
    from syncwise.sync.modes import SyncMode, check_mode

    with pytest.raises(ValueError, match="choose one of per_microbatch, deferred or auto"):
        check_mode(SyncMode.DEFERRED_UNSHARDED, "ddp", hsdp=False)
    check_mode(SyncMode.REPLICA_DEFERRED, "fsdp2", hsdp=True)


@pytest.mark.parametrize(("name", "deferred"), [("partial_1", 1), ("partial_named", 2)])
def test_partial_reduce_scatters_k_plus_the_rest_every_microbatch(w2, name, deferred):
    """partial(K): K + (U - K) N reduce-scatters, everything else as per_microbatch."""
    result = w2[("step", name)]
    m = result["metrics"]
    assert m["comm/reduce_scatter_count"] == deferred + (UNITS - deferred) * NUM_MICROBATCHES
    assert m["comm/all_gather_count"] == NUM_MICROBATCHES * (2 * UNITS - 1)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert m[f"comm/{kind}_count"] == m[f"comm/expected_{kind}_count"]
    assert m["sync/mode"] == f"partial({deferred})"
    expected = expected_collectives("partial", NUM_MICROBATCHES, UNITS, deferred_units=deferred)
    assert {k: m[f"comm/{k}_count"] for k in expected} == expected


def test_partial_defers_the_named_units_and_the_smallest_by_count(w2):
    assert w2[("step", "partial_named")]["choice"].units == frozenset({0, 2})  # root, model.layers.1
    # Deferring a unit saves about as much time whatever its size; per byte held the smallest saves most.
    extras = w2[("step", "partial_1")]["unit_extra"]
    assert w2[("step", "partial_1")]["choice"].units == frozenset({extras.index(min(extras))})
    assert w2[("step", "partial_1")]["predicted_extra"] == min(extras)


def test_auto_picks_partial_when_only_some_units_fit(w2):
    steps = w2[("auto", "partial")]
    assert [m["sync/mode"] for m in steps] == ["per_microbatch", "partial(1)", "partial(1)"]
    decision = steps[0]["sync/decision"]
    assert "deferred needs" in decision and "partial(2)" in decision and "=> partial(1)" in decision
    for m in steps:
        assert m["comm/reduce_scatter_count"] == m["comm/expected_reduce_scatter_count"]
        assert m["memory/peak_bytes"] <= m["memory/budget_bytes"]
