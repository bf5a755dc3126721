"""Partial rollouts of multi-turn conversations (issue 61), the pool's part on one process: conversations with an
environment of their own carried across rounds and steps, pinned against the turn loop that samples each one
whole. A scripted policy stands in for sampling (it answers from the conversation so far, whatever the rounds
cut it into), so a conversation the pool carries over several versions must come out token for token as the
turn loop's -- the turns, the tool answers through the chat template, the loss mask, the episode's state and
score -- and a checkpoint taken with conversations in flight must continue as the job that went on. Real jobs:
tests/test_tool_jobs.py."""

from __future__ import annotations

import re

import pytest
import torch

from syncwise.config import load_config
from syncwise.rl.env.base import NOT_SAVED
from syncwise.rl.env.classes import ClassEpisode, EnvironmentClass
from syncwise.rl.env.prompts import encode_prompt
from syncwise.rl.rollout.base import Samples
from syncwise.rl.rollout.partial import PartialPool
from syncwise.rl.rollout.turns import TurnLoop
from user_models import qwen25_tokenizer

GUESS_ENV = '''
class Guess:
    """Find the secret: each guess says higher or lower; the episode counts its own guesses."""

    def reset(self, secret: int, **row) -> str:
        self.secret, self.guesses, self.found = int(secret), 0, False
        return " Guess my number."

    def guess(self, number: int) -> str:
        """Guess.

        Args:
            number: The guess.
        """
        self.guesses += 1
        self.found = number == self.secret
        return "correct" if self.found else ("higher" if number < self.secret else "lower")

    def get_reward(self) -> float:
        return 1.0 / self.guesses if self.found else 0.0


class SavedGuess(Guess):
    def __getstate__(self) -> dict:
        return dict(vars(self))

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)


class BadState(Guess):
    def __getstate__(self) -> dict:
        return {"seen": {1, 2}}

    def __setstate__(self, state) -> None:
        pass
'''
END = "<|im_end|>"


class ConversationPolicy:
    """A deterministic policy of the conversation so far: game k (its prompt says which) guesses 1, 2, ... up to
    its secret, one call a turn, then answers; the turn's tokens are drawn from where the sequence's last
    generation prompt left them, so however rounds cut a turn, the same tokens come out."""

    def __init__(self, tokenizer, secrets: dict[int, int], stop: str | None = None):
        self.tokenizer, self.secrets, self.stop = tokenizer, secrets, stop
        self.opening = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.rows_per_call: list[int] = []
        self.split = 0  # calls that ran past a stop string begun before them (unseen, as an engine's)

    def turn(self, game: int, turn: int) -> list[int]:
        if turn < self.secrets[game]:
            text = f'<tool_call>\n{{"name": "guess", "arguments": {{"number": {turn + 1}}}}}\n</tool_call>'
        else:
            text = f"Found it.\n#### {self.secrets[game]}"
        return self.tokenizer(text + END, add_special_tokens=False)["input_ids"]

    def sample(self, prompts, n, max_new_tokens, seed):
        self.rows_per_call.append(len(prompts) * n)
        tokens, ended = [], []
        for sequence in prompts:
            starts = [i + len(self.opening) for i in range(len(sequence) - len(self.opening) + 1)
                      if sequence[i:i + len(self.opening)] == self.opening]
            game = int(re.search(r"game (\d+)", self.tokenizer.decode(sequence)).group(1))
            turn = self.turn(game, len(starts) - 1)
            drawn = turn[len(sequence) - starts[-1]:][:max_new_tokens]
            if self.stop:  # an engine's stop: where this call's own tokens contain the string
                cut = next((k for k in range(1, len(drawn) + 1) if self.stop in self.tokenizer.decode(drawn[:k])),
                           None)
                whole = self.tokenizer.decode(turn[:len(sequence) - starts[-1] + len(drawn)])
                self.split += cut is None and self.stop in whole and self.stop not in self.tokenizer.decode(
                    turn[:len(sequence) - starts[-1]])
                drawn = drawn[:cut] if cut is not None else drawn
            for _ in range(n):
                tokens.append(torch.tensor(drawn))
                stopped = bool(self.stop) and self.stop in self.tokenizer.decode(drawn)
                ended.append(stopped or len(sequence) - starts[-1] + len(drawn) == len(turn))
        log_probs = [torch.full((len(t),), -0.25) for t in tokens]
        return Samples(tokens, log_probs, 0, ended, log_probs)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("guess_env")
    (root / "guess_env.py").write_text(GUESS_ENV)
    tokenizer = qwen25_tokenizer()
    return root, tokenizer


