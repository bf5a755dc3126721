"""Each loss and advantage estimator against values computed by hand on tiny examples."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from syncwise.losses import Normalizer, aggregate
from syncwise.rl.algorithm.advantages import gae_advantages, grpo_advantages, rloo_advantages
from syncwise.rl.algorithm.losses import (
    PolicyLossConfig,
    ValueLossConfig,
    kl_penalty,
    make_policy_loss,
    make_value_loss,
    policy_token_losses,
    rollout_is_weights,
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
    assert result.metrics["critic/vf_clipfrac"].item() == pytest.approx(0.5)


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


def _reference_low_var_kl(log_prob: float, ref_log_prob: float) -> float:
    """verl 0.9.1 core_algos.kl_penalty("low_var_kl"), written out: kl = ref - logp clamped to ±20,
    k3 = e^kl - kl - 1 clamped to [-10, 10]."""
    kl = min(max(ref_log_prob - log_prob, -20.0), 20.0)
    return min(max(math.exp(kl) - kl - 1.0, -10.0), 10.0)


@pytest.mark.parametrize("d", [-50.0, -12.0, -3.0, -2.5, -1.0, -0.1, 0.0, 0.3, 2.0, 12.0, 50.0])
def test_k3_equals_the_reference_with_both_clamps(d):
    """d = log π - log π_ref: value as the reference; gradient zero where the value bound holds it at 10."""
    logp = torch.tensor([d], dtype=torch.float64, requires_grad=True)
    k3 = kl_penalty(logp, torch.zeros(1, dtype=torch.float64), "k3")
    assert k3.item() == pytest.approx(_reference_low_var_kl(d, 0.0), rel=1e-12)
    k3.sum().backward()
    bounded = math.exp(-max(d, -20.0)) + max(d, -20.0) - 1.0 >= 10.0
    expected_grad = 0.0 if bounded else 1.0 - math.exp(-d)
    assert logp.grad.item() == pytest.approx(expected_grad, rel=1e-12, abs=1e-15)


def test_k3_at_the_issue_points_and_without_the_value_bound():
    assert kl_penalty(torch.tensor([-3.0]), torch.zeros(1), "k3").item() == 10.0  # was 16.09
    assert kl_penalty(torch.tensor([-12.0]), torch.zeros(1), "k3").item() == 10.0  # was 22015
    # clamp=0: no value bound, the log-ratio still bounded at ±20 before exp
    assert kl_penalty(torch.tensor([-50.0]), torch.zeros(1), "k3", clamp=0).item() == pytest.approx(
        math.exp(20) - 20 - 1, rel=1e-6)


def test_ppo_log_ratio_is_bounded_before_exp():
    """log π - log π_old = 100 (exp overflows fp32): the ratio is e^20 like the reference's, loss finite."""
    logp = torch.tensor([[100.0, -100.0]], requires_grad=True)
    loss, _ = policy_token_losses(logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2),
                                  PolicyLossConfig(kind="ppo"))
    assert torch.isfinite(loss).all()
    assert loss[0, 0].item() == pytest.approx(math.exp(20), rel=1e-5)
    loss.sum().backward()
    assert logp.grad[0, 0].item() == 0.0  # beyond the bound: no gradient, as the reference's clamp gives


def test_gspo_sequence_log_ratio_is_capped_at_10():
    loss, _ = _ratio_case([math.exp(15.0), math.exp(13.0)], [-1.0, -1.0], kind="gspo")
    assert loss == pytest.approx([math.exp(10.0)] * 2, rel=1e-5)


