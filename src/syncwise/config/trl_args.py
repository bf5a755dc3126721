"""A TRL ``GRPOConfig`` / ``SFTConfig`` / ``DPOConfig``'s fields as syncwise's keys: what a Python script's
trainer (:mod:`syncwise.jobs.trainers`) runs with. Each field a script sets maps to the key(s) the
:data:`~syncwise.config.peers.TRL_KEYS` table names for it (the docs' "Coming from TRL" page); a field with no
counterpart here is one :class:`ConfigError` naming every such field. Fields left unset keep syncwise's defaults
(a field of a TRL object counts as set where it differs from its class's default)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from .checks import ConfigError

# TRL's loss_type (GRPO) -> rl.loss.agg; "dr_grpo" normalises by max_completion_length (rl.loss.norm_constant)
GRPO_LOSS_TYPES = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean",
                   "dr_grpo": "seq-mean-token-sum-norm"}
LOGGERS = ("tensorboard", "wandb", "mlflow", "trackio")
# TRL's defaults for the fields that size a step, where a script sets only some of them
TRL_BATCH_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 8}

Mapping = Callable[[Any], dict[str, Any]]

# TRL / transformers fields that steer only transformers' own machinery (devices, data loaders, its logging
# folder): nothing to map, and a script written for TRL on CPU must set use_cpu -- read and left alone
TOLERATED = frozenset({"use_cpu", "no_cuda", "dataloader_pin_memory", "dataloader_num_workers",
                       "dataloader_persistent_workers", "accelerator_config", "debug", "logging_dir",
                       "logging_strategy", "save_strategy", "eval_strategy", "do_train", "do_eval", "run_name",
                       "log_level", "remove_unused_columns", "overwrite_output_dir"})


def _to(key: str) -> Mapping:
    return lambda value: {key: value}


def _schedule(value: Any) -> dict[str, Any]:
    name = str(getattr(value, "value", value))
    if name not in ("constant", "cosine"):
        raise ConfigError(f"lr_scheduler_type={name!r}: syncwise's optim.schedule is constant or cosine")
    return {"optim.schedule": name}


def _bf16(value: Any) -> dict[str, Any]:
    return {"model.param_dtype": "bfloat16" if value else "float32"}


def _report_to(section: str) -> Mapping:
    def mapping(value: Any) -> dict[str, Any]:
        names = [value] if isinstance(value, str) else list(value or [])
        names = [n for n in names if n not in ("none", "jsonl")]
        unknown = [n for n in names if n not in LOGGERS]
        if unknown:
            raise ConfigError(f"report_to={value!r}: syncwise logs to jsonl and {', '.join(LOGGERS)}; not "
                              f"{', '.join(unknown)}")
        return {f"{section}.logger": ["jsonl", *names]}
    return mapping


def _resume(section: str) -> Mapping:
    return lambda value: {f"{section}.resume": "auto" if value is True else str(value)}


COMMON: dict[str, Mapping] = {
    "learning_rate": _to("optim.lr"),
    "weight_decay": _to("optim.weight_decay"),
    "max_grad_norm": _to("optim.grad_clip"),
    "warmup_steps": _to("optim.warmup_steps"),
    "lr_scheduler_type": _schedule,
    "gradient_checkpointing": _to("engine.activation_checkpointing"),
    "activation_checkpointing": _to("engine.activation_checkpointing"),  # transformers 5's name for it
    "bf16": _bf16,
}


def _section_fields(section: str) -> dict[str, Mapping]:
    return {
        "output_dir": _to(f"{section}.out_dir"),
        "logging_steps": _to(f"{section}.log_every"),
        "save_steps": _to(f"{section}.checkpoint_every"),
        "eval_steps": _to(f"{section}.eval_every"),
        "seed": _to(f"{section}.seed"),
        "report_to": _report_to(section),
        "resume_from_checkpoint": _resume(section),
        "disable_tqdm": lambda v: {f"{section}.progress": not v},
    }


def _grpo_loss_type(value: Any) -> dict[str, Any]:
    if value not in GRPO_LOSS_TYPES:
        raise ConfigError(f"loss_type={value!r}: syncwise has TRL's {', '.join(GRPO_LOSS_TYPES)} "
                          "(rl.loss.agg names the aggregation itself)")
    return {"rl.loss.agg": GRPO_LOSS_TYPES[value]}


def _scale_rewards(value: Any) -> dict[str, Any]:
    if value in (True, "group"):
        return {"rl.advantage": "grpo"}
    if value in (False, "none"):
        return {"rl.advantage": "drgrpo"}
    raise ConfigError(f"scale_rewards={value!r}: syncwise scales by the group's std (group / true) or not at all "
                      "(none / false)")


def _use_vllm(value: Any) -> dict[str, Any]:
    return {"rl.rollout_engine": "vllm"} if value else {}


def _vllm_mode(value: Any) -> dict[str, Any]:
    if value != "colocate":
        raise ConfigError(f"vllm_mode={value!r}: syncwise's vLLM runs beside each trainer rank (colocate); rollout "
                          "ranks of their own are dist.rollout_ranks")
    return {}


GRPO_FIELDS: dict[str, Mapping] = {
    **COMMON, **_section_fields("train"),
    "max_steps": _to("train.steps"),
    "num_generations": _to("rl.samples_per_prompt"),
    "max_completion_length": _to("rl.max_new_tokens"),
    "max_prompt_length": _to("rl.max_prompt_length"),
    "temperature": _to("rl.temperature"),
    "top_p": _to("rl.top_p"),
    "top_k": lambda v: {"rl.top_k": int(v or 0)},
    "min_p": lambda v: {"rl.min_p": float(v or 0.0)},
    "beta": _to("rl.loss.kl_coef"),
    "epsilon": _to("rl.loss.clip_low"),
    "epsilon_high": _to("rl.loss.clip_high"),
    "loss_type": _grpo_loss_type,
    "scale_rewards": _scale_rewards,
    "num_iterations": _to("rl.epochs"),
    "mask_truncated_completions": _to("rl.mask_truncated"),
    "reward_weights": _to("rl.reward_weights"),
    "entropy_coef": _to("rl.loss.entropy_coef"),
    "use_vllm": _use_vllm,
    "vllm_mode": _vllm_mode,
    "log_completions": lambda v: {"train.log_completions_every": 1 if v else 0},
}

SFT_FIELDS: dict[str, Mapping] = {
    **COMMON, **_section_fields("sft"),
    "max_steps": _to("sft.steps"),
    "num_train_epochs": _to("sft.epochs"),
    "max_length": _to("sft.max_length"),
    "packing": _to("engine.packing"),
}

DPO_FIELDS: dict[str, Mapping] = {
    **COMMON, **_section_fields("dpo"),
    "max_steps": _to("dpo.steps"),
    "num_train_epochs": _to("dpo.epochs"),
    "max_length": _to("dpo.max_length"),
    "beta": _to("dpo.beta"),
    "loss_type": _to("dpo.loss_type"),
    "loss_weights": _to("dpo.loss_weights"),
    "label_smoothing": _to("dpo.label_smoothing"),
    "simpo_gamma": _to("dpo.simpo_gamma"),
    "precompute_ref_log_probs": _to("dpo.precompute_ref_log_probs"),
}

FIELDS = {"train": GRPO_FIELDS, "sft": SFT_FIELDS, "dpo": DPO_FIELDS}
# the fields that size a step: mapped together (batch_overrides), never alone
BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                "generation_batch_size")


def fields_set(args: Any) -> dict[str, Any]:
    """The fields ``args`` sets: a dict as it is; a syncwise trainer config's given fields; a TRL config object's
    (a dataclass) fields that differ from a default instance of its class (made as it was, on CPU where it was:
    ``__post_init__`` derives fields -- ``logging_dir``, ``generation_batch_size`` -- alike in both), or, where one
    cannot be made, from its fields' defaults."""
    if isinstance(args, dict):
        return dict(args)
    given = getattr(args, "given", None)
    if isinstance(given, dict):
        return dict(given)
    if dataclasses.is_dataclass(args):
        try:
            reference = type(args)(**{k: getattr(args, k) for k in ("use_cpu",) if hasattr(args, k)})
            defaults = {f.name: getattr(reference, f.name, None) for f in dataclasses.fields(args)}
        except Exception:  # noqa: BLE001 -- a class that validates its defaults against this machine
            defaults = {f.name: f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
                for f in dataclasses.fields(args)}
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                if f.init and not f.name.startswith("_") and getattr(args, f.name, None) != defaults.get(f.name)}
    raise ConfigError(f"args: expected a GRPOConfig / SFTConfig / DPOConfig (syncwise's or TRL's) or a dict, got "
                      f"{type(args).__name__}")


