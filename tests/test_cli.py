"""The `syncwise` command as a user runs it: spawned local ranks, printed steps, metrics.jsonl."""

from __future__ import annotations

import os
import subprocess
import sys

from job_output import failed
from syncwise.metrics import read_jsonl


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "syncwise", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_sft_job_on_two_local_ranks(tmp_path):
    proc = _run(
        ["sft", "sft.steps=3", "sft.batch_size=8", "model.preset=qwen2-test", f"sft.out_dir={tmp_path}/run"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert "fsdp2 on 2 rank(s), sync.mode=auto" in proc.stdout
    # Default budget (90% of RAM) is ample for this model: auto measures, then keeps params unsharded.
    assert "auto sync (measured " in proc.stdout and "=> deferred_unsharded" in proc.stdout
    assert "step 3/3 loss" in proc.stdout  # progress=auto: no terminal here, a line a step
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/step"] for r in rows] == [1, 2, 3]
    assert [r["sync/mode"] for r in rows] == ["per_microbatch", "deferred_unsharded", "deferred_unsharded"]
    # the first step's cap is each rank's longest sequence or 128 tokens (these are shorter); then the
    # largest that fits: one micro-batch
    first, chosen = rows[0]["train/num_microbatches"], rows[1]["train/num_microbatches"]
    assert rows[0]["engine/max_tokens_per_micro_batch"] == rows[0]["batch/largest_microbatch_tokens"] > 1
    assert rows[0]["batch/largest_microbatch_tokens"] <= 128 and chosen == 1
    assert rows[0]["comm/reduce_scatter_count"] == first * 3 and rows[1]["comm/reduce_scatter_count"] == 3
    assert rows[1]["comm/all_gather_count"] == 3
    for row in rows:
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert row[f"comm/{kind}_count"] == row[f"comm/expected_{kind}_count"]
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_config_error_exits_2_before_spawning(tmp_path):
    proc = _run(["sft", "engine.strategy=fsdp3"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "config error: engine.strategy: 'fsdp3' is not one of fsdp2, fsdp1, ddp, none" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_quick_is_the_small_version_of_either_workload():
    from syncwise.jobs.bench.modes import BenchSpec
    from syncwise.jobs.bench.modes import spec_of as modes_spec
    from syncwise.jobs.bench.rl import RLBenchSpec
    from syncwise.jobs.bench.rl import spec_of as rl_spec
    from syncwise.jobs.cli import build_parser

    rl_quick = rl_spec(build_parser().parse_args(["bench", "--workload", "rl", "--quick"]))
    assert rl_quick == RLBenchSpec.quick("runs/bench_rl") and rl_quick != RLBenchSpec()
    assert rl_quick.presets == ["qwen2-tiny"] and rl_quick.sequences < RLBenchSpec().sequences
    rl_custom = rl_spec(build_parser().parse_args(["bench", "--workload", "rl", "--quick", "--repeats", "4"]))
    assert rl_custom.repeats == 4 and rl_custom.presets == ["qwen2-tiny"]
    modes_quick = modes_spec(build_parser().parse_args(["bench", "--quick"]))
    assert modes_quick == BenchSpec.quick("runs/bench")
