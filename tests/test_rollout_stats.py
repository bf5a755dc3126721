"""Issue 61: the rollout statistics cross ranks as named fields, one all-reduce; ranks that send different fields
stop with the all-reduce's name instead of summing one field into another."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dist_harness import run_distributed
from scenarios_stats import fields_by_name
from syncwise.rl.rollout.queue import DECODE_FIELDS, ScoredBatch
from syncwise.rl.rollout.turns import TOOL_COUNTS
from syncwise.rl.stats import rollout_stats


def test_named_fields_are_summed_and_shared_by_name_over_ranks():
    ranks = run_distributed(fields_by_name, 2, False)
    for result in ranks:
        assert result["sums"] == {"samples": 5.0, "tokens": 20.0}
        assert result["own"] == {"longest": [5.0, 10.0]}


def test_ranks_that_send_different_fields_stop_naming_the_all_reduce():
    ranks = run_distributed(fields_by_name, 2, True)
    assert [r["error"].split(":")[0] for r in ranks] == ["the test's all-reduce"] * 2
    assert "the ranks sent different fields" in ranks[0]["error"] and "tokens_seen" in ranks[1]["error"]


def _scored(decode=None, tools=None) -> ScoredBatch:
    return ScoredBatch(
        step=3, version=2, batch={}, log_probs=torch.zeros(3, 4), rewards=torch.tensor([1.0, 0.0, 0.5]),
        reward_parts={"format": torch.tensor([1.0, 1.0, 0.0]), "answer": torch.tensor([0.0, -1.0, 0.5])},
        episode_metrics=[], response_lengths=torch.tensor([4, 2, 3]), clipped=torch.tensor([1, 0, 0]),
        kept_mass=torch.tensor([0.5, 1.0]), tool_counts=tools, tool_s=0.0, started=torch.tensor([2, 1, 2]),
        decode=decode)


def test_the_rollout_statistics_read_each_field_by_its_name():
    info = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 3)
    tools = torch.arange(len(TOOL_COUNTS), dtype=torch.float64)
    decode = {"drawn_tokens": 12.0, "lockstep": 16.0, "dropped": 1.0, "decode_steps": 5.0}
    m = rollout_stats(_scored(decode, tools), torch.zeros(3, 4), torch.full((3, 4), -0.25), mask, (1, 2, 3), info,
                      60.0, step=3)
    assert m["reward/mean"] == pytest.approx(0.5) and m["reward/solved_fraction"] == pytest.approx(1 / 3)
    assert m["reward/format"] == pytest.approx(2 / 3) and m["reward/answer"] == pytest.approx(-0.5 / 3)
    assert m["response/length_mean"] == pytest.approx(3.0) and m["rollout/response_tokens"] == 9
    assert m["rollout/decode_fill"] == pytest.approx(12 / 16) and m["rollout/decode_steps"] == 5
    assert m["rollout/drawn_tokens"] == 12 and m["rollout/dropped_stale"] == 1
    assert m["rollout/log_prob_diff"] == pytest.approx(0.25) and m["rollout/log_prob_diff_max"] == 0.25
    assert m["rollout/kept_mass"] == pytest.approx(0.75) and m["response/clipped_fraction"] == pytest.approx(1 / 3)
    assert m["rollout/uniform_group_fraction"] == pytest.approx(0.5) and m["rollout/trained_samples"] == 3
    assert m["rollout/staleness_mean"] == pytest.approx(4 / 3) and m["rollout/staleness_max"] == 2
    assert m["rollout/turns_mean"] == pytest.approx(0.0) and m["rollout/tool_calls_per_sample"] == pytest.approx(1 / 3)
    # one engine call, synchronous: the decode batch from the lengths
    m = rollout_stats(_scored(), torch.zeros(3, 4), torch.zeros(3, 4), mask, (0, 2, 3), info, 60.0)
    assert m["rollout/decode_fill"] == pytest.approx(9 / 12) and m["rollout/decode_steps"] == 4
    assert "rollout/drawn_tokens" not in m and "rollout/staleness_mean" not in m and "rollout/turns_mean" not in m


def test_a_checkpoint_of_before_the_names_loads_its_decode_counts_by_name():
    state = _scored().state() | {"decode": torch.tensor([12.0, 16.0, 1.0, 5.0], dtype=torch.float64)}
    assert ScoredBatch.from_state(state).decode == dict(zip(DECODE_FIELDS, [12.0, 16.0, 1.0, 5.0], strict=True))
