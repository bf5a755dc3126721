"""syncwise: FSDP training for LLM post-training whose gradient accumulation syncs once per optimizer step."""

from .config import Config, ConfigError, load_config
from .engine import Engine, ForwardBackwardResult
from .losses import LossOutput, Normalizer, sft_loss
from .memory.schedule import expected_collectives
from .sync.counting import CollectiveCounter, count_collectives
from .sync.modes import SyncMode
from .sync.switches import gradient_sync

__all__ = [
    "CollectiveCounter",
    "Config",
    "ConfigError",
    "Engine",
    "ForwardBackwardResult",
    "LossOutput",
    "Normalizer",
    "SyncMode",
    "count_collectives",
    "expected_collectives",
    "gradient_sync",
    "load_config",
    "sft_loss",
]

__version__ = "0.1.0"