AWKWARD = [0.1, 0.3, 0.7, 1 / 3, 2 / 3, 0.9, 1e-3, 123.456, -0.7, 1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_group_with_equal_rewards_gets_exactly_zero_advantage(dtype):
    for size in range(2, 65):
        for value in AWKWARD:
            rewards = torch.full((3 * size,), value, dtype=dtype)
            rewards[size : 2 * size] = torch.arange(size, dtype=dtype)  # one group with signal between them
            for adv in (grpo_advantages(rewards, size), grpo_advantages(rewards, size, norm_by_std=False),
                        rloo_advantages(rewards, size)):
                assert adv.dtype == torch.float32
                assert (adv[:size] == 0).all() and (adv[2 * size :] == 0).all(), (size, value)
                assert (adv[size : 2 * size] != 0).any()


def test_a_group_of_one_gets_zero_and_train_refuses_it():
    from syncwise.config import ConfigError, load_config

    assert grpo_advantages(torch.tensor([0.3, 0.9]), 1).tolist() == [0.0, 0.0]  # its own mean
    with pytest.raises(ConfigError, match="rl.samples_per_prompt=1: .*group of one has advantage 0"):
        load_config(None, ["rl.samples_per_prompt=1"])


def _is_batch(old: list[float], sampler: list[float]) -> tuple[dict, SimpleNamespace]:
    """One sequence of len(old) + 1 tokens, every target a response token, current = old (ratio 1)."""
    outputs = _outputs_for(old)
    batch = {
        "input_ids": torch.tensor([[0] + [1] * len(old)]),
        "old_log_probs": torch.tensor([old]),
        "rollout_log_probs": torch.tensor([sampler]),
        "advantages": torch.tensor([1.0]),
    }
    return batch, outputs


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_are_one_when_sampler_and_trainer_agree(level):
    old = [math.log(0.5), math.log(0.25), math.log(0.1)]
    batch, outputs = _is_batch(old, old)
    norm = Normalizer(tokens=3.0, sequences=1.0, dp_size=1)
    plain = make_policy_loss(PolicyLossConfig(kind="ppo"))(outputs, batch, norm)
    corrected = make_policy_loss(PolicyLossConfig(kind="ppo", rollout_is=level))(outputs, batch, norm)
    assert corrected.loss.item() == pytest.approx(plain.loss.item(), rel=1e-6)
    assert corrected.metrics["rollout/is_weight_mean"].item() == pytest.approx(1.0, rel=1e-6)
    assert corrected.metrics["rollout/is_weight_max"].item() == pytest.approx(1.0, rel=1e-6)
    assert corrected.metrics["rollout/is_capped_fraction"].item() == 0.0


def test_rollout_is_on_a_synthetic_mismatch_by_hand():
    """old - sampler = (0.5, -0.4, 1.2): token weights e^0.5, e^-0.4, 2 (capped); sequence weight
    e^{1.3} capped at 2 for every token. With ratio 1 and A = 1 each token's PPO loss is -1 and its
    gradient w.r.t. its log-prob -w, so the token-mean loss is -Σw/3 and d/d logp_j = -w_j/3."""
    old = [math.log(0.5), math.log(0.25), math.log(0.1)]
    sampler = [old[0] - 0.5, old[1] + 0.4, old[2] - 1.2]
    batch, _ = _is_batch(old, sampler)
    norm = Normalizer(tokens=3.0, sequences=1.0, dp_size=1)
    logp = torch.tensor([old], requires_grad=True)
    for level, weights, capped in (("token", [math.exp(0.5), math.exp(-0.4), 2.0], 1 / 3),
                                   ("sequence", [2.0, 2.0, 2.0], 1.0)):
        cfg = PolicyLossConfig(kind="ppo", rollout_is=level, rollout_is_cap=2.0)
        logp.grad = None
        token_loss, _ = policy_token_losses(logp, batch["old_log_probs"], torch.ones(1, 3), torch.ones(1, 3), cfg)
        w, c = rollout_is_weights(batch["old_log_probs"], batch["rollout_log_probs"], torch.ones(1, 3), level, 2.0)
        assert w[0].tolist() == pytest.approx(weights, rel=1e-6)
        (token_loss * w).mean().backward()
        assert logp.grad[0].tolist() == pytest.approx([-x / 3 for x in weights], rel=1e-6)
        # and through the whole loss function, from logits
        logits = _outputs_for(old).logits.requires_grad_()
        result = make_policy_loss(cfg)(SimpleNamespace(logits=logits), batch, norm)
        assert result.loss.item() == pytest.approx(-sum(weights) / 3, rel=1e-5)
        assert result.metrics["rollout/is_weight_mean"].item() == pytest.approx(sum(weights) / 3, rel=1e-6)
        assert result.metrics["rollout/is_weight_max"].item() == pytest.approx(max(weights), rel=1e-6)
        assert result.metrics["rollout/is_capped_fraction"].item() == pytest.approx(capped, rel=1e-6)
        result.loss.backward()
        # d loss / d logit of target token 1 at position j = -w_j/3 * (1 - p_j)
        probs = [math.exp(x) for x in old]
        got = logits.grad[0, :3, 1].tolist()
        assert got == pytest.approx([-w_j / 3 * (1 - p) for w_j, p in zip(weights, probs, strict=True)], rel=1e-5)


def test_rollout_is_without_the_sampler_log_probs_names_the_key():
    from syncwise.data.batching import BatchError

    batch, outputs = _is_batch([math.log(0.5)], [math.log(0.5)])
    del batch["rollout_log_probs"]
    with pytest.raises(BatchError, match=r"batch\['rollout_log_probs'\]: rl.loss.rollout_is=token"):
        make_policy_loss(PolicyLossConfig(rollout_is="token"))(outputs, batch, Normalizer(1.0, 1.0, 1))


def test_ppo_kl_is_the_mean_of_old_minus_new():
    old = [math.log(0.5), math.log(0.25)]
    batch, outputs = _is_batch(old, old)
    batch["old_log_probs"] = torch.tensor([[old[0] + 0.3, old[1] - 0.1]])
    result = make_policy_loss(PolicyLossConfig())(outputs, batch, Normalizer(2.0, 1.0, 1))
    assert result.metrics["actor/ppo_kl"].item() == pytest.approx((0.3 - 0.1) / 2, rel=1e-5)
    assert result.metrics["actor/approx_kl"].item() == pytest.approx((0.09 + 0.01) / 2 / 2, rel=1e-5)


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


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_reward_names_the_reward_function(bad):
    from syncwise.rl.env.scoring import RewardFunction, score

    reward = RewardFunction("f", "rl.reward_fn", lambda prompt, response, row: bad)
    with pytest.raises(ValueError, match=r"rl.reward_fn: returned (nan|inf) \(prompt 'target 3 :', response '7'\); "
                                         r"a reward must be a finite number"):
        score([reward], ["target 3 :"], ["7"], [{"prompt": "target 3 :"}])


def _three_policy_case(seed: int = 0):
    """Random logits, a proximal policy off the current one (the PPO clip acts) and a behaviour policy off the
    proximal one (some tokens' ratios outside [1/2, 2]), a prompt left out of the loss."""
    g = torch.Generator().manual_seed(seed)
    b, t, vocab = 3, 7, 6
    logits = torch.randn(b, t, vocab, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, vocab, (b, t), generator=g)
    current = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    proximal = current + 0.3 * torch.randn(b, t - 1, generator=g, dtype=torch.float64)
    behavior = proximal + 0.8 * torch.randn(b, t - 1, generator=g, dtype=torch.float64)
    loss_mask = torch.ones(b, t, dtype=torch.long)
    loss_mask[:, :2] = 0
    loss_mask[2, 5:] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "old_log_probs": proximal.float(),
             "rollout_log_probs": behavior.float(), "advantages": torch.randn(b, generator=g)}
    return logits, batch


