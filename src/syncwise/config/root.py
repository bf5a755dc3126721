"""The whole config (:class:`Config`: every section) and the rules that cross sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..sync.modes import unsupported_reason
from .building import build, deep_merge
from .checks import ConfigError
from .dpo import DPOConfig
from .jobs import SFTConfig, TrainConfig
from .rl import CRITIC_SECTIONS, CriticConfig, RLConfig
from .rollout_engines import ROLLOUT_ENGINES
from .rollout_modes import RolloutMode, resolve_rollout_mode
from .training import SHARDED_STRATEGIES, DistConfig, EngineConfig, ModelConfig, OptimConfig, SyncConfig


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def critic_config(self) -> Config:
        """The config the critic's engine runs under: the actor's, with ``critic.<section>`` keys over its
        model, engine, sync and optim sections (checked as the actor's are; an error names the critic key)."""
        sections = {}
        for name in CRITIC_SECTIONS:
            merged = deep_merge(dataclasses.asdict(getattr(self, name)), getattr(self.critic, name))
            sections[name] = build(type(getattr(self, name)), merged, prefix=f"critic.{name}.")
        critic = dataclasses.replace(self, **sections)
        try:
            return critic._validate_training()
        except ConfigError as exc:  # every message starts with the key it names
            raise ConfigError(f"critic.{exc}") from None

    def validate(self, runnable: bool = True) -> Config:
        """Every section by itself, then the rules across sections; ``runnable``: also that a job could run on it
        (``syncwise config`` prints a config that is not yet, and says what it lacks)."""
        self._validate_training()
        for section in (self.rl, self.critic, self.train, self.sft, self.dpo):
            section.validate()
        if runnable and (missing := self.rl.missing_scorer()):
            raise ConfigError(missing)
        if self.rl.algorithm == "ppo":
            self.critic_config()
        if not self.rl.tool_step_timeout_s:  # resolved here: what runs is what config.yaml records
            self.rl.tool_step_timeout_s = self.dist.timeout_s / 2
        if self.rl.tool_step_timeout_s >= self.dist.timeout_s:
            raise ConfigError(f"rl.tool_step_timeout_s={self.rl.tool_step_timeout_s:g} must be less than "
                              f"dist.timeout_s={self.dist.timeout_s:g}: the other ranks wait for this one's tools at "
                              f"the next collective, which gives up after dist.timeout_s")
        self._resolve_lag()
        if self.rl.eval_dataset and self.dist.rollout_ranks:
            raise ConfigError(f"rl.eval_dataset: the trainers sample the evaluation with a rollout copy of their own, "
                              f"and beside dist.rollout_ranks={self.dist.rollout_ranks} they have none; evaluate "
                              "without rollout ranks (or the export, afterwards)")
        loss = self.rl.loss  # the autos resolved here: what runs is what config.yaml records
        if loss.off_policy == "auto":
            loss.off_policy = "decoupled" if self.rl.is_off_policy and not loss.corrects_rollout else "none"
        if loss.rollout_is == "auto":  # off_policy's weight covers the sampler's mismatch too
            loss.rollout_is = "token" if self.sampler_differs and not loss.corrects_behavior else "none"
        return self

    def _resolve_lag(self) -> None:
        """The rollout mode (:mod:`syncwise.config.rollout_modes`: its rules and messages), ``rl.off_policy_lag``
        resolved with it (config.yaml records it)."""
        _, self.rl.off_policy_lag = resolve_rollout_mode(self.rl, self.dist.rollout_ranks, self.train.steps)

    @property
    def rollout_mode(self) -> RolloutMode:
        """Where each RL step's batch comes from (the config validated: the keys resolved)."""
        return resolve_rollout_mode(self.rl, self.dist.rollout_ranks, self.train.steps)[0]

    def _validate_training(self) -> Config:
        """The model, engine, sync, optim and dist sections, and the rules between them (also the critic's,
        :meth:`critic_config`)."""
        for section in (self.model, self.engine, self.sync, self.optim, self.dist):
            section.validate()
        reason = unsupported_reason(self.sync.mode, self.engine.strategy, self.engine.hsdp_replicas > 1)
        if reason:
            raise ConfigError(reason)
        if self.model.param_dtype != "float32" and self.engine.strategy not in SHARDED_STRATEGIES:
            raise ConfigError(
                f"model.param_dtype={self.model.param_dtype!r} (mixed precision) needs engine.strategy "
                f"fsdp2 or fsdp1, got {self.engine.strategy!r}"
            )
        return self

    @property
    def sampler_differs(self) -> bool:
        """Whether the rollout samples from another network than the trainer computes: another engine's kernels
        (its table entry says; vLLM's), or a copy in another dtype than the trainer's compute dtype (what
        rl.loss.rollout_is=auto corrects)."""
        return (ROLLOUT_ENGINES[self.rl.rollout_engine].differs_from_trainer
                or self.rl.rollout_dtype != self.model.param_dtype)
