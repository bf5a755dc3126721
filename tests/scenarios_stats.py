"""Scenarios of tests/test_rollout_stats.py run on several ranks."""

from __future__ import annotations


def fields_by_name(info, differ: bool) -> dict:
    """Every rank sums two named fields and shares one; ``differ``: rank 1 names its second field otherwise."""
    from syncwise.runtime.distributed import agree_fields

    second = "tokens" if not differ or info.rank == 0 else "tokens_seen"
    try:
        sums, own = agree_fields({"samples": 2.0 + info.rank, second: 10.0}, {"longest": 5.0 * (info.rank + 1)},
                                 "the test's all-reduce", info.device, 60.0)
    except RuntimeError as error:
        return {"error": str(error)}
    return {"sums": sums, "own": {k: v.tolist() for k, v in own.items()}}