def _three_policy_reference(logits, batch, mode, level, cap, clip_low=0.2, clip_high=0.28):
    """AReaL's decoupled PPO and verl's truncated / masked IS, written out in float64 from their definitions."""
    logits = logits.detach().double().requires_grad_()
    ids = batch["input_ids"]
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    prox, behav = batch["old_log_probs"].double(), batch["rollout_log_probs"].double()
    mask = batch["loss_mask"][:, 1:].double()
    adv = batch["advantages"].double()[:, None]
    ratio = torch.exp(logp - prox)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    log_w = (prox - behav) * mask
    if level == "sequence":
        log_w = log_w.sum(1, keepdim=True).expand_as(log_w)
    w = torch.exp(log_w)
    if mode == "tis":
        w = w.clamp(max=cap)
    elif mode == "decoupled":
        w = torch.where(w > cap, 0.0, w)
    else:
        w = torch.where((w > cap) | (w < 1 / cap), 0.0, w)
    loss = (pg * w * mask).sum() / mask.sum()
    loss.backward()
    return loss.item(), logits.grad, ((w.log().abs() > math.log(cap)) * mask).sum().item() / mask.sum().item()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["decoupled", "tis", "mis"])
def test_the_three_policy_loss_equals_a_float64_reference(mode, level):
    for seed in range(3):
        logits, batch = _three_policy_case(seed)
        cap = 2.0
        want, want_grad, _ = _three_policy_reference(logits, batch, mode, level, cap)
        x = logits.float().requires_grad_()
        mask = batch["loss_mask"][:, 1:]
        norm = Normalizer(tokens=float(mask.sum()), sequences=3.0, dp_size=1)
        cfg = PolicyLossConfig(kind="ppo", off_policy=mode, behavior_level=level, behavior_cap=cap, rollout_is="none")
        result = make_policy_loss(cfg)(SimpleNamespace(logits=x), batch, norm)
        result.loss.backward()
        assert result.loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(x.grad.double(), want_grad, rtol=1e-4, atol=1e-6)
        if level == "token":  # the fraction of tokens whose ratio leaves [1/cap, cap]: some, not all
            band = ((batch["old_log_probs"] - batch["rollout_log_probs"]).abs() > math.log(cap)).float() * mask
            fraction = result.metrics["rollout/behavior_out_of_band"].item()
            assert fraction == pytest.approx(band.sum().item() / mask.sum().item(), rel=1e-6)
            assert 0 < fraction < 1