def trl_overrides(job: str, fields: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The syncwise keys (dotted, to values) ``fields`` set for ``job`` (train | sft | dpo); syncwise keys given by
    their dotted names pass through, fields that steer only transformers' own machinery (:data:`TOLERATED`) are
    left alone. One ConfigError naming every other field with no counterpart."""
    table, out, unknown = FIELDS[job], {}, []
    for name, value in fields.items():
        if "." in name:
            out[name] = value
        elif name in TOLERATED:
            continue
        elif name in table:
            out.update(table[name](value))
        elif name not in BATCH_FIELDS and not (job == "train" and name == "num_train_epochs"):
            unknown.append(name)
    if unknown:
        raise ConfigError(f"{', '.join(sorted(unknown))}: no counterpart in syncwise's {job} job (the keys it has: "
                          "syncwise config " + job + "; TRL's fields it reads: docs/coming-from-trl.md)")
    if job == "train" and fields.get("loss_type") == "dr_grpo" and "rl.loss.norm_constant" not in out:
        out["rl.loss.norm_constant"] = fields.get("max_completion_length", 256)  # TRL's divisor
    if job == "train" and "epsilon" in fields and "epsilon_high" not in fields:
        out["rl.loss.clip_high"] = fields["epsilon"]  # TRL's epsilon_high defaults to epsilon
    out.update(batch_overrides(job, fields, world_size))
    return out


def batch_overrides(job: str, fields: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The step's size from TRL's per-device fields: GRPO's completions a rank per optimizer step
    (``per_device_train_batch_size x gradient_accumulation_steps``, or ``generation_batch_size``) over
    ``num_generations`` = prompts a rank; SFT / DPO's sequences / pairs a step over all ranks."""
    if not any(name in fields for name in BATCH_FIELDS):
        return {}
    if job == "train" and "generation_batch_size" in fields:
        completions = int(fields["generation_batch_size"])
    else:
        steps = fields.get("steps_per_generation") if job == "train" else None
        per_device = int(fields.get("per_device_train_batch_size", TRL_BATCH_DEFAULTS["per_device_train_batch_size"]))
        completions = per_device * int(steps or fields.get("gradient_accumulation_steps", 1))
    if job != "train":
        return {f"{'sft' if job == 'sft' else 'dpo'}.batch_size": completions * world_size}
    n = int(fields.get("num_generations", TRL_BATCH_DEFAULTS["num_generations"]))
    if completions % n:
        raise ConfigError(f"per_device_train_batch_size x gradient_accumulation_steps = {completions} completions a "
                          f"rank: not a multiple of num_generations={n} (syncwise gives each rank whole prompts)")
    return {"rl.prompts_per_rank": completions // n}


def epochs_to_steps(epochs: float, rows: int, per_step: int) -> int:
    """TRL's ``num_train_epochs`` for an RL job (syncwise counts steps): passes over ``rows`` prompts at
    ``per_step`` prompts a step, rounded up."""
    return max(1, math.ceil(epochs * rows / max(per_step, 1)))
