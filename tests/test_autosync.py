"""auto's choice among the sync configurations, on an estimator built from shapes (no process group): the
candidates in order of speed, partial(K) among them, and stepping down one unit at a time."""

from __future__ import annotations

from syncwise.memory.accounting import ShardedModel
from syncwise.memory.autosync import AutoSync, Setting, StepShape
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
    chosen = auto.decide(100_000, Setting(SyncChoice(SyncMode.PER_MICROBATCH)), StepShape.fixed(4))
    assert chosen.label == "partial(3)"  # 2000 + 8000 + 8000 = 18000 fits, one more layer does not
    stepped = auto.observe(100_000 + 18_000 + 1, num_microbatches=4)  # longer sequences: the peak grew by 1
    assert stepped.label == "partial(2)" and "stepping down" in auto.decisions[-1]
    assert auto.observe(100_000 + 10_000, num_microbatches=4) == stepped  # within budget again: never back up


# A step of 8 sequences of 512 tokens per rank: caps of 4096, 2048 and 1024 tokens split it into 1, 2 and 4
# micro-batches; activations 10 bytes per token with the fused head, 30 with the logits materialised.
CAPS = {4096: 1, 2048: 2, 1024: 4}
DEFERRED_EXTRA = 34000  # every unit's unsharded gradient beyond its shard (with 2+ micro-batches)
GRADIENT_SHARDS = 34000  # per_microbatch's gradient shards, there from a step's second micro-batch on


def _shape(head_seconds: float, timed: bool = False) -> StepShape:
    def activations(cap, fused):
        return cap * (10 if fused else 30)

    def seconds(setting, n):  # all-gathers per micro-batch, reduce-scatters per micro-batch unless deferred
        syncs = 1 if setting.choice.mode is SyncMode.DEFERRED else n
        return 0.005 * n + 0.01 * syncs + (head_seconds if setting.fused_head else 0.0)

    return StepShape(dict(CAPS), (False, True), activations, seconds, timed=timed)


def test_head_and_cap_chosen_with_the_mode_fastest_that_fits_and_a_budget_change_moves_the_choice():
    """Measured: per_microbatch, fused, 8 micro-batches of 512 tokens (5120 bytes of activations), peaking after
    its first -- beside per_microbatch's gradient shards (34000), which a step of one micro-batch peaks without."""
    deferred, per_microbatch = SyncChoice(SyncMode.DEFERRED), SyncChoice(SyncMode.PER_MICROBATCH)
    first = Setting(per_microbatch, True, 1)
    expected = {
        900_000: Setting(deferred, False, 4096),  # everything fits: deferred, logits materialised, one micro-batch
        60_000: Setting(deferred, True, 4096),  # the logits (122880) do not fit: fused (40960), one micro-batch
        # nothing fits (the measured step neither): the lowest predicted peak, the measured setting's own -- two
        # micro-batches would save 20480 of activations and add the gradient shards (34000)
        5_000: first,
    }
    for free, setting in expected.items():
        auto = AutoSync(MODEL, [deferred, per_microbatch], 100_000 + free)
        chosen = auto.decide(100_000 + 5120, first, _shape(head_seconds=0.001), measured_activations=5120,
                             measured_microbatches=8)
        assert chosen == setting, (free, chosen.label)
        assert auto.base_peak == 100_000 - GRADIENT_SHARDS
        assert auto.predicted_peak == auto.base_peak + auto.extra_bytes(chosen)
        if free > 5_000:
            assert auto.predicted_peak <= auto.budget and "=> " + chosen.label in auto.decisions[-1]
    assert auto.extra_bytes(Setting(deferred, False, 4096)) == 30 * 4096  # one micro-batch: nothing left, no shards
    assert auto.extra_bytes(Setting(deferred, False, 1024)) == DEFERRED_EXTRA + GRADIENT_SHARDS + 30 * 1024
    assert auto.extra_bytes(Setting(per_microbatch, True, 2048)) == GRADIENT_SHARDS + 10 * 2048
    assert "nothing fits" in auto.decisions[-1]
    measured_first = AutoSync(MODEL, [deferred, per_microbatch], 10**6)  # its first micro-batch peaked: no shards
    measured_first.decide(100_000 + 5120, first, _shape(0.001), measured_activations=5120, measured_microbatches=8,
                          peak_in_first=True)
    assert measured_first.base_peak == 100_000