@pytest.mark.parametrize("mode", ["decoupled", "tis", "mis", "none"])
def test_with_behaviour_equal_to_proximal_every_three_policy_loss_is_ppo(mode):
    logits, batch = _three_policy_case(5)
    batch["rollout_log_probs"] = batch["old_log_probs"].clone()
    norm = Normalizer(tokens=float(batch["loss_mask"][:, 1:].sum()), sequences=3.0, dp_size=1)
    results = []
    for off_policy in ("none", mode):
        x = logits.float().requires_grad_()
        cfg = PolicyLossConfig(kind="ppo", off_policy=off_policy, rollout_is="none")
        out = make_policy_loss(cfg)(SimpleNamespace(logits=x), batch, norm)
        out.loss.backward()
        results.append((out, x.grad))
    (ppo, ppo_grad), (other, other_grad) = results
    assert other.loss.item() == pytest.approx(ppo.loss.item(), rel=1e-6)
    torch.testing.assert_close(other_grad, ppo_grad, rtol=1e-6, atol=1e-8)
    if mode != "none":
        assert other.metrics["rollout/behavior_weight_mean"].item() == pytest.approx(1.0, rel=1e-6)
        assert other.metrics["rollout/behavior_out_of_band"].item() == 0.0
        assert abs(other.metrics["rollout/mismatch_kl"].item()) < 1e-7


def test_mismatch_kl_is_k3_of_behaviour_against_proximal():
    """KL(behaviour || proximal) estimated on the behaviour policy's tokens: with r = proximal / behaviour,
    k3 = r - 1 - log r per token (>= 0), here for log r = 0.5 and -0.4: (e^0.5 - 1.5 + e^-0.4 - 0.6) / 2."""
    old = [math.log(0.5), math.log(0.25)]
    batch, outputs = _is_batch(old, [old[0] - 0.5, old[1] + 0.4])
    out = make_policy_loss(PolicyLossConfig(off_policy="tis", rollout_is="none"))(
        outputs, batch, Normalizer(tokens=2.0, sequences=1.0, dp_size=1))
    want = (math.exp(0.5) - 1.5 + math.exp(-0.4) - 0.6) / 2
    assert out.metrics["rollout/mismatch_kl"].item() == pytest.approx(want, rel=1e-6)
    assert out.metrics["rollout/behavior_weight_mean"].item() == pytest.approx((math.exp(0.5) + math.exp(-0.4)) / 2)


def test_off_policy_without_the_sampler_log_probs_names_the_key():
    from syncwise.data.batching import BatchError

    batch, outputs = _is_batch([math.log(0.5)], [math.log(0.5)])
    del batch["rollout_log_probs"]
    with pytest.raises(BatchError, match=r"batch\['rollout_log_probs'\]: rl.loss.off_policy=decoupled"):
        make_policy_loss(PolicyLossConfig(off_policy="decoupled"))(outputs, batch, Normalizer(1.0, 1.0, 1))


@pytest.mark.parametrize(("overrides", "off_policy", "rollout_is"), [
    ([], "none", "none"),  # synchronous: today's loss
    (["rl.off_policy_lag=1"], "decoupled", "none"),
    (["rl.off_policy_lag=1", "rl.rollout_engine=vllm"], "decoupled", "none"),  # its weight covers the sampler's
    (["rl.rollout_engine=vllm"], "none", "token"),
    (["rl.off_policy_lag=1", "rl.loss.rollout_is=token"], "none", "token"),  # set by hand: kept
    (["rl.loss.off_policy=mis"], "mis", "none"),
])
def test_off_policy_auto_is_decoupled_for_a_lagged_job(overrides, off_policy, rollout_is):
    from syncwise.config import load_config

    loss = load_config(None, overrides).rl.loss
    assert (loss.off_policy, loss.rollout_is) == (off_policy, rollout_is)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rl.loss.off_policy=tis", "rl.loss.rollout_is=token"],
     "rl.loss.off_policy=tis with rl.loss.rollout_is=token: both weight tokens by the sampler's log-probs; use one"),
    (["rl.loss.behavior_cap=1"], "rl.loss.behavior_cap: must be > 1 (the band is [1/cap, cap]), got 1"),
    (["rl.loss.off_policy=areal"], "rl.loss.off_policy: 'areal' is not one of auto, none, decoupled, tis, mis"),
    (["rl.off_policy_lag=-1"], "rl.off_policy_lag"),
])
def test_bad_off_policy_settings_name_the_key(overrides, message):
    from syncwise.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)
