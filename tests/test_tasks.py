"""The built-in tasks: prompts, rewards with partial credit, the tokenizer each one uses, and the config
keys that go with them."""

from __future__ import annotations

import statistics

import pytest

from syncwise.config import ConfigError, load_config
from syncwise.rl.env.tasks import builtin_tokenizer, prompt_source, repeat_reward, target_reward


def test_target_task_keeps_its_17_token_vocabulary():
    assert len(builtin_tokenizer("target")) == 17 and len(builtin_tokenizer()) == 17


@pytest.mark.parametrize("task", ["target", "repeat"])
def test_every_prompt_and_demonstration_tokenizes_without_unknown_words(task):
    tok, source = builtin_tokenizer(task), prompt_source(task, None, None)
    for row in source.rows:
        text = row["prompt"] + " " + source.demonstration(row)
        assert tok.unk_token_id not in tok(text)["input_ids"], text
        assert source.reward_fn(row["prompt"], source.demonstration(row), row) == 1.0  # the answer scores 1


def test_repeat_counts_are_long_tailed():
    counts = [row["count"] for row in prompt_source("repeat", None, None).rows]
    assert min(counts) == 1 and max(counts) >= 90
    assert statistics.median(counts) <= 15 < statistics.mean(counts)  # most short, a tail to ~100
    assert prompt_source("repeat", None, None).max_new_tokens == 100


@pytest.mark.parametrize(("response", "reward"), [
    ("7 7 7 7", 1.0),          # exactly four sevens
    ("7 7", 0.5 * 2 / 4 + 0.5 * 2 / 4),  # half as long, both right
    ("7 7 7 7 7 7 7 7", 0.5 * 4 / 8 + 0.5 * 1.0),  # twice as long: the first four count
    ("7 3 7 3", 0.5 + 0.5 * 2 / 4),
    ("", 0.0),
])
def test_repeat_reward_gives_partial_credit(response, reward):
    assert repeat_reward("repeat 7 times 0 4 :", response, {"digit": 7, "count": 4}) == pytest.approx(reward)


def test_target_reward_unchanged():
    assert target_reward("target 7 :", "7", {"target": 7}) == 1.0
    assert target_reward("target 7 :", "5", {"target": 7}) == 0.5


def test_task_config_keys():
    assert load_config(None, ["rl.task=repeat", "rl.warm_start_steps=5"]).rl.warm_start_steps == 5
    with pytest.raises(ConfigError, match="rl.warm_start_steps: must be >= 0"):
        load_config(None, ["rl.warm_start_steps=-1"])
    with pytest.raises(ConfigError, match="rl.warm_start_steps: needs a built-in task"):
        load_config(None, ["rl.warm_start_steps=2", "rl.dataset=x.jsonl", "rl.reward_fn=m:f"])
    with pytest.raises(ConfigError, match="rl.max_new_tokens: must be >= 0"):
        load_config(None, ["rl.max_new_tokens=-3"])
