"""``rl.balance_ranks`` and ``rl.skip_uniform_groups`` on 2 gloo ranks: samples move so each rank's real
tokens are within 5% of the mean, every sample is trained exactly once, and the gradient equals the
unbalanced batch's; groups whose rewards are all equal are left out and the gradient is the full batch's
over the samples that train."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from numerics import assert_all_close
from scenarios_balance import GROUP, balance_suite
from syncwise.data.partition import karmarkar_karp
from syncwise.rl.algorithm.advantages import uniform_groups


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(balance_suite, 2)


def _rows(batch: dict) -> set[tuple]:
    """Each sample as a hashable row: its real tokens, advantage and sampler log-probs."""
    out = set()
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        out.add((tuple(batch["input_ids"][i, :n].tolist()), tuple(batch["loss_mask"][i, :n].tolist()),
                 round(float(batch["advantages"][i]), 6),
                 tuple(round(x, 6) for x in batch["rollout_log_probs"][i, : n - 1].tolist())))
    return out


def test_balanced_ranks_hold_every_sample_once_within_5_percent(ranks):
    before = [r["balance"]["batch"] for r in ranks]
    after = [r["balance"]["balanced"] for r in ranks]
    assert _rows(after[0]) | _rows(after[1]) == _rows(before[0]) | _rows(before[1])
    assert sum(b["input_ids"].shape[0] for b in after) == sum(b["input_ids"].shape[0] for b in before)
    tokens = [float(b["attention_mask"].sum()) for b in after]
    stats = ranks[0]["balance"]["stats"]
    assert stats == ranks[1]["balance"]["stats"]  # agreed
    assert stats.before > 1.5  # the skew this scenario builds
    assert max(tokens) / (sum(tokens) / 2) == pytest.approx(stats.after) and stats.after <= 1.05
    assert stats.moved > 0
    for b in after:  # trimmed to the longest row it holds, right-padded as it came
        assert int(b["attention_mask"].sum(dim=1).max()) == b["input_ids"].shape[1]
        assert b["rollout_log_probs"].shape[1] == b["input_ids"].shape[1] - 1


def test_balanced_gradient_equals_the_unbalanced_one(ranks):
    grads = ranks[0]["balance"]
    assert_all_close(grads["balanced_grads"], grads["grads"], what="balanced vs unbalanced")
    assert any(g.abs().max() > 0 for g in grads["grads"].values())


def test_balance_refused_when_a_rank_would_get_too_few_rows_or_nothing_improves(ranks):
    for stats in (ranks[0]["refused"], ranks[0]["again"]):
        assert stats.moved == 0 and stats.after == stats.before


def test_balance_refused_below_the_minimum_gain(ranks):
    """rl.balance_min_gain: a gain smaller than asked for moves nothing (the batch stays as it is)."""
    for rank in ranks:
        assert rank["small_gain"].moved == 0 and rank["small_gain"].before > 1.5 and rank["small_gain_kept"]


def test_karmarkar_karp_on_a_long_tail_beats_5_percent():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lengths = (5 + torch.distributions.Exponential(1 / 30.0).sample((256,))).tolist()
    for k in (2, 4, 8):
        sums = [sum(lengths[i] for i in part) for part in karmarkar_karp(lengths, k)]
        assert max(sums) / (sum(sums) / k) <= 1.05, (k, sums)


def test_uniform_groups_are_found():
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.5, 0.5])
    assert uniform_groups(rewards, GROUP).tolist() == [True, False, True]


def test_uniform_groups_left_out_and_gradient_is_the_full_batch_one_over_the_rest(ranks):
    r0, r1 = ranks[0]["skip"], ranks[1]["skip"]
    assert (r0["uniform_groups"], r0["groups"], r1["uniform_groups"], r1["groups"]) == (4, 8, 8, 8)
    assert r0["rows"].tolist() == [i for g in (1, 3, 5, 7) for i in range(g * GROUP, (g + 1) * GROUP)]
    assert not r0["masked"].any()
    assert r1["rows"].tolist() == [0] and r1["masked"].tolist() == [True]  # one row, so rank 1 still steps
    assert int(r1["selected"]["loss_mask"].sum()) == 0
    # Uniform groups have zero advantages: they add nothing to the gradient's sum, only to the token count
    # it is divided by (token-mean over the global batch). So grad_selected * N_selected = grad_all * N_all.
    n_all = sum(float(r["batch"]["loss_mask"][:, 1:].sum()) for r in (r0, r1))
    n_selected = sum(float(r["selected"]["loss_mask"][:, 1:].sum()) for r in (r0, r1))
    assert n_selected < n_all
    scaled = {k: g * n_selected for k, g in r0["selected_grads"].items()}
    assert_all_close(scaled, {k: g * n_all for k, g in r0["grads"].items()}, what="skip uniform groups")


def test_no_group_with_signal_anywhere_trains_everything(ranks):
    for r in ranks:
        assert r["all_uniform"]["rows"].tolist() == list(range(2 * GROUP)) and not r["all_uniform"]["masked"].any()
