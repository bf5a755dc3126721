"""Process groups and device meshes under torchrun's environment (set by torchrun or by
:mod:`syncwise.runtime.launcher`), and the all-reduce every rank agrees through."""

from __future__ import annotations

import datetime
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .job_store import agree_run_id
from .signals import JobStopped, StopRequest


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default group, or (0, 1) without one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within ``dist.timeout_s``: another rank is missing or stuck."""


@contextmanager
def collective_timeout(name: str, timeout_s: float) -> Iterator[None]:
    """Turn a timed-out (or broken) collective into an error that names this rank and the operation."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:
        text = str(exc)
        if isinstance(exc, dist.DistBackendError) or "timed out" in text.lower() or "timeout" in text.lower():
            rank, _ = rank_and_world()
            first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
            raise CollectiveTimeout(
                f"rank {rank}: {name} did not complete within dist.timeout_s={timeout_s:g}s; another rank is "
                f"missing, stuck or failed ({first})"
            ) from exc
        raise


def gather_to_main(obj: Any, what: str, timeout_s: float) -> list[Any] | None:
    """Collective: every rank's ``obj`` (picklable) on rank 0, in rank order; None on the others."""
    rank, world = rank_and_world()
    if world == 1:
        return [obj]
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    with collective_timeout(what, timeout_s):
        dist.gather_object(obj, gathered, dst=0)
    return gathered


def agree(
    sums: list[float], own: list[float], what: str, device: torch.device, timeout_s: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In one all-reduce, sum ``sums`` over ranks and share every rank's ``own`` values (each rank writes
    them into its own slot, zeros elsewhere). Returns (the sums, everyone's own values as [world, k]).

    Every decision that changes which collectives run (micro-batch counts, bad input, auto's mode) is taken
    from what this returns, identically on every rank."""
    rank, world = rank_and_world()
    values = torch.zeros(len(sums) + world * len(own), dtype=torch.float64)
    values[: len(sums)] = torch.tensor(sums, dtype=torch.float64)
    start = len(sums) + rank * len(own)
    values[start : start + len(own)] = torch.tensor(own, dtype=torch.float64)
    if dist.is_initialized():
        values = values.to(device)
        with collective_timeout(what, timeout_s):
            dist.all_reduce(values)
        values = values.cpu()
    return values[: len(sums)], values[len(sums) :].view(world, len(own))


def agree_fields(
    sums: dict[str, float], own: dict[str, float], what: str, device: torch.device, timeout_s: float
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """:func:`agree` by name: ``sums`` summed over ranks, ``own`` shared (each name -> every rank's value, [world]).
    The fields travel in the order of their names, with a checksum of the names beside them: ranks that sent
    different fields (one missing, another added) raise naming ``what``, rather than summing one field into
    another."""
    names, mine = sorted(sums), sorted(own)
    signature = float(zlib.crc32("\0".join([*names, "|", *mine]).encode()))
    totals, per_rank = agree([float(sums[n]) for n in names], [float(own[n]) for n in mine] + [signature], what,
                             device, timeout_s)
    if bool((per_rank[:, -1] != signature).any()):
        raise RuntimeError(f"{what}: the ranks sent different fields (this rank: {', '.join(names + mine)})")
    return (dict(zip(names, totals.tolist(), strict=True)),
            {n: per_rank[:, i] for i, n in enumerate(mine)})


def pick_backend(backend: str = "auto") -> str:
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the process group described by the torchrun environment (a no-op group-less run if absent).

    ``timeout_s`` bounds every collective, so a rank that never arrives becomes an error, not a hang.
    """
    backend = pick_backend(backend)
    if not launched_by_torchrun():
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        return DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend,
            store=attempt_store(rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
        )
        agree_run_id()  # before any signed message: the signatures cover this run alone
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys prefixed by torchrun's restart count.

    After ``torchrun --max-restarts`` restarts the workers, the store can still hold the previous
    attempt's process-group keys; gloo then reads a dead peer's address and waits forever to connect.
    A per-attempt prefix keeps every attempt's rendezvous apart."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"syncwise/attempt_{attempt}", store)


def shutdown() -> None:
    """Leave the process group, after a barrier (gloo can abort at exit without it)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_rank(fn: Callable[..., Any], *args: Any, backend: str = "auto", timeout_s: float = 600.0) -> Any:
    """Join the process group, run ``fn(info, *args)``, and leave it cleanly -- also after a stop every
    rank agreed on. After an error the group is left as it is: the other ranks may never reach a barrier,
    and tearing down a group whose collective failed can abort the process (the launcher exits without it).
    """
    info = init_distributed(backend, timeout_s)
    try:
        result = fn(info, *args)
    except JobStopped:
        shutdown()
        raise
    shutdown()
    return result


def build_mesh(info: DistInfo, hsdp_replicas: int = 1) -> DeviceMesh | None:
    """1-D mesh ("shard",) for FSDP, or 2-D ("replicate", "shard") for HSDP; None without a process group."""
    if not dist.is_initialized():
        return None
    device_type = info.device.type
    if hsdp_replicas <= 1:
        return init_device_mesh(device_type, (info.world_size,), mesh_dim_names=("shard",))
    if info.world_size % hsdp_replicas:
        raise ValueError(
            f"engine.hsdp_replicas={hsdp_replicas} does not divide the world size {info.world_size}"
        )
    shape = (hsdp_replicas, info.world_size // hsdp_replicas)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def agreed_stop(device, timeout_s: float) -> int:
    """Collective: the stop signal any rank received (0: none), the same on every rank -- for loops that run
    no engine step (benchmarks) to stop at an agreed point instead of leaving a peer in a collective."""
    _, per_rank = agree([], [float(StopRequest.received)], "the stop-request all-reduce", device, timeout_s)
    return int(per_rank.max())
