"""syncwise: FSDP training for LLM post-training whose gradient accumulation syncs once per optimizer step.

The public names are imported on first use (PEP 562), so the command line answers ``--help``, argument
errors and config errors without importing torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_PUBLIC = {
    "CollectiveCounter": "syncwise.sync.counting",
    "Config": "syncwise.config",
    "DPOConfig": "syncwise.jobs.trainers",
    "DPOTrainer": "syncwise.jobs.trainers",
    "GRPOConfig": "syncwise.jobs.trainers",
    "GRPOTrainer": "syncwise.jobs.trainers",
    "JobFailed": "syncwise.jobs.trainers",
    "SFTConfig": "syncwise.jobs.trainers",
    "SFTTrainer": "syncwise.jobs.trainers",
    "ConfigError": "syncwise.config",
    "Engine": "syncwise.engine",
    "ForwardBackwardResult": "syncwise.engine",
    "LossOutput": "syncwise.losses",
    "Normalizer": "syncwise.losses",
    "SyncMode": "syncwise.sync.modes",
    "count_collectives": "syncwise.sync.counting",
    "expected_collectives": "syncwise.memory.schedule",
    "gradient_sync": "syncwise.sync.switches",
    "load_config": "syncwise.config",
    "sft_loss": "syncwise.losses",
}

__all__ = [
    "CollectiveCounter", "Config", "ConfigError", "DPOConfig", "DPOTrainer", "Engine", "ForwardBackwardResult",
    "GRPOConfig", "GRPOTrainer", "JobFailed", "LossOutput", "Normalizer", "SFTConfig", "SFTTrainer", "SyncMode",
    "count_collectives", "expected_collectives", "gradient_sync", "load_config", "sft_loss",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'syncwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:  # for type checkers and IDEs: the names as if imported here
    from .config import Config, ConfigError, load_config
    from .engine import Engine, ForwardBackwardResult
    from .jobs.trainers import (
        DPOConfig,
        DPOTrainer,
        GRPOConfig,
        GRPOTrainer,
        JobFailed,
        SFTConfig,
        SFTTrainer,
    )
    from .losses import LossOutput, Normalizer, sft_loss
    from .memory.schedule import expected_collectives
    from .sync.counting import CollectiveCounter, count_collectives
    from .sync.modes import SyncMode
    from .sync.switches import gradient_sync
