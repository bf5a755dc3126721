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


def test_guess_number_answers_the_range_left_and_scores_fewer_guesses_higher():
    from syncwise.environments import GuessNumber

    game = GuessNumber()
    game.reset(low=10, high=20, secret=17, prompt="ignored: every column reaches reset")
    assert [game.guess(15), game.guess(18), game.guess(17), game.guess(3)] == [
        "higher: 16 to 20", "lower: 16 to 17", "correct", "already found"]
    assert game.get_reward() == pytest.approx(0.8) and game.metrics == {"solved": 1.0, "guesses": 3.0}
    lost = GuessNumber()
    lost.reset(1, 8, 5)
    lost.guess(1)
    assert lost.get_reward() == 0.0 and lost.metrics == {"solved": 0.0, "guesses": 1.0}


def test_guess_number_demonstrations_are_games_the_environment_plays_without_binary_search():
    """Each SFT chat replays through GuessNumber answer for answer and finds the number within 4 guesses; the
    guesses are anywhere in the range left (many are not its midpoint: that is for GRPO to find)."""
    import json

    from syncwise.environments import GuessNumber
    from syncwise.sft.tasks import guess_number_rows

    rows = guess_number_rows(200, seed=3)
    off_middle = guesses = 0
    for row in rows:
        game = GuessNumber()
        game.reset(**row)
        calls = [m for m in row["messages"] if m.get("tool_calls")]
        answers = [m["content"] for m in row["messages"] if m["role"] == "tool"]
        for call, answer in zip(calls, answers, strict=True):
            low, high = game.low, game.high
            number = call["tool_calls"][0]["function"]["arguments"]["number"]
            off_middle += number != (low + high) // 2
            guesses += 1
            assert game.guess(number) == answer
        assert game.solved and len(calls) <= 4 and row["messages"][-1]["content"] == f"Found it: {row['secret']}."
        assert json.loads(json.dumps(row)) == row  # as the JSONL holds it
    assert off_middle > guesses / 2


def test_arith_python_demonstrations_show_what_the_python_tool_prints():
    """The SFT chats' tool turns hold exactly what the built-in python tool answers to their programs (run in
    its sandbox), and that is the answer the last turn gives."""
    from syncwise.sft.tasks import arith_tools_rows
    from syncwise.tools import python

    for row in arith_tools_rows(8, seed=5, tool="python"):
        call, result = row["messages"][2]["tool_calls"][0]["function"], row["messages"][3]["content"]
        assert call["name"] == "python" and python(**call["arguments"]) == result == f"{row['answer']}\n"
        assert row["messages"][-1]["content"].endswith(f"#### {row['answer']}")
