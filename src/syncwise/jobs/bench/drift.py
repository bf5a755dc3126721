"""Step time over many steps, the engine beside a hand-written loop in turn: does either drift up within a run?

Issue 62 measured the engine's steps rising within a run (7.2 -> 9.9 s over five steps; 8.4 -> 11.7 s in
another) while the hand-written loop's stayed flat in the same rounds. :func:`in_turn` runs the two one step each
in turn, every other engine of the bench still alive, and :func:`slope_of` fits each one's line.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch.distributed as dist

from ...engine import Engine
from ...losses import sft_loss
from ...runtime.distributed import DistInfo


def in_turn(entries: list[dict[str, Any]], steps: int, info: DistInfo) -> dict[str, dict[str, Any]]:
    """Each entry (an engine or a hand-written loop, with its ``batch``) one step in turn for ``steps`` rounds: its
    step times (wall, the slowest rank's; this rank's CPU seconds) and their least-squares lines."""
    series = {e["config"]: {"wall_s": [], "cpu_s": []} for e in entries}
    for _ in range(steps):
        for entry in entries:
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            runner = entry["runner"]
            if isinstance(runner, Engine):
                runner.train_batch(entry["batch"], sft_loss)
            else:
                runner.step(entry["batch"])
            cpu = time.process_time() - cpu
            dist.barrier()  # a step ends when the slowest rank is done
            series[entry["config"]]["wall_s"].append(time.perf_counter() - wall)
            series[entry["config"]]["cpu_s"].append(cpu)
    return {name: {**s, "wall": slope_of(s["wall_s"]), "cpu": slope_of(s["cpu_s"])} for name, s in series.items()}


def slope_of(times: list[float]) -> dict[str, Any]:
    """The least-squares line through ``times`` (one per step): its slope per step, what it adds over the run
    relative to the median (``drift``) and the half-width of that figure's 95% interval (``noise``: 2 standard
    errors, from the scatter about the line). Flat within noise: ``abs(drift) <= max(noise, 0.05)``."""
    n = len(times)
    mx, my = (n - 1) / 2, statistics.fmean(times)
    sxx = sum((x - mx) ** 2 for x in range(n))
    slope = sum((x - mx) * (y - my) for x, y in enumerate(times)) / sxx if sxx else 0.0
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in enumerate(times))
    error = math.sqrt(residual / (n - 2) / sxx) if n > 2 and sxx else 0.0
    median = statistics.median(times)
    drift, noise = slope * (n - 1) / median, 2 * error * (n - 1) / median
    return {"slope_s_per_step": slope, "median_s": median, "drift": drift, "noise": noise,
            "flat": abs(drift) <= max(noise, 0.05)}


def drift_lines(records: list[dict[str, Any]]) -> list[str]:
    """The summary's lines: each timed-in-turn row's slope, wall clock and CPU seconds."""
    lines = []
    for r in records:
        for clock, words in (("wall", "step time"), ("cpu", "rank 0's CPU seconds")):
            if clock in r.get("drift", {}):
                d = r["drift"][clock]
                lines.append(f"{r['preset']}: {r['config']}: {words} over {len(r['drift'][clock + '_s'])} steps "
                             f"in turn: slope {d['slope_s_per_step'] * 1e3:+.2f} ms/step, {d['drift']:+.1%} over "
                             f"the run (95% +-{d['noise']:.1%}), flat: {d['flat']}")
    return lines
