"""PPO with a critic (issue 31): token rewards, GAE and whitening equal the reference engine's functions
across ranks and micro-batches; the critic's gradients are the same in every sync mode and equal a
single-process full-batch reference; collective counts as each mode's formula."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from numerics import assert_all_close, assert_close
from scenarios_ppo import CRITIC_MODES, critic_auto_with_held_bytes, plain_values, ppo_suite
from syncwise.losses import target_mask
from syncwise.rl.algorithm.ppo import token_rewards

UNITS = 3  # qwen2-test: two decoder layers + root


@pytest.fixture(scope="module")
def w2():
    return run_distributed(ppo_suite, 2)


# --- the reference engine's functions (verl 0.9.1, core_algos / torch_functional), written out ------------
def _verl_masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def _verl_masked_whiten(values, mask):
    mean = _verl_masked_mean(values, mask)
    var = _verl_masked_mean((values - mean) ** 2, mask)
    var = var * (mask.sum() / (mask.sum() - 1))  # unbiased
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues, lastgaelam, advantages_reversed = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return _verl_masked_whiten(advantages, response_mask), returns


def _responses(tensor: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T-1] per-target values as the reference lays them out: each row's response tokens from column 0
    (bs, response_length), and that layout's mask."""
    rows = [tensor[i][mask[i] > 0] for i in range(len(tensor))]
    width = max(len(r) for r in rows)
    out = torch.zeros(len(rows), width, dtype=tensor.dtype)
    out_mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)], out_mask[i, : len(r)] = r, 1
    return out, out_mask


def test_token_rewards_put_the_score_on_the_last_response_token_and_subtract_the_kl():
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    kl = torch.full((3, 5), 0.5)
    out = token_rewards(torch.tensor([2.0, -1.0, 7.0]), mask, kl, kl_coef=0.1)
    expected = torch.tensor([[0, -0.05, -0.05, 2 - 0.05, 0], [0, 0, -1 - 0.05, 0, 0], [0] * 5])
    assert_close(out, expected, what="token rewards")


def test_values_through_the_engine_equal_a_plain_forward(w2):
    """Packed micro-batches of 2 on each rank give the values one plain padded forward gives."""
    batches = [rank["gae"]["batch"] for rank in w2]
    mask = torch.cat([target_mask(b) for b in batches])
    got = torch.cat([b["values"] for b in batches])
    assert_close(got * mask, plain_values(batches) * mask, what="values")


def test_whitened_gae_equals_the_reference_over_both_ranks(w2):
    """Each rank's GAE over its rows, whitened with both ranks' statistics, equals the reference's
    compute_gae_advantage_return + masked_whiten over the whole batch in its response layout."""
    batches = [rank["gae"]["batch"] for rank in w2]
    mask = torch.cat([target_mask(b) for b in batches])
    values = torch.cat([b["values"] for b in batches]) * mask
    rewards = token_rewards(torch.cat([b["rewards"] for b in batches]), mask)
    ref_rewards, resp_mask = _responses(rewards, mask)
    ref_values, _ = _responses(values, mask)
    ref_adv, ref_ret = _verl_gae(ref_rewards.double(), ref_values.double(), resp_mask.double(), 0.95, 0.9)
    adv, _ = _responses(torch.cat([rank["gae"]["advantages"] for rank in w2]), mask)
    ret, _ = _responses(torch.cat([rank["gae"]["returns"] for rank in w2]), mask)
    assert_close(adv * resp_mask, ref_adv * resp_mask, what="advantages")
    assert_close(ret * resp_mask, ref_ret * resp_mask, what="returns")
    # the critic's metrics: the same on both ranks, and the whitened advantages' mean is 0
    assert w2[0]["gae"]["metrics"] == w2[1]["gae"]["metrics"]
    assert abs(w2[0]["gae"]["metrics"]["critic/advantages_mean"]) < 1e-6
    assert w2[0]["gae"]["metrics"]["critic/returns_mean"] == pytest.approx(
        float((ref_ret * resp_mask).sum() / resp_mask.sum()), rel=1e-5)


@pytest.mark.parametrize("name", list(CRITIC_MODES))
def test_critic_gradients_match_per_microbatch_and_the_full_batch(w2, name):
    got = w2[0][("critic", name)]
    assert got["value_head"] and got["packing"] and not got["fused_head"]
    assert_all_close(got["grads"], w2[0][("critic", "per_microbatch")]["grads"], what=name)
    assert_all_close(got["grads"], w2[0]["reference_grads"], what=f"{name} vs full batch")
    assert any(float(g.abs().max()) > 0 for k, g in got["grads"].items() if "layers" in k)  # the decoder learns


@pytest.mark.parametrize("name", list(CRITIC_MODES))
def test_critic_collectives_equal_the_mode_formula(w2, name):
    m = w2[0][("critic", name)]["metrics"]
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert m[f"comm/{kind}_count"] == m[f"comm/expected_{kind}_count"], kind
    expected_rs = {"per_microbatch": 3 * UNITS, "deferred": UNITS, "deferred_unsharded": UNITS}
    if name in expected_rs:
        assert m["comm/reduce_scatter_count"] == expected_rs[name]
    assert m["critic/vf_loss"] > 0 and 0 <= m["critic/vf_clipfrac"] <= 1


def test_critic_auto_budgets_with_what_is_held_outside_and_ranks_agree():
    """The bytes held beside the critic (on one rank only) move auto's choice down, on both ranks alike."""
    ranks = run_distributed(critic_auto_with_held_bytes, 2)
    assert ranks[0] == ranks[1]
    assert ranks[0]["ample"] == ranks[0]["free"] == "deferred_unsharded"
    assert ranks[0]["held"] != "deferred_unsharded"
