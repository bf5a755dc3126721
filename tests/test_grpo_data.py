"""GRPO on a user's model and prompts (issue 30): prompts through the chat template and fitted to
rl.max_prompt_length, truncated sampling whose log-probs are of the distribution drawn from (chi-square on
the compact sampler), end tokens and stop strings, reward functions as users write them, and bad prompts
stopped at load with one line."""

from __future__ import annotations

import math

import pytest
import torch

from syncwise.config import load_config
from syncwise.rl.env.prompts import encode_prompts
from syncwise.rl.env.scoring import load_reward_fn, reward_functions, score
from syncwise.rl.env.tasks import DATASET_MAX_NEW_TOKENS, load_dataset, prompt_source
from syncwise.rl.rollout.base import StopStrings
from syncwise.rl.rollout.compact import Truncation, sample, truncated_log_probs
from syncwise.sft.tasks import arith_chat_rows, chat_tokenizer


@pytest.fixture(scope="module")
def chat():
    rows = arith_chat_rows(200, seed=5)
    return chat_tokenizer(rows), rows


def test_truncation_keeps_the_tokens_each_rule_keeps():
    log_p = torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]).log()
    kept = lambda cut: (truncated_log_probs(log_p, cut).exp() > 0).sum().item()  # noqa: E731
    assert kept(Truncation(top_k=2)) == 2
    assert kept(Truncation(top_p=0.7)) == 2 and kept(Truncation(top_p=0.76)) == 3  # mass before reaches p
    assert kept(Truncation(min_p=0.2)) == 3  # at least 0.2 x 0.5
    out = truncated_log_probs(log_p, Truncation(top_k=3)).exp()[0]
    assert torch.allclose(out[:3], torch.tensor([0.5, 0.25, 0.15]) / 0.9) and out[3:].sum() == 0
    assert torch.equal(truncated_log_probs(log_p, Truncation()), log_p)


def test_compact_sampler_draws_from_the_truncated_distribution():
    """2,000 first tokens of one prompt with top-k 6 and top-p 0.9 at T 0.8: their frequencies against the
    truncated distribution (chi-square, fixed model and seed), and every drawn log-prob is that
    distribution's."""
    from syncwise.config import ModelConfig
    from syncwise.models import build_model

    model = build_model(ModelConfig(preset="llama-test", seed=3), vocab_size=32).eval()
    prompt = torch.tensor([3, 7, 11])
    cut = Truncation(top_k=6, top_p=0.9)
    with torch.no_grad():
        logits = model(input_ids=prompt[None]).logits[0, -1].float()
    want = truncated_log_probs((logits / 0.8).log_softmax(-1)[None], cut)[0]
    torch.manual_seed(0)
    out = sample(model, [prompt], 2000, 1, 0.8, [0], 0, cut)
    first = torch.stack([t[0] for t in out.tokens])
    drawn = torch.stack([lp[0] for lp in out.log_probs])
    assert torch.allclose(drawn, want[first], atol=1e-5)
    full = torch.stack([lp[0] for lp in out.full_log_probs])  # the untruncated distribution's, as the trainer's
    assert torch.allclose(full, (logits / 0.8).log_softmax(-1)[first], atol=1e-5)
    support = (want > -math.inf).nonzero().squeeze(1)
    assert 2 <= len(support) <= 6 and set(first.tolist()) <= set(support.tolist())
    counts = torch.bincount(first, minlength=32)[support].double()
    expected = want[support].exp().double() * len(first)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((len(support) - 1) / 2.0), torch.tensor(chi2 / 2.0)))
    assert p_value > 1e-3, (chi2, counts.tolist(), expected.tolist())


def test_any_end_token_or_stop_string_ends_a_response(chat):
    tokenizer, _ = chat
    stop = StopStrings(["####"], tokenizer)
    assert stop.hit(tokenizer("so it is 7.\n####")["input_ids"]) and not stop.hit(tokenizer("so 7")["input_ids"])
    from syncwise.config import ModelConfig
    from syncwise.models import build_model

    model = build_model(ModelConfig(preset="llama-test"), vocab_size=len(tokenizer)).eval()
    torch.manual_seed(1)
    plain = sample(model, [torch.tensor([5, 6])], 32, 12, 1.0, [tokenizer.eos_token_id], 0)
    seen = {int(t) for tokens in plain.tokens for t in tokens[:-1]}
    torch.manual_seed(1)
    ends = sorted(seen)[:3]  # tokens the plain run drew mid-response now end it
    short = sample(model, [torch.tensor([5, 6])], 32, 12, 1.0, [tokenizer.eos_token_id, *ends], 0)
    for tokens, ended in zip(short.tokens, short.ended, strict=True):
        hits = [i for i, t in enumerate(tokens.tolist()) if t in ends or t == tokenizer.eos_token_id]
        assert (hits == [len(tokens) - 1]) if ended else (not hits and len(tokens) == 12)


