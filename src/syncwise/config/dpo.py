"""``syncwise dpo``'s section (``dpo``): preference training on TRL's preference data, with TRL's losses."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import ConfigError, choice, non_negative, positive
from .jobs import logger_names, progress_choice

# TRL's DPOTrainer losses (trl 1.16, DPOTrainer._compute_loss), and SimPO as its CPOTrainer defines it
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
DPO_TRUNCATION = ("keep_start", "drop")


@dataclass
class RefModelConfig:
    """The reference the policy's log-ratios are taken against (``dpo.ref_model.*``)."""

    path: str | None = None  # a model folder; default: the initial policy, frozen (with LoRA: its base, adapters off)


@dataclass
class DPOConfig:
    """`syncwise dpo`: direct preference optimisation on pairs -- ``prompt`` / ``chosen`` / ``rejected`` as strings
    or message lists, or ``chosen`` / ``rejected`` alone (TRL's implicit prompt) -- in JSONL, Parquet or a
    save_to_disk folder."""

    dataset: str | None = None  # preference pairs (TRL's format); required
    eval_dataset: str | None = None  # held-out pairs: their loss and rewards every dpo.eval_every steps
    tokenizer: str | None = None  # default: model.path's
    max_length: int = 1024  # prompt + completion tokens of each sequence (TRL's max_length)
    truncation: str = "keep_start"  # keep_start (cut the end, TRL's) | drop (leave the pair out); counted
    on_bad_row: str = "error"  # error (one line naming the file and row) | skip (left out, counted)
    # TRL's loss_type: sigmoid (DPO) | ipo | hinge | robust (label smoothing) | simpo (reference-free, CPOTrainer's);
    # a list is summed with dpo.loss_weights, as TRL allows
    loss_type: str | list[str] = "sigmoid"
    loss_weights: list[float] = field(default_factory=list)  # one per loss type; empty: all 1
    beta: float = 0.1  # the KL weight (TRL's beta; IPO's tau; SimPO's beta)
    label_smoothing: float = 0.0  # robust: the assumed share of flipped labels, in [0, 0.5); simpo: cDPO's smoothing
    simpo_gamma: float = 0.5  # simpo: the target reward margin
    ref_model: RefModelConfig = field(default_factory=RefModelConfig)
    # score every pair with the reference once before training, and hold no reference model while training
    precompute_ref_log_probs: bool = False
    epochs: float = 1.0  # passes over dpo.dataset
    steps: int = 0  # > 0: this many steps instead of dpo.epochs
    batch_size: int = 8  # pairs per step over all ranks
    eval_every: int = 0  # evaluate every N steps (0: only at the end)
    checkpoint_every: int = 0  # 0: only the final checkpoint
    resume: str = "none"  # none | auto (from <out_dir>/checkpoints/latest) | a checkpoint directory
    export: bool = True  # a Hugging Face model (and its tokenizer) in <out_dir>/export
    progress: bool | str = "auto"  # a progress bar on rank 0: true | false | auto (on a terminal only)
    logger: str | list[str] = "jsonl"  # also: tensorboard, wandb, mlflow, trackio
    seed: int = 0  # the pair order
    out_dir: str = "runs/dpo"  # metrics.jsonl, curves.png, checkpoints/, export/
    log_every: int = 1  # with the bar off: a line every N steps

    @property
    def losses(self) -> list[str]:
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    @property
    def weights(self) -> list[float]:
        return [float(w) for w in self.loss_weights] or [1.0] * len(self.losses)

    @property
    def reference_free(self) -> bool:
        """SimPO needs no reference model."""
        return self.losses == ["simpo"]

    def validate(self) -> DPOConfig:
        if isinstance(self.loss_type, str) and "," in self.loss_type:
            self.loss_type = [name.strip() for name in self.loss_type.split(",")]
        if not self.losses:
            raise ConfigError("dpo.loss_type: give at least one loss")
        for name in self.losses:
            choice("dpo.loss_type", name, DPO_LOSSES)
        if "simpo" in self.losses and len(self.losses) > 1:
            raise ConfigError("dpo.loss_type: simpo stands alone (reference-free, TRL's CPOTrainer); it cannot be "
                              "summed with the reference-based losses")
        if self.loss_weights and len(self.loss_weights) != len(self.losses):
            raise ConfigError(f"dpo.loss_weights: {len(self.loss_weights)} weight(s) for {len(self.losses)} loss "
                              "type(s); give one per dpo.loss_type, or none (all 1)")
        positive("dpo.beta", self.beta)
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing: must be in [0, 0.5), got {self.label_smoothing}")
        if self.reference_free and (self.ref_model.path or self.precompute_ref_log_probs):
            raise ConfigError("dpo.ref_model.path / dpo.precompute_ref_log_probs: simpo uses no reference model")
        choice("dpo.truncation", self.truncation, DPO_TRUNCATION)
        choice("dpo.on_bad_row", self.on_bad_row, ("error", "skip"))
        positive("dpo.max_length", self.max_length)
        non_negative("dpo.steps", self.steps, "0: dpo.epochs passes")
        positive("dpo.epochs", self.epochs)
        positive("dpo.batch_size", self.batch_size)
        non_negative("dpo.eval_every", self.eval_every, "0: at the end only")
        non_negative("dpo.checkpoint_every", self.checkpoint_every, "0: the final checkpoint only")
        positive("dpo.log_every", self.log_every)
        self.progress = progress_choice("dpo.progress", self.progress)
        self.logger = logger_names("dpo.logger", self.logger)
        return self
