"""Issue 61: the table of rollout modes -- every combination of rl.off_policy_lag, rl.max_staleness and
dist.rollout_ranks resolved once (its row, the lag, or one line naming the keys), the staleness bound, and each row
built as its own producer of scored batches."""

import pytest

from syncwise.config import ConfigError, load_config
from syncwise.config.rollout_modes import ROLLOUT_MODES, StalenessBound, mode_of

RANKS = ["dist.nproc=4", "dist.rollout_ranks=2"]


@pytest.mark.parametrize(("overrides", "mode", "lag"), [
    ([], "synchronous", 0),
    (["rl.off_policy_lag=0"], "synchronous", 0),
    (["rl.off_policy_lag=2"], "lag", 2),
    (["rl.max_staleness=1"], "partial", 0),
    (["rl.max_staleness=2", "rl.partial_chunk_tokens=8"], "partial", 0),
    (RANKS, "lag_on_rollout_ranks", 1),  # unset beside rollout ranks: one step off-policy
    ([*RANKS, "rl.off_policy_lag=3"], "lag_on_rollout_ranks", 3),
    ([*RANKS, "rl.max_staleness=2"], "drawn_on_rollout_ranks", 0),
])
def test_every_combination_of_the_keys_names_one_row_and_resolves_the_lag(overrides, mode, lag):
    config = load_config(None, overrides)
    assert config.rollout_mode is ROLLOUT_MODES[mode] and config.rl.off_policy_lag == lag
    assert config.rollout_mode.off_policy == config.rl.is_off_policy == (mode != "synchronous")
    assert mode_of(lag, config.rl.max_staleness, config.dist.rollout_ranks) is config.rollout_mode


@pytest.mark.parametrize(("overrides", "message"), [
    (["rl.max_staleness=1", "rl.off_policy_lag=1"], "rl.max_staleness and rl.off_policy_lag: choose one"),
    (["rl.partial_chunk_tokens=8"], "rl.partial_chunk_tokens=8 is the round of a partial rollout"),
    ([*RANKS, "rl.off_policy_lag=0"], "dist.rollout_ranks=2 with rl.off_policy_lag=0"),
    (["rl.off_policy_lag=5", "train.steps=5"], "rl.off_policy_lag=5 with train.steps=5"),
])
def test_a_combination_that_cannot_run_is_one_line_naming_its_keys(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_each_row_has_its_words_and_only_the_drawn_on_mode_depends_on_timing():
    words = {name: mode.label(lag=2) for name, mode in ROLLOUT_MODES.items()}
    assert words == {"synchronous": "synchronous", "lag": "lag 2", "partial": "partial rollouts",
                     "lag_on_rollout_ranks": "lag 2, rollout ranks",
                     "drawn_on_rollout_ranks": "partial rollouts, rollout ranks"}
    assert [name for name, mode in ROLLOUT_MODES.items() if not mode.exact] == ["drawn_on_rollout_ranks"]


def test_the_staleness_bound_is_one_rule_for_the_pool_and_the_rollout_rank():
    bound = StalenessBound(2)
    assert [bound.oldest(step) for step in range(5)] == [0, 0, 0, 1, 2]
    assert bound.keeps(step=5, started=3) and not bound.keeps(step=5, started=2)
    # colocated (version = step): the next max_staleness + 1 steps; a rollout rank one version ahead of a step: 2
    assert bound.steps_drawable(step=4, version=4) == 3 and bound.steps_drawable(step=4, version=3) == 2
    assert StalenessBound(0).steps_drawable(step=4, version=4) == 1


def test_each_row_is_built_as_its_own_producer():
    from syncwise.rl.batches import DrawAhead, DrawNow, FetchAhead, FetchDrawnOn, PartialRollouts, batch_producer
    from syncwise.rl.drawing import BatchDrawer
    from syncwise.runtime.distributed import DistInfo

    class Rollout:  # what a producer reads of its engine when built: a pool's limits, its turn loop
        max_new_tokens, tokenizer, turns = 16, None, None

    expected = {"synchronous": DrawNow, "lag": DrawAhead, "partial": PartialRollouts,
                "lag_on_rollout_ranks": FetchAhead, "drawn_on_rollout_ranks": FetchDrawnOn}
    cases = {"synchronous": [], "lag": ["rl.off_policy_lag=1"], "partial": ["rl.max_staleness=1"],
             "lag_on_rollout_ranks": RANKS, "drawn_on_rollout_ranks": [*RANKS, "rl.max_staleness=1"]}
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=None)
    for name, overrides in cases.items():
        config = load_config(None, overrides)
        on_ranks = config.rollout_mode.on_rollout_ranks
        drawer = None if on_ranks else BatchDrawer(config, (0, 1), Rollout(), source=None)
        producer = batch_producer(config, info, drawer, channel=object() if on_ranks else None, weights=iter)
        assert type(producer) is expected[name], name


def test_a_partial_rollouts_pool_carries_the_jobs_stop_strings():
    """Issue 61: rl.stop with rl.max_staleness (refused before): the pool checks each round's tokens together with
    the earlier rounds' (tests/test_partial_rollouts.py), the job's strings handed to it."""
    from syncwise.rl.drawing import BatchDrawer

    class Rollout:
        max_new_tokens, tokenizer, turns = 16, None, None

    config = load_config(None, ["rl.max_staleness=1", "rl.stop=['####', The answer]"])
    pool = BatchDrawer(config, (0, 1), Rollout(), source=None).partial_pool()
    assert pool.stop.strings == ["####", "The answer"] and pool.stop.window == len("The answer") + 2
