"""auto's choice among the sync configurations, on an estimator built from shapes (no process group): the
candidates in order of speed, partial(K) among them, and stepping down one unit at a time."""

from __future__ import annotations

from syncwise.memory.accounting import ShardedModel
from syncwise.memory.autosync import AutoSync
from syncwise.memory.costs import Links, candidates, deferral_order
from syncwise.sync.modes import SyncChoice, SyncMode, supported_modes

# A root of 1000 elements and four layers of 4000: shard group of 2, fp32.
MODEL = ShardedModel(unit_shapes=(((1000,),),) + (((4000,),),) * 4, shard_size=2)
PER_UNIT_EXTRA = [2000, 8000, 8000, 8000, 8000]  # 4 bytes x numel x (1 - 1/2)


def test_units_are_deferred_smallest_first_and_candidates_run_fastest_first():
    assert MODEL.unit_held_extra() == PER_UNIT_EXTRA
    assert deferral_order(MODEL, Links()) == [0, 1, 2, 3, 4]
    labels = [c.label for c in candidates(supported_modes("fsdp2", False), MODEL, Links())]
    assert labels == ["deferred_unsharded", "deferred", "partial(4)", "partial(3)", "partial(2)", "partial(1)",
                      "per_microbatch"]


def test_peak_over_budget_steps_down_one_unit_not_to_per_microbatch():
    auto = AutoSync(MODEL, candidates(supported_modes("fsdp2", False), MODEL, Links()), budget=100_000 + 18_000)
    chosen = auto.decide(100_000, SyncChoice(SyncMode.PER_MICROBATCH), num_microbatches=4)
    assert chosen.label == "partial(3)"  # 2000 + 8000 + 8000 = 18000 fits, one more layer does not
    stepped = auto.observe(100_000 + 18_000 + 1, num_microbatches=4)  # longer sequences: the peak grew by 1
    assert stepped.label == "partial(2)" and "stepping down" in auto.decisions[-1]
    assert auto.observe(100_000 + 10_000, num_microbatches=4) == stepped  # within budget again: never back up
