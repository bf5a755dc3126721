from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from syncwise.memory.schedule import expected_collectives
from syncwise.sync.counting import FSDP2_REDUCE_SCATTER, CollectiveCounter, count_collectives


def test_expected_counts_match_reference_measurements():
    # REFERENCE.md: Qwen2 tiny, 5 FSDP units, 4 micro-batches: 36 all-gathers; 20 vs 5 reduce-scatters.
    per_mb = expected_collectives("per_microbatch", 4, 5, engine_all_reduces=0)
    deferred = expected_collectives("deferred", 4, 5, engine_all_reduces=0)
    assert per_mb == {"all_gather": 36, "reduce_scatter": 20, "all_reduce": 0}
    assert deferred == {"all_gather": 36, "reduce_scatter": 5, "all_reduce": 0}


def test_expected_counts_variants():
    assert expected_collectives("deferred", 8, 3, reshard_after_forward=False)["all_gather"] == 24
    hsdp = expected_collectives("per_microbatch", 2, 3, hsdp=True, engine_all_reduces=3)
    assert hsdp["all_reduce"] == 3 + 6
    assert expected_collectives("deferred", 2, 3, hsdp=True)["all_reduce"] == 3 + 3
    with pytest.raises(ValueError, match="mode 'lazy'"):
        expected_collectives("lazy", 2, 3)
    with pytest.raises(ValueError):
        expected_collectives("deferred", 0, 3)


def test_counter_patches_and_restores_torch_distributed():
    original = dist.all_reduce
    with count_collectives():
        assert dist.all_reduce is not original
        assert dist.all_reduce.__wrapped__ is original
    assert dist.all_reduce is original


def test_deprecated_alias_counted_once_with_full_buffer_bytes():
    """all_gather_into_tensor calls all_gather_single through the module: one collective, not two."""
    out, inp = torch.zeros(8), torch.zeros(4)
    with count_collectives() as counts, pytest.raises((ValueError, RuntimeError)):
        dist.all_gather_into_tensor(out, inp)  # no process group here: raises after being counted
    assert counts.counts == {"all_gather": 1, "reduce_scatter": 0, "all_reduce": 0}
    assert counts.bytes["all_gather"] == 8 * 4


def test_nested_counters_both_count():
    with CollectiveCounter() as outer:
        with CollectiveCounter() as inner, pytest.raises((ValueError, RuntimeError)):
            getattr(dist, FSDP2_REDUCE_SCATTER)(torch.zeros(2), torch.zeros(4))
        with pytest.raises((ValueError, RuntimeError)):
            dist.all_reduce(torch.zeros(3))
    assert inner.totals.counts["reduce_scatter"] == 1 and inner.totals.counts["all_reduce"] == 0
    assert outer.totals.counts == {"all_gather": 0, "reduce_scatter": 1, "all_reduce": 1}
    assert outer.totals.bytes["reduce_scatter"] == 16


def _closed_form(mode, n, u, raf, uf, hsdp):
    if mode == "deferred_unsharded":
        gathers = u if (uf or not raf) else u + (u - 1) * n
    else:
        gathers = (2 * u - 1 if raf else u) * n
    scatters = u * n if mode in ("per_microbatch", "replica_deferred") else u
    replica = (u * n if mode == "per_microbatch" else u) if hsdp else 0
    return {"all_gather": gathers, "reduce_scatter": scatters, "all_reduce": replica}


@pytest.mark.parametrize("mode", ["per_microbatch", "deferred", "deferred_unsharded", "replica_deferred"])
def test_schedule_simulation_equals_closed_form(mode):
    for n in range(1, 6):
        for u in range(1, 7):
            for raf in (True, False):
                for uf in (True, False):
                    for hsdp in (True, False):
                        if mode == "replica_deferred" and not hsdp:
                            continue
                        got = expected_collectives(
                            mode, n, u, reshard_after_forward=raf, unsharded_forward=uf, hsdp=hsdp,
                            engine_all_reduces=0,
                        )
                        assert got == _closed_form(mode, n, u, raf, uf, hsdp), (mode, n, u, raf, uf, hsdp)


def test_step_traffic_bytes():
    from syncwise.memory.schedule import UnitTraffic, step_traffic

    units = [UnitTraffic(100, 400, 200), UnitTraffic(10, 40, 20), UnitTraffic(10, 40, 20)]
    deferred = step_traffic("deferred", 4, units, hsdp=True)
    assert deferred.bytes == {"all_gather": 4 * (120 + 20), "reduce_scatter": 480, "all_reduce": 240}
    per_mb = step_traffic("per_microbatch", 4, units)
    assert per_mb.bytes == {"all_gather": 4 * 140, "reduce_scatter": 4 * 480, "all_reduce": 0}


def test_one_rank_shard_group_gathers_and_scatters_nothing():
    got = expected_collectives("per_microbatch", 4, 5, sharded=False, engine_all_reduces=3)
    assert got == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 3}
