"""Partial rollouts (``rl.max_staleness``), the pool's rules on a scripted engine that pins exact lengths: rounds
of ``rl.partial_chunk_tokens``, AReaL's capacity rule, the oldest finished groups first, the drop for age, each
token's version, and the pool through a checkpoint. Real jobs on the compact sampler and vLLM: test_train.py,
test_rollout_engines.py."""

from __future__ import annotations

import pytest
import torch

from syncwise.config import ConfigError, load_config, packaged_config
from syncwise.rl.rollout.base import Samples, Trajectory
from syncwise.rl.rollout.partial import Group, PartialPool


class ScriptedEngine:
    """Each sequence's response is as long as its prompt's first token says; each call records its inputs."""

    def __init__(self):
        self.calls: list[tuple[int, int, int]] = []  # (rows, max_new_tokens, seed)

    def sample(self, prompts, n, max_new_tokens, seed):
        assert n == 1
        self.calls.append((len(prompts), max_new_tokens, seed))
        tokens, ended = [], []
        for sequence in prompts:
            left = sequence[0] - (len(sequence) - 1)  # the prompt is one token
            tokens.append(torch.full((min(left, max_new_tokens),), 5))
            ended.append(left <= max_new_tokens)
        logp = [torch.full((len(t),), -0.5) for t in tokens]
        return Samples(tokens, logp, sum(len(t) for t in tokens), ended, logp)


class Words:
    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(map(str, tokens))


def _pool(lengths: list[int], staleness: int = 1, per_step: int = 2, n: int = 2, max_new: int = 12, chunk: int = 4):
    pool = PartialPool(staleness, per_step, n, max_new, chunk, Words())
    return pool, (lambda k: [lengths[k]])


def test_a_step_samples_rounds_until_its_groups_finish_and_carries_the_rest():
    """Lengths 2, 12, 3, 9, ...: staleness 1, two groups per step -- four in flight (the capacity rule). Step 0's
    first round (4 tokens each) finishes prompts 0 and 2 (the oldest finished train, in admission order); 1 and 3
    are carried with 4 tokens of version 0; step 1 admits two more (a round a step at least, so the carried ones
    move on), which train; at step 2 the carried ones, started at version 0, are two versions old: dropped."""
    lengths = [2, 12, 3, 9, 1, 1, 1, 1, 1, 1]
    pool, prompt_of = _pool(lengths)
    engine = ScriptedEngine()
    fill = pool.fill(engine, 0, prompt_of, lambda r: 100 + r)
    assert [g.index for g in fill.groups] == [0, 2]
    assert (fill.rounds, fill.dropped, fill.drawn_tokens) == (1, 0, 2 * (2 + 4 + 3 + 4))
    assert engine.calls == [(8, 4, 100)]  # 4 groups x 2 samples, one round of 4 tokens
    assert fill.lockstep == 8 * 4
    assert [g.index for g in pool.groups] == [1, 3]
    assert all(t.versions == [0] * 4 for g in pool.groups for t in g.trajectories)
    assert all(t.done and t.ended and t.text for g in fill.groups for t in g.trajectories)
    # step 1: two new groups admitted (4 in flight), which finish in the first round; 1 and 3 keep sampling
    fill = pool.fill(engine, 1, prompt_of, lambda r: 200 + r)
    assert [g.index for g in fill.groups] == [4, 5]
    assert [g.index for g in pool.groups] == [1, 3]
    fill = pool.fill(engine, 2, prompt_of, lambda r: 300 + r)  # 1 and 3 started at version 0: staleness 2 > 1
    assert fill.dropped == 4 and [g.index for g in fill.groups] == [6, 7]


def test_tokens_keep_the_version_that_drew_them_across_steps():
    """Staleness 2: a 10-token response drawn 4 tokens at a time over three steps has versions 0,0,0,0,1,1,1,1,2,2
    and trains at step 2 (started at version 0: staleness 2, within the bound)."""
    pool, prompt_of = _pool([10] + [1] * 20, staleness=2, per_step=1, n=1)
    engine = ScriptedEngine()
    trained = [pool.fill(engine, version, prompt_of, lambda r: r).groups for version in range(3)]
    assert [[g.index for g in groups] for groups in trained] == [[1], [2], [0]]
    long = trained[2][0].trajectories[0]
    assert long.versions == [0] * 4 + [1] * 4 + [2] * 2 and long.ended
    assert len(long.full_log_probs) == len(long.drawn_log_probs) == len(long.sampled) == 10


