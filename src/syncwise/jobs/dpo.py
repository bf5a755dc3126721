"""`syncwise dpo`'s entry point in each rank (see :mod:`syncwise.dpo.trainer` for the job itself)."""

from __future__ import annotations

from typing import Any

from ..config import load_config_dict
from ..dpo.trainer import run_dpo
from ..runtime.distributed import run_rank


def dpo_worker(config_dict: dict[str, Any]) -> None:
    """Entry point of one rank (picklable, for the local launcher and torchrun)."""
    config = load_config_dict(config_dict)
    run_rank(lambda info: run_dpo(config, info), backend=config.dist.backend, timeout_s=config.dist.timeout_s)
