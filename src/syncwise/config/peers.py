"""The keys people bring from TRL (``GRPOConfig`` / ``SFTConfig`` fields) and verl (its Hydra keys), each with
syncwise's equivalent: an unknown key that is one of them names it (:func:`peer_hint`), and the docs' "Coming
from TRL / verl" page is this table (``docs/coming-from-trl.md``, checked against it by the suite)."""

from __future__ import annotations

from typing import Any

# TRL's field name (wherever it is put: optim.learning_rate, sft.lr, train.num_generations) -> syncwise's key(s)
TRL_KEYS: dict[str, str] = {
    "learning_rate": "optim.lr",
    "lr": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "max_grad_norm": "optim.grad_clip",
    "warmup_steps": "optim.warmup_steps",
    "warmup_ratio": "optim.warmup_steps (a count of steps)",
    "lr_scheduler_type": "optim.schedule (constant | cosine)",
    "num_generations": "rl.samples_per_prompt",
    "max_completion_length": "rl.max_new_tokens",
    "max_prompt_length": "rl.max_prompt_length",
    "beta": "rl.loss.kl_coef (DPO: dpo.beta)",
    "epsilon": "rl.loss.clip_low (and rl.loss.clip_high)",
    "epsilon_high": "rl.loss.clip_high",
    "loss_type": "rl.loss.agg (DPO: dpo.loss_type)",
    "scale_rewards": "rl.advantage (grpo scales by the group's std, drgrpo does not)",
    "num_iterations": "rl.epochs",
    "mask_truncated_completions": "rl.mask_truncated",
    "reward_funcs": "rl.reward_fn",
    "reward_weights": "rl.reward_weights",
    "environment_factory": "rl.environment",
    "use_vllm": "rl.rollout_engine=vllm",
    "vllm_gpu_memory_utilization": "rl.vllm_kv_cache_bytes",
    "per_device_train_batch_size": "rl.prompts_per_rank (TRL counts completions: prompts_per_rank x "
                                   "samples_per_prompt) or sft.batch_size (sequences per step over all ranks)",
    "gradient_accumulation_steps": "nothing: a step is the whole batch, cut into micro-batches for you "
                                   "(engine.micro_batch_size, engine.max_tokens_per_micro_batch), its gradient "
                                   "synced once (sync.mode)",
    "gradient_checkpointing": "engine.activation_checkpointing",
    "bf16": "model.param_dtype=bfloat16",
    "num_train_epochs": "sft.epochs or dpo.epochs (RL: train.steps)",
    "max_steps": "train.steps, sft.steps or dpo.steps",
    "logging_steps": "train.log_every, sft.log_every or dpo.log_every",
    "save_steps": "train.checkpoint_every, sft.checkpoint_every or dpo.checkpoint_every",
    "eval_steps": "train.eval_every, sft.eval_every or dpo.eval_every",
    "report_to": "train.logger",
    "max_length": "sft.max_length or dpo.max_length",
    "output_dir": "train.out_dir, sft.out_dir or dpo.out_dir",
    "resume_from_checkpoint": "train.resume, sft.resume or dpo.resume (auto | a path)",
    "seed": "train.seed, sft.seed or dpo.seed",
    "temperature": "rl.temperature",
    "top_p": "rl.top_p",
    "top_k": "rl.top_k",
    "min_p": "rl.min_p",
    "entropy_coef": "rl.loss.entropy_coef",
    "log_completions": "train.log_completions_every (1 or 0)",
    "vllm_mode": "colocate only (rollout ranks of their own: dist.rollout_ranks)",
    "steps_per_generation": "with per_device_train_batch_size: rl.prompts_per_rank",
    "generation_batch_size": "rl.prompts_per_rank x rl.samples_per_prompt (completions a rank)",
    "packing": "engine.packing (sequences kept apart in packed rows)",
    "label_smoothing": "dpo.label_smoothing",
    "loss_weights": "dpo.loss_weights",
    "simpo_gamma": "dpo.simpo_gamma",
    "precompute_ref_log_probs": "dpo.precompute_ref_log_probs",
}

# verl's key (as its Hydra config spells it) -> syncwise's key(s)
VERL_KEYS: dict[str, str] = {
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.actor.optim.lr": "optim.lr",
    "actor_rollout_ref.rollout.n": "rl.samples_per_prompt",
    "actor_rollout_ref.rollout.name": "rl.rollout_engine",
    "actor_rollout_ref.rollout.temperature": "rl.temperature",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "rl.mini_batches (a count of mini-batches)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "engine.micro_batch_size",
    "actor_rollout_ref.actor.use_dynamic_bsz": "engine.max_tokens_per_micro_batch",
    "actor_rollout_ref.actor.ppo_epochs": "rl.epochs",
    "actor_rollout_ref.actor.kl_loss_coef": "rl.loss.kl_coef",
    "actor_rollout_ref.actor.clip_ratio": "rl.loss.clip_low and rl.loss.clip_high",
    "actor_rollout_ref.actor.entropy_coeff": "rl.loss.entropy_coef",
    "actor_rollout_ref.actor.loss_agg_mode": "rl.loss.agg",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "engine.cpu_offload",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "dist.sequence_parallel (or auto)",
    "algorithm.adv_estimator": "rl.advantage (grpo | drgrpo | rloo; gae: rl.algorithm=ppo)",
    "algorithm.kl_ctrl.kl_coef": "rl.loss.kl_coef (in the reward: rl.kl_in_reward)",
    "algorithm.use_kl_in_reward": "rl.kl_in_reward",
    "data.train_files": "rl.dataset",
    "data.train_batch_size": "rl.prompts_per_rank (per rank: the batch over dist.nproc)",
    "data.max_prompt_length": "rl.max_prompt_length",
    "data.max_response_length": "rl.max_new_tokens",
    "trainer.total_epochs": "train.steps",
    "trainer.total_training_steps": "train.steps",
    "trainer.save_freq": "train.checkpoint_every",
    "trainer.logger": "train.logger",
    "trainer.n_gpus_per_node": "dist.nproc",
}


def _leaves(path: str, value: Any) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for key, inner in value.items() for leaf in _leaves(f"{path}.{key}", inner)]
    return [path]


def peer_hint(path: str, value: Any) -> tuple[str, str] | None:
    """Where an unknown key ``path`` (its value: a section's dict where the user wrote a verl key) is TRL's or
    verl's: the key as the user wrote it and the words that name syncwise's equivalent; else None."""
    for leaf in _leaves(path, value):
        if leaf in VERL_KEYS:
            return leaf, f"verl's {leaf} is {VERL_KEYS[leaf]} here"
    name = path.rsplit(".", 1)[-1]
    if name in TRL_KEYS:
        return path, f"TRL's {name} is {TRL_KEYS[name]} here"
    return None


def peer_table(keys: dict[str, str], who: str) -> str:
    """A Markdown table of ``keys``: the docs' page holds exactly these rows."""
    rows = [f"| {who} | syncwise |", "|---|---|"]
    rows += [f"| `{name}` | {equivalent} |" for name, equivalent in keys.items()]
    return "\n".join(rows)