def test_a_later_peak_over_budget_steps_down_to_the_next_fastest_setting_that_fits_and_never_back_up():
    deferred, per_microbatch = SyncChoice(SyncMode.DEFERRED), SyncChoice(SyncMode.PER_MICROBATCH)
    auto = AutoSync(MODEL, [deferred, per_microbatch], 10**6)
    chosen = auto.decide(100_000 + 5120, Setting(per_microbatch, True, 1), _shape(0.001), measured_activations=5120)
    assert chosen == Setting(deferred, False, 4096) and "runner-up " in auto.decisions[-1]
    # something outside grew: the peak is 1 byte over; the logits no longer fit, the next fastest that fits fuses
    stepped = auto.observe(10**6 + 1, 1, measured_activations=4096 * 30)
    assert stepped == Setting(deferred, True, 4096) and "stepping down" in auto.decisions[-1]
    assert auto.observe(100_000, 1) == stepped  # within budget again: never back up


def test_the_fused_head_wins_where_its_extra_compute_costs_less_than_the_micro_batches_it_saves():
    per_microbatch = SyncChoice(SyncMode.PER_MICROBATCH)
    for head_seconds, expected in ((0.001, Setting(per_microbatch, True, 4096)),
                                   (0.1, Setting(per_microbatch, False, 2048))):
        auto = AutoSync(MODEL, [per_microbatch], 100_000 + 70_000)  # materialised fits at 2048 tokens, not 4096
        chosen = auto.decide(100_000 + 5120, Setting(per_microbatch, True, 1), _shape(head_seconds),
                             measured_activations=5120, measured_microbatches=8)
        assert chosen == expected, head_seconds


def test_caps_are_timed_only_where_the_shape_was_timed():
    deferred = SyncChoice(SyncMode.DEFERRED)
    auto = AutoSync(MODEL, [deferred], 10**6)
    chosen = auto.decide(100_000 + 5120, Setting(deferred, True, 1), _shape(0.001), measured_activations=5120)
    assert chosen == Setting(deferred, False, 4096) and auto.trials == [] and auto.mode == chosen


def test_the_chosen_cap_and_the_next_smaller_ones_that_fit_are_timed_and_the_fastest_kept():
    deferred = SyncChoice(SyncMode.DEFERRED)
    auto = AutoSync(MODEL, [deferred], 10**6)
    chosen = auto.decide(100_000 + 5120, Setting(deferred, True, 1), _shape(0.001, timed=True),
                         measured_activations=5120)
    assert chosen == Setting(deferred, False, 4096)
    assert [s.cap for s in auto.trials] == [4096, 2048, 1024]  # same mode and head, smaller caps, all fit
    assert auto.time_trial(15.0) == Setting(deferred, False, 2048)  # the next to time
    assert auto.time_trial(10.0) == Setting(deferred, False, 1024)
    kept = auto.time_trial(11.0)  # all timed: the fastest, 2048 tokens, from now on
    assert kept == Setting(deferred, False, 2048) and auto.mode == kept and not auto.trials
    assert "auto timed a step at each cap (4096: 15 s, 2048: 10 s, 1024: 11 s)" in auto.decisions[-1]
    # the kept cap's prediction from now on (two micro-batches: the gradient shards beside the smaller activations)
    assert auto.predicted_peak == auto.peak_of(kept)
    stepped = auto.observe(10**7, 2)  # a later peak over the budget steps down from the kept cap
    assert auto.candidates.index(stepped) > auto.candidates.index(kept)


def test_deferred_unsharded_adds_the_gathered_parameters_but_the_roots_which_every_peak_has():
    unsharded = SyncChoice(SyncMode.DEFERRED_UNSHARDED)
    held = MODEL.extra_bytes(unsharded, 4)
    assert held == DEFERRED_EXTRA + 4 * 17_000  # every unit's unsharded gradient and gathered parameters
    assert MODEL.peak_extra_bytes(unsharded, 4) == held - 4 * 1000  # the root's parameters: gathered anyway
    assert MODEL.peak_extra_bytes(SyncChoice(SyncMode.DEFERRED), 4) == DEFERRED_EXTRA
    assert MODEL.peak_extra_bytes(unsharded, 1) == 0  # one micro-batch holds nothing between micro-batches
    measured = AutoSync(MODEL, [unsharded], 10**6)  # a measured peak: the root's parameters are in it
    planned = AutoSync(MODEL, [unsharded], 10**6, root_in_base=False)  # a plan's sum without in-flight bytes
    for auto in (measured, planned):
        auto.decide(100_000, Setting(SyncChoice(SyncMode.PER_MICROBATCH)), StepShape.fixed(4))
    assert planned.predicted_peak - measured.predicted_peak == 4 * 1000


