"""What communication costs: an α-β model of ring collectives, which units to defer first, and the sync
configurations ``auto`` chooses among (fastest first).

A ring all-gather or reduce-scatter of S bytes over g ranks takes ``(g-1)·α + (g-1)/g·S/β``, an all-reduce
twice that. Deferring a unit's reduce-scatter saves N-1 of them per step and holds its unsharded gradient:
a small unit saves almost as much time as a large one (the α term) for far fewer bytes, so units are
deferred in order of time saved per byte held.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sync.modes import MODES, SPEED_ORDER, SyncChoice, SyncMode
from .accounting import ShardedModel


@dataclass(frozen=True)
class Links:
    """Per-rank link speed within a shard group (and across HSDP replicas)."""

    latency_s: float = 10e-6
    bandwidth: float = 100e9  # bytes / s
    replica_bandwidth: float | None = None
    measured: bool = False  # fitted by a sweep on this machine (syncwise plan --calibrate)

    def gather_or_scatter(self, nbytes: float, group: int) -> float:
        """One ring all-gather or reduce-scatter of ``nbytes`` (the full buffer) over ``group`` ranks."""
        if group <= 1:
            return 0.0
        return (group - 1) * self.latency_s + (group - 1) / group * nbytes / self.bandwidth

    def step_time(self, counts: dict[str, int], nbytes: dict[str, int], shard: int, replicas: int = 1) -> float:
        """All-gathers and reduce-scatters within the shard group, all-reduces across replicas."""
        time = sum(
            counts[kind] * (shard - 1) * self.latency_s + (shard - 1) / shard * nbytes[kind] / self.bandwidth
            for kind in ("all_gather", "reduce_scatter")
        ) if shard > 1 else 0.0
        if replicas > 1:
            beta = self.replica_bandwidth or self.bandwidth
            time += 2 * counts["all_reduce"] * (replicas - 1) * self.latency_s
            time += 2 * (replicas - 1) / replicas * nbytes["all_reduce"] / beta
        return time


@dataclass(frozen=True)
class NominalMachine:
    """What auto ranks by where it times nothing (``sync.auto_timing=false``, the default): the device type's
    links and dense matmul rate, fixed, so the same job ranks alike run to run. CUDA: the figures ``syncwise
    plan`` assumes (an NVLink-class node); CPU: gloo over loopback and one thread's fp32 matmul as measured on a
    2-core CI machine (0.6 GB/s, 250-360 us fitted; 59-88 GFLOP/s at vocabulary and FFN shapes).
    ``largest_cap``: the largest token cap auto chooses without timing (0: none): on a CPU a larger micro-batch
    is slower per token past the caches (timed on 2 cores: 2048 tokens beat 4096 and 8192 in both jobs)."""

    links: Links
    matmul_flops: float  # per second
    largest_cap: int = 0

    def describe(self, device_type: str) -> str:
        cap = f", caps up to {self.largest_cap} tokens" if self.largest_cap else ""
        rate = (f"{self.matmul_flops / 1e12:.3g} TFLOP/s" if self.matmul_flops >= 1e12
                else f"{self.matmul_flops / 1e9:.3g} GFLOP/s")
        return (f"nominal {device_type} links {self.links.latency_s * 1e6:.0f} us, "
                f"{self.links.bandwidth / 1e9:.3g} GB/s and matmul {rate}{cap}")


NOMINAL = {"cpu": NominalMachine(Links(300e-6, 0.6e9), 50e9, largest_cap=2048), "cuda": NominalMachine(Links(), 400e12)}


def head_recompute_seconds(tokens: int, vocab: int, hidden: int, matmul_flops: float) -> float:
    """What the fused LM head adds to a step: each token's logits made once more in backward, 2 x hidden x
    vocabulary FLOPs a token, at ``matmul_flops`` per second."""
    return 2 * tokens * hidden * vocab / matmul_flops


def nominal_machine(device_type: str) -> NominalMachine:
    """The nominal figures of ``device_type`` (an accelerator without its own: CUDA's)."""
    return NOMINAL.get(device_type, NOMINAL["cuda"])


def deferral_order(model: ShardedModel, links: Links) -> list[int]:
    """Units ordered by the reduce-scatter time deferring them saves per byte they then hold, most first
    (ties: root first, then the layers in order). Units that hold nothing extra (frozen) come last."""
    from .accounting import DTYPE_BYTES

    held = model.unit_held_extra()
    reduce = [n * DTYPE_BYTES[model.reduce_dtype] for n in model.unit_padded_numels(trainable_only=True)]

    def value(unit: int) -> float:
        if held[unit] <= 0:
            return -1.0
        return links.gather_or_scatter(reduce[unit], model.shard_size) / held[unit]

    values = [value(u) for u in range(len(held))]
    top = max(values, default=0.0) or 1.0
    # Equal up to rounding (e.g. no latency: every unit saves the same per byte) is a tie: root first.
    return sorted(range(len(held)), key=lambda u: (-round(values[u] / top, 9), u))


def partial_choice(model: ShardedModel, links: Links, count: int) -> SyncChoice:
    """``partial`` deferring the ``count`` units that save the most time per byte."""
    return SyncChoice(SyncMode.PARTIAL, frozenset(deferral_order(model, links)[:count]))


def candidates(modes: tuple[SyncMode, ...], model: ShardedModel, links: Links) -> list[SyncChoice]:
    """The configurations auto may choose, fastest first: the modes in speed order, ``partial`` as
    partial(U-1), ..., partial(1) (partial(U) is ``deferred``; partial(0) ``per_microbatch``)."""
    out: list[SyncChoice] = []
    units = len(model.unit_shapes)
    for mode in (m for m in SPEED_ORDER if m in modes):
        if MODES[mode].per_unit:
            out.extend(partial_choice(model, links, k) for k in range(units - 1, 0, -1))
        else:
            out.append(SyncChoice(mode))
    return out
