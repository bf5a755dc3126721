from __future__ import annotations

import pytest
import torch

from syncwise.data.batching import ROW_GROUP, BatchError, microbatches_needed, restore_order, split_batch
from syncwise.data.partition import capped_bins, imbalance, karmarkar_karp, token_cost, workloads


def _long_tail(n: int = 64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = (16 + -torch.log(torch.rand(n, generator=gen)) * 200).long().clamp(max=4096)
    return lengths


def _padded(lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    width = int(lengths.max())
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.arange(len(lengths))[:, None].expand(-1, width) + 1  # each sample's id in its tokens
    return {"input_ids": ids * mask, "attention_mask": mask}


def test_karmarkar_karp_beats_the_naive_split_on_a_long_tail():
    lengths = _long_tail()
    weights = workloads(lengths)
    for k in (2, 4, 8):
        kk = karmarkar_karp(weights, k)
        assert sorted(i for part in kk for i in part) == list(range(len(weights)))
        naive = [chunk.tolist() for chunk in torch.arange(len(weights)).tensor_split(k)]
        kk_ratio, naive_ratio = imbalance(weights, kk), imbalance(weights, naive)
        print(f"k={k}: max/min workload Karmarkar-Karp {kk_ratio:.4f}, consecutive {naive_ratio:.4f}")
        assert kk_ratio < naive_ratio
        assert kk_ratio < 1.05


def test_karmarkar_karp_small_cases():
    assert karmarkar_karp([5.0, 5.0, 4.0, 3.0, 3.0], 2) in ([[0, 2], [1, 3, 4]], [[1, 3, 4], [0, 2]],
                                                            [[0, 3, 4], [1, 2]], [[1, 2], [0, 3, 4]])
    parts = karmarkar_karp([1.0], 3)
    assert sorted(map(len, parts)) == [0, 0, 1]
    assert karmarkar_karp([], 2) == [[], []]


def test_split_balanced_restores_order_exactly():
    lengths = _long_tail(n=23, seed=1)
    batch = _padded(lengths)
    micro = split_batch(batch, 5, balance=True)
    assert len(micro) == 5
    # Each micro-batch is trimmed to its own longest sequence.
    for mb in micro:
        assert mb.data["input_ids"].shape[1] == int(lengths[mb.indices].max())
    # A per-sample output (its first token = sample id) comes back in the original order.
    chunks = [mb.data["input_ids"][:, 1:].float() for mb in micro]
    restored = restore_order(chunks, micro, seq_len=batch["input_ids"].shape[1])
    assert torch.equal(restored, batch["input_ids"][:, 1:].float())


def test_split_gives_empty_microbatches_when_samples_run_out():
    batch = _padded(torch.tensor([5, 3]))
    micro = split_batch(batch, 4)
    assert [mb.indices.tolist() for mb in micro] == [[0], [1], [], []]
    assert micro[2].data is None and micro[3].data is None
    restored = restore_order([mb.data["input_ids"] for mb in micro[:2]], micro, seq_len=5)
    assert torch.equal(restored, batch["input_ids"])


def test_per_target_tensors_are_trimmed_to_width_minus_one():
    batch = _padded(torch.tensor([3, 2, 8]))
    batch["advantages"] = torch.randn(3, 7)  # per target token: T - 1 columns
    batch["scores"] = torch.randn(3)
    micro = split_batch(batch, 2)
    first = micro[0].data  # samples 0 and 1, longest 3
    assert first["input_ids"].shape == (2, 3)
    assert first["advantages"].shape == (2, 2)
    assert first["scores"].shape == (2,)


def test_microbatches_needed():
    batch = _padded(torch.tensor([10, 30, 20]))
    assert microbatches_needed(batch, micro_batch_size=2) == 2
    assert microbatches_needed(batch, micro_batch_size=2, max_tokens=30) == 2  # ceil(60 / 30)
    assert microbatches_needed(batch, micro_batch_size=2, max_tokens=40) == 2
    assert microbatches_needed(batch, micro_batch_size=2, max_tokens=59) == 2
    assert microbatches_needed(_padded(torch.tensor([10, 30, 21])), 2, max_tokens=30) == 3
    with pytest.raises(BatchError, match="a sequence of 30 tokens exceeds engine.max_tokens_per_micro_batch=25"):
        microbatches_needed(_padded(torch.tensor([30])), micro_batch_size=1, max_tokens=25)


def _lengths_of(batch, micro) -> list[list[int]]:
    lengths = batch["attention_mask"].sum(1)
    return [lengths[mb.indices].tolist() for mb in micro if mb.data is not None]


@pytest.mark.parametrize(("lengths", "budget", "packed", "expected"), [
    ([6, 6, 6], 10, True, [[6], [6], [6]]),  # was one micro-batch of 12 real tokens
    ([9, 1, 1, 9], 10, False, [[1, 1], [9], [9]]),  # was 2 x 9 = 18 padded positions
    ([9, 1, 1, 9], 10, True, [[1, 9], [1, 9]]),
])
def test_token_budget_is_a_cap(lengths, budget, packed, expected):
    batch = _padded(torch.tensor(lengths))
    k = microbatches_needed(batch, 1, max_tokens=budget, packed=packed)
    micro = split_batch(batch, k, max_tokens=budget, packed=packed)
    assert sorted(sorted(group) for group in _lengths_of(batch, micro)) == expected
    for group in _lengths_of(batch, micro):
        assert token_cost(group, packed) <= budget


@pytest.mark.parametrize("packed", [True, False])
def test_every_microbatch_keeps_within_the_budget_on_long_tails(packed):
    """Many long-tailed batches, budgets and agreed counts (a rank may have to run more micro-batches than it
    needs, when another rank needs more): never over the budget, every sample exactly once."""
    for seed in range(40):
        lengths = _long_tail(n=3 + seed % 20, seed=seed).clamp(max=600)
        batch = _padded(lengths)
        budget = int(lengths.max()) + 97 * (seed % 5)
        needed = microbatches_needed(batch, 1, max_tokens=budget, packed=packed)
        for k in (needed, needed + 1, needed + 3):
            micro = split_batch(batch, k, max_tokens=budget, packed=packed)
            assert len(micro) == k
            assert sorted(i for mb in micro for i in mb.indices.tolist()) == list(range(len(lengths)))
            assert all(token_cost(group, packed) <= budget for group in _lengths_of(batch, micro)), (seed, k)


@pytest.mark.parametrize("packed", [True, False])
def test_rows_of_one_group_share_a_micro_batch_in_every_split(packed):
    """Preference pairs (``row_group``): under a cap (any agreed count), balanced alone, and consecutive by a
    fixed size, every pair's rows land in one micro-batch, every row exactly once, within the cap."""
    for seed in range(30):
        lengths = _long_tail(n=2 * (2 + seed % 9), seed=seed).clamp(max=300)
        batch = _padded(lengths)
        batch[ROW_GROUP] = torch.arange(len(lengths) // 2).repeat_interleave(2).flip(0)  # any group ids
        pairs = [sorted(lengths[[2 * p, 2 * p + 1]].tolist()) for p in range(len(lengths) // 2)]
        budget = max(token_cost(pair, packed) for pair in pairs) + 53 * (seed % 4)
        needed = microbatches_needed(batch, 1, max_tokens=budget, packed=packed)
        splits = [(k, {"max_tokens": budget}) for k in (needed, needed + 2)]
        splits += [(3, {"balance": True}), (microbatches_needed(batch, 3), {})]
        for k, how in splits:
            micro = split_batch(batch, k, packed=packed, **how)
            assert len(micro) == k
            assert sorted(i for mb in micro for i in mb.indices.tolist()) == list(range(len(lengths)))
            for mb in micro:
                rows = mb.indices.tolist()
                assert all(row ^ 1 in rows for row in rows), (seed, how, rows)  # its pair beside it
                if "max_tokens" in how and rows:
                    assert token_cost(lengths[rows].tolist(), packed) <= budget, (seed, k)
    # a fixed size of 3 rows holds one pair; a pair over a fixed cap is one line naming the rows
    pairs = _padded(torch.tensor([10, 12, 8, 9]))
    pairs[ROW_GROUP] = torch.tensor([0, 0, 1, 1])
    assert microbatches_needed(pairs, 3) == 2 and microbatches_needed(pairs, 4) == 1
    with pytest.raises(BatchError, match=r"rows \[0, 1\] \(one batch\['row_group'\] value: kept in one micro-batch\) "
                                         r"need 22 tokens, more than engine.max_tokens_per_micro_batch=20"):
        microbatches_needed(pairs, 1, max_tokens=20)


def test_capped_bins_is_the_fewest_for_equal_lengths():
    assert len(capped_bins([4] * 10, 12, packed=True)) == 4  # 3 per micro-batch
    assert len(capped_bins([4] * 10, 12, packed=False)) == 4
    assert len(capped_bins([5, 4, 4, 4], 12, packed=False)) == 2  # [5, 4] rows x 5 = 10, then [4, 4]