def test_an_optimizer_step_peak_is_a_floor_and_a_measured_step_within_budget_sets_the_base_again():
    deferred, per_microbatch = SyncChoice(SyncMode.DEFERRED), SyncChoice(SyncMode.PER_MICROBATCH)
    auto = AutoSync(MODEL, [deferred, per_microbatch], 100_000 + 900_000)
    # the first step peaked in its optimizer step (150000), forward/backward at 100000 + its activations
    chosen = auto.decide(150_000, Setting(per_microbatch, True, 1), _shape(0.001), measured_activations=5120,
                         backward_peak=100_000 + 5120)
    assert chosen == Setting(deferred, False, 4096) and auto.floor == 150_000
    assert "optimizer step" in auto.decisions[-1]
    assert auto.peak_of(chosen) == 100_000 + 30 * 4096  # one micro-batch: nothing held between micro-batches
    assert auto.peak_of(Setting(per_microbatch, True, 1024)) == 150_000  # below the floor: the floor
    # the chosen setting measured: forward/backward 20000 below the prediction -- the base follows it
    backward = 100_000 - 20_000 + 30 * 4096
    assert auto.observe(backward, 1, measured_activations=30 * 4096, backward_peak=backward) == chosen
    assert auto.predicted_for(chosen, 1, 30 * 2048) == max(80_000 + 30 * 2048, 150_000)
    assert auto.predicted_for(chosen, 1, 30 * 4096) == 80_000 + 30 * 4096
    assert auto.observe(10**7, 1) != chosen  # over the budget: steps down as before


def test_a_setting_that_measured_within_the_budget_is_kept_when_nothing_else_is_predicted_to_fit():
    """Issue 38 (8): the first step (per_microbatch, fused, longest-sequence cap) measured within the budget
    and every setting auto chooses among is predicted over it: auto keeps the measured setting, never the
    slowest-ranked one over the budget; a later step over the budget with nothing lower left says so once."""
    per_microbatch = SyncChoice(SyncMode.PER_MICROBATCH)
    first = Setting(per_microbatch, True, 1)
    auto = AutoSync(MODEL, [SyncChoice(SyncMode.DEFERRED), per_microbatch], 100_000 + 6000)
    chosen = auto.decide(100_000 + 5120, first, _shape(0.001), measured_activations=5120, measured_microbatches=8)
    assert chosen == first and auto.predicted_peak == 100_000 + 5120 <= auto.budget
    # the split said beside the setting it is of (issue 38, 13: not "1 micro-batch at its cap" in the header)
    chosen = "=> per_microbatch, fused head, longest-sequence cap (>= 128 tokens) (8 micro-batches, predicted peak"
    assert chosen in auto.decisions[-1]
    assert "micro-batch" not in auto.decisions[-1].split("):")[0]
    said = len(auto.decisions)
    assert auto.observe(100_000 + 7000, 8, measured_activations=5120) == first  # over: nothing lower is left
    assert len(auto.decisions) == said + 1 and "running on over the budget" in auto.decisions[-1]
    auto.observe(100_000 + 7000, 8, measured_activations=5120)
    assert len(auto.decisions) == said + 1  # said once


def test_the_nominal_figures_auto_ranks_by_without_timing():
    from syncwise.memory.costs import nominal_machine

    assert nominal_machine("cpu").describe("cpu") == (
        "nominal cpu links 300 us, 0.6 GB/s and matmul 50 GFLOP/s, caps up to 2048 tokens")
    assert nominal_machine("cuda").describe("cuda") == "nominal cuda links 10 us, 100 GB/s and matmul 400 TFLOP/s"
    assert nominal_machine("xpu") == nominal_machine("cuda")  # an accelerator without its own figures
