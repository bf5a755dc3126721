"""How a batch's sequences are spread over micro-batches as numbers: the workload estimate, what a micro-batch
computes (its token cost), the fewest micro-batches under a token cap, and balanced partitions (Karmarkar-Karp) --
on lengths and weights alone (:mod:`syncwise.data.batching` applies them to batches)."""

from __future__ import annotations

import heapq

import torch


def workloads(lengths: torch.Tensor, linear_coef: float = 24576.0) -> list[float]:
    """Compute estimate per sequence: ``a·L + L²`` (the linear layers, then attention), as verl does."""
    return [linear_coef * float(n) + float(n) ** 2 for n in lengths.tolist()]


def token_cost(lengths: list[int], packed: bool) -> int:
    """Positions a micro-batch computes: its real tokens when packed, rows × the longest when padded."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def capped_bins(lengths: list[int], budget: int, packed: bool) -> list[list[int]]:
    """The fewest micro-batches whose :func:`token_cost` stays within ``budget``: first-fit decreasing
    when packed; when padded, longest first, each micro-batch taking as many of the next (shorter)
    sequences as ``budget // longest`` rows allow."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    if packed:
        loads: list[int] = []
        for i in order:
            for b, load in enumerate(loads):
                if load + lengths[i] <= budget:
                    bins[b].append(i)
                    loads[b] += lengths[i]
                    break
            else:
                bins.append([i])
                loads.append(lengths[i])
    else:
        position = 0
        while position < len(order):
            rows = max(1, budget // max(lengths[order[position]], 1))  # an all-padding row costs a column
            bins.append(order[position : position + rows])
            position += rows
    return [sorted(b) for b in bins]


def capped_partition(
    lengths: list[int], weights: list[float], k: int, budget: int, packed: bool
) -> list[list[int]]:
    """Exactly ``k`` groups (some possibly empty), each within the budget, as balanced as it allows:
    Karmarkar–Karp when its partition fits; else heaviest first into the lightest group with room;
    else the fewest-bins solution with empty groups added. ``k`` is at least :func:`capped_bins`'s count."""

    def fits(group: list[int]) -> bool:
        return token_cost([lengths[i] for i in group], packed) <= budget

    parts = karmarkar_karp(weights, k)
    if all(fits(p) for p in parts):
        return parts
    groups: list[list[int]] = [[] for _ in range(k)]
    loads = [0.0] * k
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        room = [g for g in range(k) if fits(groups[g] + [i])]
        if not room:
            break
        g = min(room, key=lambda g: (loads[g], g))
        groups[g].append(i)
        loads[g] += weights[i]
    else:
        return [sorted(g) for g in groups]
    bins = capped_bins(lengths, budget, packed)
    return bins + [[] for _ in range(k - len(bins))]


def karmarkar_karp(weights: list[float], k: int) -> list[list[int]]:
    """Partition item indices into ``k`` sets with near-equal weight sums (largest differencing method).

    Every item starts as a k-way partial partition (itself in one set, k-1 empty); repeatedly the two
    partial partitions with the largest spread are merged, heaviest set of one with lightest of the
    other, until one remains. Far better balanced than greedy or consecutive splits on long tails.
    """
    if k < 1:
        raise ValueError("karmarkar_karp: k must be >= 1")
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, w in enumerate(weights):
        sets = [(float(w), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(w), i, sets))
    if not heap:
        return [[] for _ in range(k)]
    counter = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: s[0], reverse=True)
        b = sorted(b, key=lambda s: s[0])
        merged = sorted(((wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, b, strict=True)),
                        key=lambda s: s[0], reverse=True)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [sorted(indices) for _, indices in heap[0][2]]


def imbalance(weights: list[float], partitions: list[list[int]]) -> float:
    """max / min workload over the non-empty partitions (1.0 = perfectly balanced)."""
    sums = [sum(weights[i] for i in part) for part in partitions if part]
    return max(sums) / min(sums) if sums and min(sums) > 0 else float("inf")
