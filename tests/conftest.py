"""The order `make test` hands modules to its two workers (pytest-xdist, ``--dist loadfile``: a module runs whole
on one worker): the slowest first, so that neither worker is left running one of them alone at the end."""

from __future__ import annotations

# By serial seconds on 2 CPU cores (pytest --durations=0, 2026-12-04: 242 s for the README recipes down to 66 s);
# the rest follow in their usual order. A module missing here only runs later, it is not skipped.
SLOWEST_FIRST = ("test_readme_recipe", "test_train", "test_stop_and_errors", "test_rollout_engines", "test_bench",
                 "test_ppo_job", "test_dpo", "test_auto_output", "test_warm_start", "test_grpo_user", "test_agents",
                 "test_tool_jobs", "test_sft", "test_sequence_parallel", "test_loggers", "test_plan",
                 "test_auto_tuning")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module's own order kept
