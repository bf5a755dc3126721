"""Each loss and advantage estimator against values computed by hand on tiny examples."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from syncwise.losses import Normalizer, aggregate
from syncwise.rl.advantages import gae_advantages, grpo_advantages, rloo_advantages
from syncwise.rl.losses import (
    PolicyLossConfig,
    ValueLossConfig,
    kl_penalty,
    make_policy_loss,
    make_value_loss,
    policy_token_losses,
)

NORM = Normalizer(tokens=5.0, sequences=2.0, dp_size=1, max_target_len=3.0)
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4 + 5) / 5),
        ("seq-mean-token-sum", (6 + 9) / 2),
        ("seq-mean-token-mean", (2 + 4.5) / 2),
        ("seq-mean-token-sum-norm", 15 / (2 * 3)),
    ],
)
def test_aggregation_modes(mode, expected):
    assert aggregate(VALUES, MASK, mode, NORM).item() == pytest.approx(expected)


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log_r = math.log(2.0)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(log_r)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + log_r - 1)


def _ratio_case(ratios, advantages, kind="ppo", **kw):
    old = torch.zeros(1, len(ratios))
    logp = torch.log(torch.tensor([ratios]))
    adv = torch.tensor([advantages])
    mask = torch.ones(1, len(ratios))
    loss, clipped = policy_token_losses(logp, old, adv, mask, PolicyLossConfig(kind=kind, **kw))
    return loss[0].tolist(), clipped[0].tolist()


def test_ppo_clip_with_separate_low_and_high():
    # A > 0: ratio 1.5 is clipped at 1 + 0.28; A < 0: ratio 0.5 is clipped at 1 - 0.2.
    loss, clipped = _ratio_case([1.5, 1.1, 0.5, 0.9], [1.0, 1.0, -1.0, -1.0], clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx([-1.28, -1.1, 0.8, 0.9])
    assert clipped == [1.0, 0.0, 1.0, 0.0]


def test_ppo_dual_clip_caps_negative_advantages():
    loss, clipped = _ratio_case([5.0, 2.0], [-1.0, -1.0], dual_clip=3.0)
    assert loss == pytest.approx([3.0, 2.0])  # 5 * 1 capped at 3; 2 below the cap
    assert clipped == [1.0, 0.0]


def test_gspo_uses_the_sequence_ratio():
    # Sequence ratio = exp(mean(log 2, log 0.5)) = 1: no token is clipped although 2 and 0.5 would be.
    loss, clipped = _ratio_case([2.0, 0.5], [1.0, 1.0], kind="gspo")
    assert loss == pytest.approx([-1.0, -1.0])
    assert clipped == [0.0, 0.0]


def test_pg_and_cispo():
    loss, _ = _ratio_case([0.5, 2.0], [2.0, -1.0], kind="pg")
    assert loss == pytest.approx([-2.0 * math.log(0.5), 1.0 * math.log(2.0)])
    loss, clipped = _ratio_case([2.0, 1.1], [1.0, 1.0], kind="cispo", clip_high=0.2)
    assert loss == pytest.approx([-1.2 * math.log(2.0), -1.1 * math.log(1.1)])
    assert clipped == [1.0, 0.0]


def test_cispo_gradient_flows_through_log_prob_only():
    logp = torch.log(torch.tensor([[2.0]])).requires_grad_()
    loss, _ = policy_token_losses(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                                  PolicyLossConfig(kind="cispo", clip_high=0.2))
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(-1.2)  # -clip(w) * A, weight detached


def _outputs_for(log_probs_of_targets: list[float], vocab: int = 4):
    """Logits whose log-softmax gives exactly the wanted log-prob on target token 1 at each position."""
    rows = []
    for lp in log_probs_of_targets:
        p = math.exp(lp)
        rest = (1 - p) / (vocab - 1)
        rows.append([math.log(rest), math.log(p)] + [math.log(rest)] * (vocab - 2))
    logits = torch.tensor([rows + [[0.0] * vocab]])  # the last position predicts nothing
    return SimpleNamespace(logits=logits)


def test_policy_loss_end_to_end_with_entropy_and_kl():
    outputs = _outputs_for([math.log(0.5), math.log(0.25)])
    batch = {
        "input_ids": torch.tensor([[0, 1, 1]]),
        "loss_mask": torch.tensor([[0, 1, 1]]),
        "old_log_probs": torch.tensor([[math.log(0.5), math.log(0.5)]]),
        "advantages": torch.tensor([2.0]),
        "ref_log_probs": torch.tensor([[math.log(0.5), math.log(0.5)]]),
    }
    norm = Normalizer(tokens=2.0, sequences=1.0, dp_size=1)
    cfg = PolicyLossConfig(kind="ppo", entropy_coef=0.1, kl_coef=0.5, kl_estimator="k3")
    result = make_policy_loss(cfg)(outputs, batch, norm)
    # ratios 1 and 0.5 (clipped to 0.8 but max(-2*0.5, -2*0.8) = -1.0 keeps the unclipped one)
    pg = (-2.0 * 1.0 + -2.0 * 0.5) / 2
    ent = lambda p: -(p * math.log(p) + 3 * ((1 - p) / 3) * math.log((1 - p) / 3))  # noqa: E731
    entropy = (ent(0.5) + ent(0.25)) / 2
    kl = (0.0 + (2.0 + math.log(0.5) - 1)) / 2  # k3 with log r = 0 and log r = log(0.5)
    assert result.metrics["actor/pg_loss"].item() == pytest.approx(pg)
    assert result.metrics["actor/entropy"].item() == pytest.approx(entropy, rel=1e-5)
    assert result.metrics["actor/kl_loss"].item() == pytest.approx(kl)
    assert result.loss.item() == pytest.approx(pg - 0.1 * entropy + 0.5 * kl, rel=1e-5)
    assert result.metrics["actor/clip_fraction"].item() == 0.0


def test_value_loss_clipping():
    outputs = SimpleNamespace(logits=torch.tensor([[[1.0], [3.0], [0.0]]]))
    batch = {
        "input_ids": torch.zeros(1, 3, dtype=torch.long),
        "returns": torch.tensor([[2.0, 2.0]]),
        "values": torch.tensor([[0.5, 2.5]]),
    }
    result = make_value_loss(ValueLossConfig(clip=0.2))(outputs, batch, Normalizer(2.0, 1.0, 1))
    # pos 0: V=1, clipped V=0.7 -> max((1-2)^2, (0.7-2)^2) = 1.69; pos 1: V=3, clipped 2.7 -> max(1, 0.49) = 1
    assert result.metrics["critic/vf_loss"].item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert result.metrics["critic/vf_clip_fraction"].item() == pytest.approx(0.5)


def test_grpo_dr_grpo_and_rloo_on_a_hand_made_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    std = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    grpo = grpo_advantages(rewards, group_size=4)
    assert grpo[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert grpo[4:].tolist() == pytest.approx([0.0] * 4)  # a group that all scored alike teaches nothing
    assert grpo_advantages(rewards, 4, norm_by_std=False)[:4].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    rloo = rloo_advantages(rewards, 4)
    assert rloo[:4].tolist() == pytest.approx([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3])
    with pytest.raises(ValueError, match="multiple of the group size"):
        grpo_advantages(rewards[:7], 4)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.9]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last position is padding: skipped
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    d2 = 1.0 + 0.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    assert adv[0, :3].tolist() == pytest.approx([a0, a1, a2])
    assert adv[0, 3].item() == 0.0
    assert ret[0, :3].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7])


def test_cispo_bounds_the_weight_from_above_only():
    """MiniMax-M1: a weight below 1 - ε_low is kept as it is (the paper sets no lower bound)."""
    loss, clipped = _ratio_case([0.5, 1.5], [1.0, 1.0], kind="cispo", clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx([-0.5 * math.log(0.5), -1.28 * math.log(1.5)])
    assert clipped == [0.0, 1.0]


def test_k3_log_ratio_is_clamped_before_exp():
    logp, ref = torch.tensor([0.0]), torch.tensor([-50.0])  # log r = ±50: e^{50} for the reverse order
    assert kl_penalty(logp, ref, "k3", clamp=10.0).item() == pytest.approx(math.exp(-10) + 10 - 1)
    assert kl_penalty(ref, logp, "k3", clamp=10.0).item() == pytest.approx(math.exp(10) - 10 - 1)
    assert kl_penalty(ref, logp, "k3").item() == pytest.approx(math.exp(50) - 50 - 1, rel=1e-5)  # unclamped


def test_policy_loss_uses_the_sampling_temperature_and_reports_the_ratio():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 6)
    ids = torch.tensor([[0, 3, 1, 5]])
    temperature = 0.6
    expected = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    old = expected + torch.tensor([[0.0, 0.1, -0.2]])  # ratios 1, e^-0.1, e^0.2
    batch = {"input_ids": ids, "old_log_probs": old, "advantages": torch.tensor([1.0])}
    norm = Normalizer(tokens=3.0, sequences=1.0, dp_size=1)
    result = make_policy_loss(PolicyLossConfig(kind="ppo"), temperature=temperature)(
        SimpleNamespace(logits=logits), batch, norm)
    assert torch.allclose(result.outputs["log_probs"], expected, atol=1e-6)
    ratios = [1.0, math.exp(-0.1), math.exp(0.2)]
    assert result.metrics["actor/ratio_mean"].item() == pytest.approx(sum(ratios) / 3, rel=1e-5)
    assert result.metrics["actor/ratio_max"].item() == pytest.approx(math.exp(0.2), rel=1e-5)
    assert result.metrics["actor/approx_kl"].item() == pytest.approx((0.01 + 0.04) / 2 / 3, rel=1e-4)
