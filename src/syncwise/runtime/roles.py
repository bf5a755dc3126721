"""A job's ranks in two roles (``dist.rollout_ranks`` = M): the first N - M train, the last M only sample.

The trainers form the default process group among themselves (ranks 0 .. N - M - 1), on the job's rendezvous
store under a prefix of their own, so that the FSDP engine and every all-reduce they agree through run as in a job
of N - M ranks. Each rollout rank is a default group of one, on a store of its own: a rollout engine that builds
inside the default group (an external launcher's) runs there as in a job of one rank. Trainer 0 and the rollout
ranks share a group of their own for the weights (:func:`weights_group`: gloo on CPU, NCCL on GPU; never the FSDP
mesh), and every rank reaches the store (:attr:`JobRoles.store`) for the small messages between the roles. Under
the local launcher and torchrun alike: the split is read from torchrun's environment.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .distributed import DistInfo, attempt_store, pick_backend


@dataclass(frozen=True)
class JobRoles:
    """Where this rank stands in a job with rollout ranks."""

    trainers: int
    rollout_ranks: int
    job_rank: int  # in the whole job (RANK)
    store: dist.Store  # the job's store (this attempt's keys)

    @property
    def is_rollout(self) -> bool:
        return self.job_rank >= self.trainers

    @property
    def rollout_index(self) -> int:
        """This rollout rank's place among the rollout ranks (0 .. M - 1)."""
        return self.job_rank - self.trainers

    def served_by(self, index: int) -> list[int]:
        """The trainers whose batches rollout rank ``index`` draws: trainer r by rollout rank r mod M."""
        return [r for r in range(self.trainers) if r % self.rollout_ranks == index]

    def describe_rank(self) -> str:
        if self.is_rollout:
            return f"rollout rank {self.job_rank} (of ranks {self.trainers}-{self.trainers + self.rollout_ranks - 1})"
        return f"trainer rank {self.job_rank}"


def join_roles(rollout_ranks: int, backend: str = "auto", timeout_s: float = 600.0) -> tuple[DistInfo, JobRoles]:
    """This rank's place in a job of trainers and ``rollout_ranks`` rollout ranks (torchrun's environment; the
    local launcher sets it): a trainer joins the trainers' default group and gets its rank among them; a rollout
    rank makes a default group of its own, of one rank, and gets its place among the rollout ranks."""
    backend = pick_backend(backend)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    trainers = world - rollout_ranks
    if not 0 < rollout_ranks <= trainers:
        raise ValueError(f"dist.rollout_ranks={rollout_ranks} needs at least as many trainers among the job's "
                         f"{world} ranks (each rollout rank serves one or more trainers)")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = attempt_store(rank, world, timeout)
    roles = JobRoles(trainers, rollout_ranks, rank, store)
    if roles.is_rollout:  # a default group of one, on a store of its own
        group_store, group_rank, group_size = dist.HashStore(), 0, 1
        own_rank, own_world = roles.rollout_index, rollout_ranks  # its place among the rollout ranks
    else:
        group_store, group_rank, group_size = dist.PrefixStore("trainers", store), rank, trainers
        own_rank, own_world = rank, trainers
    if not dist.is_initialized():
        dist.init_process_group(backend, store=group_store, rank=group_rank, world_size=group_size, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    return DistInfo(rank=own_rank, world_size=own_world, local_rank=local_rank, device=device), roles


def weights_group(roles: JobRoles, device: torch.device, timeout_s: float) -> dist.ProcessGroup | None:
    """The group trainer 0 sends the weights over: its rank 0 is trainer 0, rank i the i-th rollout rank; None on
    the other trainers. Built directly on the job's store (it is no part of the default group's world)."""
    if not roles.is_rollout and roles.job_rank != 0:
        return None
    rank = roles.rollout_index + 1 if roles.is_rollout else 0
    store = dist.PrefixStore("weights", roles.store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, roles.rollout_ranks + 1, options)
    return dist.ProcessGroupGloo(store, rank, roles.rollout_ranks + 1, timeout)