def _job(setting, cls: str, games: int = 12):
    """The turn loop over episodes of ``cls``, the games' rows and prompts, and the policy."""
    root, tokenizer = setting
    spec = EnvironmentClass(f"{root / 'guess_env.py'}:{cls}")
    cfg = load_config(None, [f"rl.environment={root / 'guess_env.py'}:{cls}", "rl.max_turns=5"]).rl
    schemas = list(spec.schemas.values())
    secrets = {k: 1 + (k * 5) % 4 for k in range(games)}  # 1 to 4 guesses: conversations of 2 to 5 turns
    rows = [{"prompt": [{"role": "user", "content": f"Play game {k}."}], "secret": secrets[k]} for k in range(games)]
    prompts = [encode_prompt(row["prompt"], cfg, tokenizer, schemas) for row in rows]
    loop = TurnLoop(cfg, tokenizer, None, lambda row: ClassEpisode(spec), list(spec.schemas), spec.name)
    return loop, rows, prompts, schemas, ConversationPolicy(tokenizer, secrets)


def _pool(loop, rows, schemas, staleness=2, chunk=7, max_new=170, row_of=None):
    return PartialPool(staleness, 2, 2, max_new, chunk, loop.tokenizer, None, loop,
                       row_of or (lambda k: (rows[k], schemas)))


def _whole(loop, rows, prompts, schemas, policy, max_new=170):
    """Each game sampled whole by the turn loop: its two conversations, and their episodes' guesses."""
    out = {}
    for k, row in enumerate(rows):
        trajectories, _, episodes = loop.run(policy, [row], [prompts[k]], [schemas], 2, max_new, [0] * loop.max_turns)
        out[k] = [(t, e.instance.guesses) for t, e in zip(trajectories, episodes, strict=True)]
        for episode in episodes:
            episode.close()
    return out


def _same(carried, whole) -> None:
    for key in ("prompt", "opening", "tokens", "sampled", "full_log_probs", "messages", "ended", "env_reward"):
        assert getattr(carried, key) == getattr(whole, key), key
    assert dict(carried.counts) == dict(whole.counts)


def test_a_conversation_carried_over_rounds_and_versions_is_the_turn_loops_own(setting):
    """Rounds of 7 tokens, staleness 2: every game's two conversations -- 2 to 5 turns, the tool called with the
    round's version, the answers put in through Qwen2.5's template -- come out exactly as the turn loop samples
    them whole, each token keeping the version that drew it (the template's text its round's), each episode's
    state its own (its guesses, its score); the episodes stay open until the trainer scores them."""
    loop, rows, prompts, schemas, policy = _job(setting, "Guess", games=16)
    whole = _whole(loop, rows, prompts, schemas, policy)
    pool = _pool(loop, rows, schemas)
    trained = {}
    for step in range(5):
        fill = pool.fill(policy, step, lambda k: prompts[k], lambda r: r)
        assert len(fill.groups) == 2 and fill.tool_s > 0
        for group in fill.groups:
            assert step - group.started <= 2
            trained[group.index] = group
    assert len(trained) == 10 and max(policy.rows_per_call) <= pool.capacity * 2
    spans, cut = set(), []
    for k, group in trained.items():
        for trajectory, episode, (reference, guesses) in zip(group.trajectories, group.episodes, whole[k], strict=True):
            _same(trajectory, reference)
            assert episode.instance.guesses == guesses == trajectory.counts["tool_calls"]
            cut.append(not trajectory.ended)
            assert len(trajectory.versions) == len(trajectory.tokens)
            assert trajectory.versions == sorted(trajectory.versions)  # drawn on, never back
            spans.add(trajectory.versions[-1] - trajectory.versions[0])
            assert not episode.thread.closed  # open until scored
            episode.close()
    assert max(spans) >= 1  # some conversations did go on under a newer policy
    assert 0 < sum(cut) < len(cut)  # most end by themselves, the longest games are cut by rl.max_new_tokens
    pool.close()


def test_a_checkpoint_with_conversations_in_flight_continues_as_the_job_that_went_on(setting, tmp_path):
    """After step 2 the pool is saved (as the checkpoint does in the job that goes on) with conversations mid-turn
    and between turns; a fresh pool loaded from the file -- its episodes rebuilt and given their saved state, as
    a resumed job's -- trains steps 3-6 exactly as the pool that went on: the same groups, tokens, versions,
    messages, guesses and scores, nothing lost or repeated."""
    loop, rows, prompts, schemas, policy = _job(setting, "SavedGuess", games=20)
    pool = _pool(loop, rows, schemas)
    for step in range(3):
        for group in pool.fill(policy, step, lambda k: prompts[k], lambda r: r).groups:
            group.close()
    in_flight = [t for g in pool.groups for t in g.trajectories if not t.done]
    assert any(t.tokens and t.turn_start for t in in_flight)  # a conversation past its first turn
    torch.save(pool.state_dict(), tmp_path / "pool.pt")
    assert pool.unsaved == 0 and pool.unsaved_words() == ""
    _resumed_alike(pool, tmp_path / "pool.pt", range(3, 7), prompts, policy)


