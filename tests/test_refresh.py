"""The rollout copy's weight refresh, one unit at a time, on 2 gloo ranks: the same weights as the whole
model's full state dict (FSDP2, FSDP1, DDP, LoRA merged, activation checkpointing), and its extra memory,
measured with torch's tensor tracker, within the largest unit + 10% -- where gathering the whole model at
once needs all of it."""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from scenarios_refresh import refresh_suite


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(refresh_suite, 2)


@pytest.mark.parametrize("case", ["fsdp2", "fsdp1", "ddp", "fsdp2_lora", "fsdp2_checkpointed"])
def test_refresh_by_unit_writes_exactly_the_full_state(ranks, case):
    for rank in ranks:
        assert rank[case]["keys_missing"] == [] and rank[case]["mismatched"] == [], case


def test_refresh_by_unit_holds_one_unit_at_a_time(ranks):
    for rank in ranks:
        r = rank["fsdp2"]
        assert r["by_unit_extra"] <= 1.10 * r["largest_unit_bytes"], r
        assert r["whole_model_extra"] >= 0.9 * r["model_bytes"], r  # the old path: the tracker sees it all
        assert r["largest_unit_bytes"] < 0.25 * r["model_bytes"]  # so the two are far apart