def test_chat_prompts_through_the_template_and_fitted_to_the_limit(chat):
    tokenizer, rows = chat
    cfg = load_config(None, ["rl.max_prompt_length=40"]).rl
    messages = [{"prompt": r["messages"][:2]} for r in rows[:4]]
    encoded = encode_prompts(messages, None, "p.jsonl", cfg, tokenizer)
    whole = tokenizer.apply_chat_template(rows[0]["messages"][:2], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
    assert encoded.ids[0] == whole[-40:] and encoded.truncated == 4 and encoded.templated
    assert tokenizer.decode(encoded.ids[0]).endswith("<|im_start|>assistant\n")  # the end is kept
    plain = encode_prompts([{"prompt": "3 + 4 ="}], None, "p", load_config(None, []).rl, tokenizer)
    assert plain.ids[0] == tokenizer("3 + 4 =")["input_ids"] and not plain.templated  # auto: strings as they are
    wrapped = encode_prompts([{"prompt": "3 + 4 ="}], None, "p", load_config(None, ["rl.chat_template=true"]).rl,
                             tokenizer)
    assert wrapped.ids[0] == tokenizer.apply_chat_template([{"role": "user", "content": "3 + 4 ="}], tokenize=True,
                                                           add_generation_prompt=True, return_dict=True)["input_ids"]
    dropped = encode_prompts(messages + [{"prompt": "short"}], None, "p", load_config(
        None, ["rl.max_prompt_length=40", "rl.prompt_overflow=drop"]).rl, tokenizer)
    assert dropped.kept == [4] and dropped.dropped == 4
    with pytest.raises(ValueError, match=r"rl.dataset: p.jsonl line 7: the prompt has \d+ tokens, more than "
                                         r"rl.max_prompt_length=40"):
        encode_prompts(messages[:1], ["line 7"], "p.jsonl",
                       load_config(None, ["rl.max_prompt_length=40", "rl.prompt_overflow=error"]).rl, tokenizer)
    with pytest.raises(ValueError, match="is a list of messages, but rl.chat_template=false"):
        encode_prompts(messages[:1], None, "p", load_config(None, ["rl.chat_template=false"]).rl, tokenizer)


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": ""}', "line 2 has an empty 'prompt'"),
    ('{"question": "x"}', "line 2 has no 'prompt'"),
    ('{"prompt": []}', r"line 2 has an empty 'prompt' \(no messages\)"),
    ('{"prompt": [{"role": "user"}]}', r"line 2 has 'prompt'\[0\] that is not a"),
    ('{"prompt": 3}', "line 2 has a 'prompt' of type int"),
])
def test_bad_prompts_are_named_at_load(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"rl.dataset: {path} {message}"):
        load_dataset(str(path))


def test_a_dataset_samples_256_tokens_unless_told():
    assert DATASET_MAX_NEW_TOKENS == 256
    assert prompt_source("target", None, None).max_new_tokens == 2  # the built-in tasks keep theirs


def test_reward_functions_as_users_write_them(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "from syncwise.rewards import batched\n"
        "def exact(prompt, response, row):\n    return float(response == row['answer'])\n"
        "def lengths(prompts, responses, rows):\n    return [len(r) / 10 for r in responses]\n"
        "@batched\ndef ones(p, r, rows):\n    return [1.0] * len(r)\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "other.py").write_text("def half(prompt, response, row):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)  # module:function resolves from the job's folder, as python -m does
    functions = reward_functions(["my_rewards:exact", "my_rewards:lengths", "my_rewards:ones", "sub/other.py:half"],
                                 [1.0, 0.5, 2.0, 1.0])
    assert [(f.name, f.batched) for f in functions] == [("exact", False), ("lengths", True), ("ones", True),
                                                        ("half", False)]
    totals, parts = score(functions, ["q", "q"], ["7", "12345"], [{"answer": "7"}, {"answer": "7"}])
    assert parts == {"exact": [1.0, 0.0], "lengths": [0.1, 0.5], "ones": [1.0, 1.0], "half": [0.5, 0.5]}
    assert totals == pytest.approx([1 + 0.05 + 2 + 0.5, 0 + 0.25 + 2 + 0.5])
    with pytest.raises(ValueError, match=r"rl.reward_fn: cannot import 'nope.py:f': no file nope.py"):
        load_reward_fn("nope.py:f")
    from syncwise.rl.env.scoring import RewardFunction

    short = RewardFunction("short", "rl.reward_fn", lambda prompts, responses, rows: [1.0, 2.0], batched=True)
    with pytest.raises(ValueError, match=r"rl.reward_fn \(batched\): returned 2 rewards for 3 responses"):
        score([short], ["q"] * 3, ["a", "b", "c"], [{}] * 3)


def test_reward_weights_must_match_the_functions():
    from syncwise.config import ConfigError

    with pytest.raises(ConfigError, match=r"rl.reward_weights: 1 weight\(s\) for 2 reward function\(s\)"):
        load_config(None, ["rl.reward_fn=[a:f, b:g]", "rl.reward_weights=[1]"])
    assert load_config(None, ["model.dropout=off"]).model.dropout == "off"  # YAML's `off` is false


def test_end_tokens_come_from_the_models_generation_config(tmp_path):
    from transformers import GenerationConfig

    from syncwise.rl.env.tasks import end_token_ids

    assert end_token_ids(None) == [] and end_token_ids(str(tmp_path)) == []
    GenerationConfig(eos_token_id=[2, 7]).save_pretrained(tmp_path)  # a chat model's turn end beside its eos
    assert end_token_ids(str(tmp_path)) == [2, 7]
    GenerationConfig(eos_token_id=5).save_pretrained(tmp_path)
    assert end_token_ids(str(tmp_path)) == [5]
