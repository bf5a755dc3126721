"""One rank of ``syncwise train``: a trainer (:mod:`syncwise.rl.trainer`) or, with ``dist.rollout_ranks``, one of
the job's last ranks, which only sample (:mod:`syncwise.rl.rollout_rank`)."""

from __future__ import annotations

import os
from typing import Any

from ..config import load_config_dict
from ..runtime.distributed import run_rank, shutdown
from ..runtime.launcher import describe
from ..runtime.roles import join_roles
from ..runtime.sandbox import UNSAFE_ENV
from ..runtime.signals import JobStopped
from .rollout_rank import run_rollout_rank
from .trainer import RLTrainer, run_rl


def train_worker(config_dict: dict[str, Any]) -> None:
    """Entry point of one rank (picklable, for the local launcher and torchrun): a trainer, or with
    ``dist.rollout_ranks`` the last ranks of the job sample (:mod:`syncwise.rl.rollout_rank`)."""
    config = load_config_dict(config_dict)
    if config.rl.sandbox_unsafe_no_isolation:  # read by run_python, whoever calls it on this rank
        os.environ[UNSAFE_ENV] = "1"
    dist = config.dist
    if not dist.rollout_ranks:
        run_rank(lambda info: run_rl(config, info), backend=dist.backend, timeout_s=dist.timeout_s)
        return
    info, roles = join_roles(dist.rollout_ranks, dist.backend, dist.timeout_s)
    if roles.is_rollout:
        try:
            run_rollout_rank(config, info, roles)
        except Exception as exc:
            raise RolloutRankFailed(f"{roles.describe_rank()}: {describe(exc)}") from exc
        return
    try:
        RLTrainer(config, info, roles).run()
    except JobStopped:
        shutdown()
        raise
    shutdown()


class RolloutRankFailed(RuntimeError):
    """A rollout rank's error, named as such (its rank in the job is not a trainer's)."""
