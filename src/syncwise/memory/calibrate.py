"""Link speeds measured on this machine: a short timed sweep of all-gathers and reduce-scatters over the
ranks of a process group, fitted to the α-β model of :class:`syncwise.memory.costs.Links`.

Each size is timed ``repeats`` times after a warm-up (the median is kept); a collective's time is
``(g-1)·α + (g-1)/g·S/β`` for S bytes over g ranks, so a least-squares line through (S, time) gives β from
its slope and α from its intercept. ``syncwise plan --calibrate`` uses it instead of the assumed links;
``syncwise bench`` times the minimum collectives of a step with :func:`time_collective`, and auto's timed
ranking and the bench's roofline a matmul with :func:`best_matmul_seconds`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..sync.counting import FSDP2_ALL_GATHER, FSDP2_REDUCE_SCATTER
from .costs import Links

SIZES = tuple(4**k * 1024 for k in range(1, 9))  # 4 KiB .. 64 MiB


@dataclass(frozen=True)
class Sample:
    kind: str  # all_gather | reduce_scatter
    nbytes: int  # the full (gathered / scattered) buffer
    seconds: float


def time_collective(kind: str, nbytes: int, device: torch.device, repeats: int = 5,
                    group: dist.ProcessGroup | None = None) -> float:
    """Median seconds of one all-gather (``nbytes`` gathered) or reduce-scatter (``nbytes`` scattered)."""
    world = dist.get_world_size(group)
    elements = max(world, nbytes // 4 // world * world)
    full = torch.zeros(elements, dtype=torch.float32, device=device)
    shard = torch.zeros(elements // world, dtype=torch.float32, device=device)
    times = []
    for index in range(repeats + 1):  # the first is a warm-up
        dist.barrier(group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if kind == "all_gather":
            getattr(dist, FSDP2_ALL_GATHER)(full, shard, group=group)
        else:
            getattr(dist, FSDP2_REDUCE_SCATTER)(shard, full, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def best_matmul_seconds(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """The fastest of ``repeats`` timings of ``a @ b`` on this rank (synchronised on CUDA)."""
    best = float("inf")
    for _ in range(repeats):
        if a.device.type == "cuda":
            torch.cuda.synchronize(a.device)
        start = time.perf_counter()
        a @ b
        if a.device.type == "cuda":
            torch.cuda.synchronize(a.device)
        best = min(best, time.perf_counter() - start)
    return best


def sweep(device: torch.device, sizes: tuple[int, ...] = SIZES, repeats: int = 5) -> list[Sample]:
    """Every size, both kinds, on the default group (collective: every rank calls it)."""
    return [Sample(kind, size, time_collective(kind, size, device, repeats)) for size in sizes
            for kind in ("all_gather", "reduce_scatter")]


def fit(samples: list[Sample], group: int) -> Links:
    """α and β of the ring model from a sweep over ``group`` ranks: least squares on the relative error,
    so the small (latency-bound) sizes weigh as much as the large (bandwidth-bound) ones."""
    if group < 2:
        raise ValueError("calibration needs at least 2 ranks")
    xs = [(group - 1) / group * s.nbytes for s in samples]
    ys = [s.seconds for s in samples]
    weights = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys, strict=True)) / sum(
        w * (x - mean_x) ** 2 for w, x in zip(weights, xs, strict=True)
    )
    intercept = mean_y - slope * mean_x
    return Links(latency_s=max(intercept, 0.0) / (group - 1), bandwidth=1.0 / slope if slope > 0 else float("inf"),
                 measured=True)


def calibrate_worker(payload: dict) -> None:
    """Entry point of one rank of ``syncwise plan --calibrate``: the sweep, written by rank 0 as JSON."""
    import json
    from pathlib import Path

    from ..runtime.distributed import run_rank

    def body(info) -> None:
        samples = sweep(info.device, repeats=payload.get("repeats", 5))
        if info.is_main:
            Path(payload["out"]).write_text(json.dumps({"group": info.world_size,
                                                         "samples": [s.__dict__ for s in samples]}))

    run_rank(body)


def calibrate_here(nproc: int) -> tuple[Links, list[Sample]]:
    """Spawn ``nproc`` local ranks, sweep, fit."""
    import json
    import tempfile
    from pathlib import Path

    from ..runtime.launcher import launch_local

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "sweep.json"
        job = launch_local(calibrate_worker, nproc, {"out": str(out)})
        if job.exit_code != 0:
            raise RuntimeError("the calibration sweep failed (see above)")
        data = json.loads(out.read_text())
    samples = [Sample(**s) for s in data["samples"]]
    return fit(samples, data["group"]), samples
