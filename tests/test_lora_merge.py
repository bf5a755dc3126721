"""LoRA merges as peft merges, on every layer kind (issue 28, items 1-3): GPT-2's Conv1D layers (square and
not), an adapter on a tied LM head or on tied / untied embeddings. On 2 gloo ranks (FSDP2; FSDP1 and DDP
once each), the rollout copy
refreshed one unit at a time, the merged export and the adapter export each give the adapter model's own
logits (fp32, 1e-5 of their scale)."""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from numerics import FP32_RTOL, assert_close
from scenarios_lora_merge import MERGE_CASES, merge_suite


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(merge_suite, 2)


@pytest.mark.parametrize("case", MERGE_CASES)
def test_refreshed_copy_is_the_adapter_model(ranks, case):
    for rank in ranks:
        r = rank[case]
        assert_close(r["refreshed"], r["adapter_model"], FP32_RTOL, f"{case}: refreshed copy")


@pytest.mark.parametrize("case", MERGE_CASES)
def test_exports_are_the_adapter_model(ranks, case):
    r = ranks[0][case]
    assert_close(r["merged_export"], r["adapter_model"], FP32_RTOL, f"{case}: merged export")
    assert_close(r["adapter_export"], r["adapter_model"], FP32_RTOL, f"{case}: adapter export")


@pytest.mark.parametrize("case", MERGE_CASES)
def test_merge_unties_only_an_adapted_tied_embedding(ranks, case):
    _, tied, targets, _ = MERGE_CASES[case]
    adapted_tied = tied and ("lm_head" in targets or "embed_tokens" in targets)
    assert ranks[0][case]["unties"] is adapted_tied