def test_groups_in_flight_never_pass_the_capacity_and_each_round_is_one_call():
    lengths = [1 + (k * 7) % 12 for k in range(200)]
    pool, prompt_of = _pool(lengths, staleness=2, per_step=3, n=2)
    engine = ScriptedEngine()
    trained = []
    for version in range(20):
        fill = pool.fill(engine, version, prompt_of, lambda r: r)
        assert len(fill.groups) == 3
        assert len(pool.groups) <= pool.capacity - 3
        trained += [g.index for g in fill.groups]
        for group in fill.groups:
            assert version - group.started <= 2
    assert all(rows <= pool.capacity * 2 for rows, _, _ in engine.calls)
    assert len(set(trained)) == len(trained)  # no group trains twice


def test_a_response_cut_by_the_length_limit_is_done_and_not_ended():
    pool, prompt_of = _pool([30, 30], staleness=1, per_step=1, n=1, max_new=6, chunk=4)
    engine = ScriptedEngine()
    fill = pool.fill(engine, 0, prompt_of, lambda r: r)
    trajectory = fill.groups[0].trajectories[0]
    assert len(trajectory.tokens) == 6 and trajectory.done and not trajectory.ended
    assert [call[1] for call in engine.calls] == [4, 2]  # the last round asks only for the room left


class Chars:
    def decode(self, tokens, skip_special_tokens=True):
        return "".join(map(chr, tokens))


class TextEngine:
    """Each sequence's response is ``text`` on from what it has so far, one character a token, stopped as an engine
    stops: where its own tokens (this call's, the prompt and earlier rounds unseen) contain the stop string."""

    def __init__(self, text: str, stop: str):
        self.text, self.stop = text, stop

    def sample(self, prompts, n, max_new_tokens, seed):
        tokens, ended = [], []
        for sequence in prompts:
            drawn = ""
            for char in self.text[len(sequence) - 1:][:max_new_tokens]:  # the prompt is one token
                drawn += char
                if self.stop in drawn:
                    break
            tokens.append(torch.tensor([ord(c) for c in drawn]))
            ended.append(self.stop in drawn)
        logp = [torch.full((len(t),), -0.5) for t in tokens]
        return Samples(tokens, logp, sum(len(t) for t in tokens), ended, logp)


@pytest.mark.parametrize(("text", "kept"), [
    ("abc##def.....", "abc##"),  # rounds "abc#" | "#def": the string split between them, unseen by the engine
    ("ab##cdef.....", "ab##"),  # inside one round: the engine's own stop
    ("abcdefghijkl", "abcdefghijkl"),  # none: cut by the length limit, not ended
])
def test_a_stop_string_split_between_two_rounds_ends_the_response_where_it_ends(text, kept):
    """Issue 61: rl.stop with partial rollouts (refused before: a string split between two rounds went unseen).
    The response ends with the token that completes the string, its tokens, log-probs and versions cut alike."""
    from syncwise.rl.rollout.base import StopStrings

    chars = Chars()
    pool = PartialPool(1, 1, 1, 12, 4, chars, StopStrings(["##"], chars))
    engine = TextEngine(text, "##")
    trained = []
    for step in range(4):
        trained += pool.fill(engine, step, lambda k: [0], lambda r: r).groups
    trajectory = trained[0].trajectories[0]
    assert trajectory.text == kept and trajectory.ended == (kept != text)
    assert len(trajectory.tokens) == len(trajectory.versions) == len(trajectory.full_log_probs) == len(kept)
    assert len(trajectory.drawn_log_probs) == len(trajectory.sampled) == len(kept)


def test_the_pool_goes_through_a_checkpoint_and_continues_alike(tmp_path):
    lengths = [1 + (k * 5) % 11 for k in range(100)]
    pool, prompt_of = _pool(lengths, staleness=2, per_step=2)
    for version in range(3):
        pool.fill(ScriptedEngine(), version, prompt_of, lambda r: r)
    torch.save(pool.state_dict(), tmp_path / "pool.pt")
    again, _ = _pool(lengths, staleness=2, per_step=2)
    again.load_state_dict(torch.load(tmp_path / "pool.pt", weights_only=True))
    for version in range(3, 8):
        want = pool.fill(ScriptedEngine(), version, prompt_of, lambda r: r)
        got = again.fill(ScriptedEngine(), version, prompt_of, lambda r: r)
        assert [g.state() for g in got.groups] == [g.state() for g in want.groups]
        assert (got.drawn_tokens, got.lockstep, got.dropped) == (want.drawn_tokens, want.lockstep, want.dropped)