def _resumed_alike(pool: PartialPool, saved, steps, prompts, policy) -> list[int]:
    """A fresh pool loaded from ``saved`` fills ``steps`` as ``pool``, which went on, does; each step's drop."""
    again = _pool(pool.turns, None, None, row_of=pool.row_of)
    again.load_state_dict(torch.load(saved, weights_only=True))
    dropped = []
    for step in steps:
        want = pool.fill(policy, step, lambda k: prompts[k], lambda r: r)
        got = again.fill(policy, step, lambda k: prompts[k], lambda r: r)
        assert [g.state() for g in got.groups] == [g.state() for g in want.groups]
        assert (got.drawn_tokens, got.dropped, got.rounds) == (want.drawn_tokens, want.dropped, want.rounds)
        dropped.append(got.dropped)
        for group in (*got.groups, *want.groups):
            group.close()
    pool.close()
    again.close()
    return dropped


def test_conversations_whose_environment_cannot_be_saved_are_dropped_at_the_checkpoint_and_counted(setting, tmp_path):
    """A TRL-style class without __getstate__ / __setstate__: the save drops the groups in flight (their episodes
    closed), counts their samples with the next step's dropped, and says so in one line; the job that went on and
    the one resumed from the file train the same from there. A state that is not plain data is an error naming
    the class."""
    loop, rows, prompts, schemas, policy = _job(setting, "Guess", games=20)
    pool = _pool(loop, rows, schemas)
    for step in range(2):
        pool.fill(policy, step, lambda k: prompts[k], lambda r: r)
    in_flight = list(pool.groups)
    episodes = [e for g in in_flight for e in g.episodes]
    assert in_flight and episodes[0].state() is NOT_SAVED
    torch.save(pool.state_dict(), tmp_path / "pool.pt")
    assert pool.unsaved == len(in_flight) and not pool.groups
    assert all(e.thread.closed for e in episodes)  # closed when dropped
    words = pool.unsaved_words()
    assert words.startswith(f"{len(in_flight)} group(s) in flight ({2 * len(in_flight)} conversations) dropped")
    assert "Guess has no __getstate__ / __setstate__" in words and "\n" not in words
    assert _resumed_alike(pool, tmp_path / "pool.pt", range(2, 4), prompts, policy) == [2 * len(in_flight), 0]
    bad_loop, *_ = _job(setting, "BadState")
    bad = _pool(bad_loop, rows, schemas)
    bad.fill(policy, 0, lambda k: prompts[k], lambda r: r)
    with pytest.raises(ValueError, match=r"BadState.__getstate__\(\) returned a set at state\['seen'\]"):
        bad.state_dict()
    bad.close()


def test_a_stop_string_split_between_two_rounds_ends_the_turn_where_it_ends(setting):
    """rl.stop with conversations: "it.\\n####" (five tokens) ends the answer turn. Rounds of 3, 4 and 5 tokens
    split it between two rounds in some conversations -- the engine, which sees its round's tokens only, runs on
    to the end token -- and the pool ends the turn with the token that completes the string, each conversation
    as the turn loop's, whose engine saw the whole turn."""
    from syncwise.rl.rollout.base import StopStrings

    loop, rows, prompts, schemas, policy = _job(setting, "Guess", games=16)
    policy.stop = "it.\n####"
    whole = _whole(loop, rows, prompts, schemas, policy)
    assert all(t.messages[-1]["content"].endswith("it.\n####") for (t, _), _ in whole.values() if t.ended)
    splits = 0
    for chunk in (3, 4, 5):
        pool = PartialPool(2, 2, 2, 170, chunk, loop.tokenizer, StopStrings([policy.stop], loop.tokenizer), loop,
                           lambda k: (rows[k], schemas))
        policy.split = 0
        for step in range(5):
            for group in pool.fill(policy, step, lambda k: prompts[k], lambda r: r).groups:
                for trajectory, (reference, _) in zip(group.trajectories, whole[group.index], strict=True):
                    _same(trajectory, reference)
                group.close()
        splits += policy.split
        pool.close()
    assert splits > 0
