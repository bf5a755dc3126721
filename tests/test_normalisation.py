"""The accumulated gradient equals the single-process full-batch gradient, for every loss aggregation,
fixed-size and token-budget micro-batching, both sync modes, on 2 gloo ranks holding 5 and 3 samples
(and 1 and 7) of long-tailed lengths."""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from numerics import FP32_RTOL, assert_close
from scenarios import _clean
from scenarios_batching import CASES, normalisation_suite


@pytest.fixture(scope="module")
def results():
    return run_distributed(normalisation_suite, 2)[0]


def _assert_matches(grads: dict, reference: dict) -> None:
    assert set(grads) == set(reference)
    for name, ref in reference.items():
        assert_close(grads[_clean(name)], ref, FP32_RTOL, name)


@pytest.mark.parametrize(("kind", "agg", "budget", "mode"), CASES)
def test_accumulated_gradient_equals_full_batch(results, kind, agg, budget, mode):
    _assert_matches(results[(kind, agg, budget, mode)]["grads"], results["reference"][(kind, agg)])


def test_token_budget_sets_the_microbatch_count(results):
    # Fixed size 2: rank 0 needs ceil(5/2) = 3, rank 1 needs 2 -> both run 3.
    assert results[("sft", "token-mean", 0, "deferred")]["n"] == 3
    budget_n = results[("sft", "token-mean", 40, "deferred")]["n"]
    assert budget_n >= 2  # ceil(tokens / 40) on the rank with more tokens


@pytest.mark.parametrize("mode", ["per_microbatch", "deferred"])
def test_one_sample_against_seven(results, mode):
    metrics = results[("lopsided", mode)]
    assert metrics["train/num_microbatches"] == 4  # ceil(7 / 2), also on the rank with one sample
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert metrics[f"comm/{kind}_count"] == metrics[f"comm/expected_{kind}_count"]
    grads, n = results[("lopsided_grads", mode)]
    assert n == 4
    _assert_matches(grads, results["lopsided_reference"])
