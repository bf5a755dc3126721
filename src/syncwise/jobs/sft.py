"""`syncwise sft`'s entry point in each rank (see :mod:`syncwise.sft.trainer` for the job itself)."""

from __future__ import annotations

from typing import Any

from ..config import load_config_dict
from ..runtime.distributed import run_rank
from ..sft.trainer import run_sft


def sft_worker(config_dict: dict[str, Any]) -> None:
    """Entry point of one rank (picklable, for the local launcher and torchrun)."""
    config = load_config_dict(config_dict)
    run_rank(lambda info: run_sft(config, info), backend=config.dist.backend, timeout_s=config.dist.timeout_s)
