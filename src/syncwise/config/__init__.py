"""Dataclass configs, loaded from YAML with ``key=value`` overrides and validated with clear errors.

Every error names the offending key (dotted, e.g. ``engine.strategy``) and, where there is a fixed set,
the allowed values, so a typo fails before any process group is created. By concern: ``checks`` (the error
and the checks), ``building`` (dicts into dataclasses), ``training`` (model, engine, sync, optim, dist),
``rl`` (rl, rl.loss, critic), ``jobs`` (sft, train), ``dpo``, ``rollout_engines`` (the table of rollout engines),
``root`` (:class:`Config`: the rules across sections), ``loading`` (YAML and overrides).
"""

from .building import MOVED
from .checks import ConfigError
from .dpo import DPO_LOSSES, DPOConfig, RefModelConfig
from .jobs import SFT_TASKS, SFT_TRUNCATION, SFTConfig, TrainConfig
from .loading import PRESET_ONLY_KEYS, config_to_dict, load_config, load_config_dict, load_job_config, packaged_config
from .rl import (
    AGG_MODES,
    CRITIC_SECTIONS,
    KL_ESTIMATORS,
    OFF_POLICY_LOSSES,
    POLICY_LOSSES,
    ROLLOUT_IS_LEVELS,
    CriticConfig,
    PolicyLossConfig,
    RLConfig,
    reward_paths,
)
from .rollout_engines import ROLLOUT_ENGINES, VLLM_SLEEP_LEVELS
from .root import Config
from .training import (
    BACKENDS,
    DTYPES,
    OPTIMIZERS,
    SHARDED_STRATEGIES,
    STRATEGIES,
    DistConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    SyncConfig,
)

__all__ = [
    "AGG_MODES", "BACKENDS", "CRITIC_SECTIONS", "DPO_LOSSES", "DTYPES", "KL_ESTIMATORS", "MOVED", "OFF_POLICY_LOSSES",
    "OPTIMIZERS", "POLICY_LOSSES", "PRESET_ONLY_KEYS", "ROLLOUT_ENGINES", "ROLLOUT_IS_LEVELS", "SFT_TASKS",
    "SFT_TRUNCATION", "SHARDED_STRATEGIES", "STRATEGIES", "VLLM_SLEEP_LEVELS", "Config", "ConfigError",
    "CriticConfig", "DPOConfig", "DistConfig", "EngineConfig", "LoraConfig", "ModelConfig", "OptimConfig",
    "PolicyLossConfig", "RLConfig", "RefModelConfig", "SFTConfig", "SyncConfig", "TrainConfig", "config_to_dict",
    "load_config", "load_config_dict", "load_job_config", "packaged_config", "reward_paths",
]