def test_on_a_rollout_rank_the_room_follows_the_version_and_a_snapshot_mid_step_loses_nothing(tmp_path):
    """Drawing on (a rollout rank), staleness 2, two groups a step: step 3 is sampled first by version 2 (one
    behind the step) -- room for two steps' groups, not three -- and the trainers' version 3 arrives before the
    second round: two more groups are admitted and the second round's tokens are version 3's. Group 5, started by
    version 0, is dropped and counted. A snapshot taken between the rounds (as a checkpoint asks) and loaded into a
    fresh pool finishes the step as the pool that ran through does -- the same groups, the drop and tokens counted
    before the snapshot reported with the step -- and every prompt admitted is accounted for."""
    lengths = [1] * 6 + [6, 8, 12, 12, 3, 3] + [1] * 10
    pool, prompt_of = _pool(lengths, staleness=2, per_step=2, chunk=4)
    pool.admitted = 6  # prompts 0-4 trained by steps 0-2; 5 still in flight, started by version 0
    pool.groups = [Group(5, 0, [Trajectory(prompt=[1]) for _ in range(2)])]
    versions = iter([2, 3])

    def version_now() -> int:  # what the rollout rank's inbox says before each round
        version = next(versions)
        if version == 3:  # with the trainers' version 3, their checkpoint's snapshot: posted there and then
            torch.save(pool.state_dict(), tmp_path / "snapshot.pt")
        return version

    engine = ScriptedEngine()
    fill = pool.fill(engine, 3, prompt_of, lambda r: r, version_now)
    assert [rows for rows, _, _ in engine.calls] == [4 * 2, 6 * 2]  # room (v + 2 - 3 + 1) x 2 groups, 2 samples
    assert [g.index for g in fill.groups] == [6, 7] and [g.index for g in pool.groups] == [8, 9, 10, 11]
    assert fill.groups[0].trajectories[0].versions == [2] * 4 + [3] * 2 and fill.dropped == 2
    again, _ = _pool(lengths, staleness=2, per_step=2, chunk=4)
    again.load_state_dict(torch.load(tmp_path / "snapshot.pt", weights_only=True))
    got = again.fill(ScriptedEngine(), 3, prompt_of, lambda r: r, lambda: 3)
    assert [g.state() for g in got.groups] == [g.state() for g in fill.groups]
    assert [g.index for g in again.groups] == [8, 9, 10, 11]
    assert (got.drawn_tokens, got.lockstep, got.dropped) == (fill.drawn_tokens, fill.lockstep, fill.dropped)
    # admitted = trained before + dropped + trained now + in flight
    assert again.admitted == 5 + got.dropped // 2 + len(got.groups) + len(again.groups)


def _config(*overrides: str):
    return load_config(packaged_config("grpo.yaml"), list(overrides), packaged=True)


def test_max_staleness_resolves_the_decoupled_loss_and_refuses_what_it_cannot_carry():
    config = _config("rl.max_staleness=2")
    assert config.rl.loss.off_policy == "decoupled" and config.rl.is_off_policy
    assert _config().rl.loss.off_policy == "none"
    cases = {
        "rl.off_policy_lag=1": "rl.max_staleness and rl.off_policy_lag: choose one",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            _config("rl.max_staleness=2", override)
    with pytest.raises(ConfigError, match="rl.max_staleness"):
        _config("rl.max_staleness=-1")
    assert _config("rl.max_staleness=2", "rl.stop=[x]").rl.stop == ["x"]  # issue 61: carried across rounds
    # issue 61: conversations are carried too
    assert _config("rl.max_staleness=2", "rl.tools=[calculator]").rollout_mode.name == "partial"


def test_the_time_model_fits_known_costs_and_projects_fewer_decode_steps_on_a_long_tail():
    """docs/perf_tuning.md's model: two costs recovered from steps made with them; on a long tail (median 16, a
    tail to 256) partial rollouts -- the real pool over scripted lengths -- run fewer decode steps per trained
    batch with a fuller batch, more so with more staleness; on a machine where a decode step's fixed cost
    dominates (a GPU's), that is the rollout's speed-up."""
    from syncwise.jobs.bench.time_model import DecodeCost, fit, long_tail, project, simulate

    rows = [{"rollout/decode_steps": steps, "rollout/drawn_tokens": 2 * tokens,
             "time/rollout_s": 0.004 * steps + 5e-5 * tokens} for steps, tokens in ((10, 300), (40, 200), (90, 900))]
    cost = fit(rows, world_size=2)
    assert cost.per_step_s == pytest.approx(0.004, rel=1e-9) and cost.per_token_s == pytest.approx(5e-5, rel=1e-9)
    sync = simulate(long_tail(256), 8, 8, 256, staleness=0, steps=100)
    one, two = (simulate(long_tail(256), 8, 8, 256, staleness=s, steps=100) for s in (1, 2))
    assert sync.fill < 0.3 and one.fill > sync.fill + 0.2 and two.fill > sync.fill + 0.2
    assert two.decode_steps < one.decode_steps < sync.decode_steps / 1.5
    assert 0 < one.dropped < 0.25 and sync.prefill == 0 < one.prefill
    gpu = DecodeCost(per_step_s=0.01, per_token_s=0.0)
    projected = project(gpu, sync, two, generation_share=1.0)
    assert projected["speedup"] == pytest.approx(sync.decode_steps / two.decode_steps)
    assert project(gpu, sync, two, generation_share=0.5)["speedup"] < projected["speedup"]
