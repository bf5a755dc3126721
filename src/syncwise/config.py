"""Dataclass configs, loaded from YAML with ``key=value`` overrides and validated with clear errors.

Every error names the offending key (dotted, e.g. ``engine.strategy``) and, where there is a fixed set,
the allowed values, so a typo fails before any process group is created.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .sync.modes import MODE_NAMES, unsupported_reason

STRATEGIES = ("fsdp2", "fsdp1", "ddp", "none")
SHARDED_STRATEGIES = ("fsdp2", "fsdp1")  # parameters sharded in FSDP units
DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "sgd")
BACKENDS = ("auto", "gloo", "nccl")
POLICY_LOSSES = ("ppo", "gspo", "pg", "cispo")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
ROLLOUT_IS_LEVELS = ("auto", "none", "token", "sequence")
ROLLOUT_ENGINES = ("compact", "generate", "vllm")
VLLM_SLEEP_LEVELS = ("auto", 0, 1, 2)


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or an invalid value. The message names the key."""


@dataclass
class LoraConfig:
    """LoRA adapters on the model (``model.lora.*``, built with peft: ``pip install 'syncwise[lora]'``).
    Only the adapters train; the base weights stay frozen."""

    rank: int = 0  # 0: off (the whole model trains)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0
    # "all-linear" (every linear projection of the decoder layers, not the LM head) or comma-separated
    # module names (q_proj,v_proj).
    target_modules: str = "all-linear"

    def validate(self, prefix: str = "model.lora.") -> LoraConfig:
        if self.rank < 0:
            raise ConfigError(f"{prefix}rank: must be >= 0 (0 = no LoRA), got {self.rank}")
        if not self.rank:
            return self
        _positive(f"{prefix}alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{prefix}dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules.strip(" ,"):
            raise ConfigError(f"{prefix}target_modules: empty; use all-linear or module names (q_proj,v_proj)")
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ConfigError(f"{prefix}rank={self.rank} needs peft, which is not installed: "
                              "pip install 'syncwise[lora]'")
        return self


@dataclass
class ModelConfig:
    """Which causal LM to build. ``path`` (a local Hugging Face directory) wins over ``preset``."""

    preset: str = "qwen2-tiny"
    path: str | None = None
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    attn_implementation: str = "sdpa"
    seed: int = 0
    # Dropout in the model's config and in LoRA: keep | off | auto (off for `syncwise train`, whose ratios,
    # old log-probs and KL must see the same network the sampler drew from; kept for `syncwise sft`)
    dropout: str = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class EngineConfig:
    """How the model is wrapped and fed."""

    strategy: str = "fsdp2"
    # Sequences per micro-batch. 0 (the default): the token cap below splits the batch (2 where it is 0);
    # set, it wins over the cap's ``auto``.
    micro_batch_size: int = 0
    # > 0: a hard cap on the tokens of every micro-batch (real tokens when packed, rows x longest when
    # padded); the fewest micro-batches that keep within it, balanced by the workload estimate a·L + L²;
    # micro_batch_size is then ignored. auto: chosen with the sync mode from the memory budget (the
    # largest power of two whose predicted peak fits beside the fastest sync mode; see perf_tuning.md).
    max_tokens_per_micro_batch: int | str = "auto"
    workload_linear_coef: float = 24576.0
    # Each micro-batch's sequences in one row without padding (models that keep packed sequences apart).
    packing: bool = True
    # Recompute each decoder layer's activations in backward instead of keeping them.
    activation_checkpointing: bool = False
    # Tokens whose fp32 log-softmax over the vocabulary exists at once (log-probs, entropy); 0 = all.
    logprob_chunk_size: int = 1024
    # Log-probs and entropy straight from the final hidden states, a chunk of tokens at a time: the
    # [tokens, vocabulary] logits and their gradient never exist at once (models whose forward allows it).
    # auto: materialised where the logits and their gradient fit the memory budget beside the chosen sync
    # mode (faster), fused where they do not; decided with the sync mode.
    fused_lm_head: bool | str = "auto"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # >1 builds a 2-D (replicate x shard) mesh: HSDP with this many replicas.
    hsdp_replicas: int = 1
    # DDP only: needed when some parameters get no gradient in a forward.
    find_unused_parameters: bool = False

    @property
    def auto_cap(self) -> bool:
        """The token cap is auto's to choose: ``max_tokens_per_micro_batch=auto`` and no micro_batch_size."""
        return self.max_tokens_per_micro_batch == "auto" and self.micro_batch_size == 0

    @property
    def split_label(self) -> str:
        """How a step is split into micro-batches, in words (a job's header line)."""
        if self.auto_cap:
            return "micro-batch token cap auto"
        size, cap = self.fixed_split
        return f"micro-batch token cap {cap}" if cap else f"{size} sequences per micro-batch"

    @property
    def fixed_split(self) -> tuple[int, int]:
        """(sequences per micro-batch, token cap) as set: the cap wins where it is > 0; without either,
        2 sequences (also what an auto cap falls back to where it cannot be chosen)."""
        cap = self.max_tokens_per_micro_batch if isinstance(self.max_tokens_per_micro_batch, int) else 0
        return self.micro_batch_size or 2, cap


@dataclass
class SyncConfig:
    """When gradients are communicated across the micro-batches of one optimizer step."""

    mode: str = "auto"
    # Bytes (> 1), a fraction of this rank's device memory ((0, 1]), or 0 for 90% of it. Used by auto.
    memory_budget: float = 0.0
    # deferred_unsharded: also keep parameters unsharded after forward (no backward all-gather at all).
    unsharded_forward: bool = True
    # CPU: measure the true peak with the (slow) tensor tracker on the first step and every N steps
    # (0 = first only); in between it is estimated. CUDA measures every step.
    peak_every: int = 50
    # auto's ranking of the LM head's path and the token cap from timings taken here (a sweep of collectives,
    # the output layer's matmul, one step at each of up to three caps) instead of the model alone with the
    # device type's nominal links and matmul rate: faster on some machines, not the same split run to run.
    auto_timing: bool = False
    # Raise instead of warning when the counted collectives differ from the mode's formula.
    strict: bool = False
    # partial: a count K (the K units that save the most time per byte held) or comma-separated unit
    # names (root, model.layers.0, ...).
    deferred_units: int | str = 0


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0  # linear warm-up from 0
    schedule: str = "constant"  # constant | cosine (decays to 10% over the job's steps)


@dataclass
class DistConfig:
    """Process-group set-up. Under torchrun the environment wins and ``nproc`` is ignored."""

    nproc: int = 2
    backend: str = "auto"
    timeout_s: float = 600.0


SFT_TASKS = ("progression", "arith_chat")
SFT_TRUNCATION = ("right", "left", "drop")


@dataclass
class SFTConfig:
    """`syncwise sft`: supervised fine-tuning on a dataset (JSONL, Parquet, a save_to_disk folder) or a
    built-in task (``progression``: the fast synthetic demo; ``arith_chat``: GSM8K-shaped chat problems)."""

    task: str = "progression"  # used when no sft.dataset is given
    dataset: str | None = None
    eval_dataset: str | None = None
    eval_fraction: float = 0.0  # without sft.eval_dataset: hold out this fraction of sft.dataset
    tokenizer: str | None = None  # default: model.path's
    max_length: int = 1024  # longer samples are truncated (sft.truncation) and counted
    truncation: str = "right"  # right (keep the start) | left (keep the end) | drop
    on_bad_row: str = "error"  # error (one line naming the file and row) | skip (left out, counted)
    epochs: float = 1.0
    steps: int = 0  # > 0: this many steps instead of sft.epochs
    batch_size: int = 16  # sequences per step over all ranks
    batch_tokens: int = 0  # > 0: a step is this many real tokens over all ranks instead
    eval_every: int = 0  # evaluate every N steps (0: only at the end)
    checkpoint_every: int = 0  # 0: only the final checkpoint
    resume: str = "none"  # none | auto (from <out_dir>/checkpoints/latest) | a checkpoint directory
    export: bool = True  # a Hugging Face model (and its tokenizer with the chat template) in <out_dir>/export
    progress: bool = False  # a progress bar on rank 0 (the default prints a line every sft.log_every steps)
    seed: int = 0
    out_dir: str = "runs/sft"
    log_every: int = 1
    min_len: int = 8  # the progression task's sequence lengths
    max_len: int = 32


@dataclass
class PolicyLossConfig:
    """The actor's loss (``rl.loss.*``; ``syncwise.rl.losses.make_policy_loss`` builds it)."""

    kind: str = "ppo"  # ppo (clipped), gspo (sequence-level ratio), pg (REINFORCE / GPG), cispo
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28
    dual_clip: float = 0.0  # > 1: cap the loss of negative-advantage tokens at -A * dual_clip
    agg: str = "token-mean"
    norm_constant: float = 0.0  # seq-mean-token-sum-norm's divisor (0: the longest loss span)
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # > 0: KL to a frozen copy of the initial model
    kl_estimator: str = "k3"
    kl_clamp: float = 10.0  # k3: its value bounded to ±kl_clamp, zero gradient beyond, as verl (0: off)
    # Rollout importance correction: each token's policy loss weighted by exp(old - sampler log-prob),
    # truncated at rollout_is_cap and detached; per token, or one weight per sequence (its summed log-ratio).
    # auto: token where the sampler is another network than the trainer's (rl.rollout_engine=vllm, or
    # rl.rollout_dtype other than model.param_dtype), none where it is the same (Config.sampler_differs)
    rollout_is: str = "auto"
    rollout_is_cap: float = 2.0

    @property
    def corrects_rollout(self) -> bool:
        """Whether the loss weights tokens by the rollout ratio (``auto`` unresolved -- a config built outside a
        job's :class:`Config`, which resolves it from the sampler -- does not)."""
        return self.rollout_is not in ("none", "auto")

    def validate(self, prefix: str = "rl.loss.") -> PolicyLossConfig:
        _choice(f"{prefix}kind", self.kind, POLICY_LOSSES)
        _choice(f"{prefix}agg", self.agg, AGG_MODES)
        _choice(f"{prefix}kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice(f"{prefix}rollout_is", self.rollout_is, ROLLOUT_IS_LEVELS)
        _positive(f"{prefix}rollout_is_cap", self.rollout_is_cap)
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ConfigError(f"{prefix}dual_clip: must be > 1 (or 0 to disable), got {self.dual_clip}")
        for name in ("clip_low", "clip_high", "norm_constant", "entropy_coef", "kl_coef", "kl_clamp"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}{name}: must be >= 0, got {getattr(self, name)}")
        return self


@dataclass
class RLConfig:
    """GRPO: the task, rollouts, advantages and the policy loss (`syncwise train`)."""

    task: str = "target"  # built-in task (syncwise.rl.tasks.TASKS); ignored when dataset is set
    dataset: str | None = None  # JSONL or Parquet with a "prompt" column (other columns reach the reward)
    # "package.module:function" (the job's folder on the path) or "path/to/file.py:function"; several as a
    # list [a:f, b:g]. Your code, run with the job's rights
    reward_fn: str | list[str] | None = None
    reward_weights: list[float] = field(default_factory=list)  # one per reward function; empty: all 1
    # Prompts through the tokenizer's chat template: auto (message-list prompts; strings as they are) |
    # true (strings too, as one user message) | false (never)
    chat_template: str = "auto"
    max_prompt_length: int = 512  # prompt tokens; longer ones: rl.prompt_overflow
    prompt_overflow: str = "truncate_left"  # truncate_left | drop | error (counted and logged)
    tokenizer: str | None = None  # local tokenizer dir (default: model.path, or the built-in one)
    prompts_per_rank: int = 4  # prompts each rank takes per step
    samples_per_prompt: int = 8  # the GRPO group size
    max_new_tokens: int = 0  # 0: the task's (target 2, repeat 100; a rl.dataset: 256)
    temperature: float = 1.0  # sampling temperature; training-side log-probs use the same
    # Truncated sampling (0 / 1.0 / 0: off). The sampler's log-probs are of the distribution it drew from;
    # the trainer's of the full temperature-scaled one (rl.loss.rollout_is corrects the mismatch)
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # Strings that end a response (kept in it, as vLLM's include_stop_str_in_output would); every end token
    # of the tokenizer and the model's generation_config ends one too
    stop: list[str] = field(default_factory=list)
    # Responses cut by rl.max_new_tokens left out of the loss (TRL's mask_truncated_completions)
    mask_truncated: bool = False
    # Multi-turn rollouts with tools (syncwise.rl.multi_turn): functions the policy may call -- built-in names
    # (calculator) or "file.py:function" / "package.module:function", typed and documented. With tools,
    # rl.max_new_tokens bounds everything after the prompt (every turn and the tool results between)
    tools: list[str] = field(default_factory=list)
    tool_parser: str = "auto"  # auto (from the chat template) | hermes (<tool_call>{json}</tool_call>) | llama3_json
    max_turns: int = 4  # assistant turns per conversation; the last one's calls are not run
    tool_timeout_s: float = 10.0  # per call; past it the call's answer is an error (counted)
    # All of a step's tool calls on a rank, however many and however long: past it the calls still running or
    # not started answer an error (counted), so slow tools on one rank cannot keep the others waiting at the
    # next collective until dist.timeout_s ends the job. 0: half of dist.timeout_s (it must be less)
    tool_step_timeout_s: float = 0.0
    tool_max_chars: int = 4096  # a tool's answer is cut to this many characters (the cut said in it)
    tool_workers: int = 8  # a turn's calls over all conversations run side by side, this many at a time
    # What samples the responses (syncwise.rl.rollout): compact -- each prompt prefilled once, ended
    # sequences dropped, only drawn tokens' log-probs kept (syncwise.rl.sampling); generate -- Hugging Face
    # generate (the earlier path, for comparison); vllm -- a vLLM engine on every rank (syncwise.rl.vllm_rollout)
    rollout_engine: str = "compact"
    # vllm: its KV cache per rank, in bytes. 0: the rank's whole rollout batch at full length
    # (prompts_per_rank x samples_per_prompt x (max_prompt_length + max_new_tokens)), within sync.memory_budget
    vllm_kv_cache_bytes: int = 0
    # vllm on CUDA: sleep mode during the update (level 1 offloads vLLM's weights to host memory and drops its
    # KV cache, level 2 drops both -- the refresh rewrites every weight anyway). auto: level 2 where the
    # training state and the first step's activations do not fit beside vLLM in sync.memory_budget, else 0
    # (awake). CPU has no sleep mode: auto is 0 there, and 1 or 2 is an error.
    vllm_sleep_level: int | str = "auto"
    # The rollout copy's dtype (bfloat16: half the copy and its KV cache; the sampler then differs from the
    # fp32 trainer -- rollout/log_prob_diff says by how much, rl.loss.rollout_is corrects for it)
    rollout_dtype: str = "float32"
    advantage: str = "grpo"  # grpo | drgrpo | rloo
    mini_batches: int = 1  # optimizer steps per pass over a rollout batch (each rank's samples split alike)
    epochs: int = 1  # passes over each rollout batch
    # On-policy (mini_batches = epochs = 1) the old log-probs are the update's own (TRL's shortcut); true:
    # take them in a forward-only pass anyway, as verl does
    old_log_prob_pass: bool = False
    # Before the update, move samples between ranks so each trains on about the same real tokens
    # (Karmarkar-Karp over sequence lengths, all-gathered; the rows that move travel in one all-to-all). The
    # gradient is unchanged.
    balance_ranks: bool = True
    # Move only when that lowers the imbalance (busiest rank's real tokens / the mean) by at least this much:
    # below it the exchange costs more than the ranks would wait.
    balance_min_gain: float = 0.02
    # Supervised steps on the built-in task's correct responses before GRPO (a warm start the job runs
    # itself; a resumed run skips it). 0: none.
    warm_start_steps: int = 0
    # Leave out groups whose rewards are all equal (zero advantage: no policy-gradient signal), as DAPO's
    # dynamic sampling does; the loss is normalised over the samples that train. With kl_coef or entropy_coef
    # > 0 their KL and entropy terms are dropped too (the update is then not the full batch's).
    skip_uniform_groups: bool = False
    # grpo: group-relative advantages (rl.advantage); ppo: a learned critic (critic.*), GAE and whitened
    # token-level advantages, the value loss beside the policy loss
    algorithm: str = "grpo"
    gamma: float = 1.0  # ppo: GAE's discount (verl's default)
    lam: float = 1.0  # ppo: GAE's lambda (verl's default)
    # ppo: > 0 subtracts this x per-token KL(old policy || reference) from the token rewards (verl's
    # use_kl_in_reward with kl_penalty "kl"); the reference as for rl.loss.kl_coef
    kl_in_reward: float = 0.0
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)

    @property
    def truncates(self) -> bool:
        """Whether rl.top_k / rl.top_p / rl.min_p cut the sampler's distribution."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


# Sections of the critic that may differ from the actor's (critic.<section>.<key>=...)
CRITIC_SECTIONS = ("model", "engine", "sync", "optim")


@dataclass
class CriticConfig:
    """PPO's value model (``rl.algorithm=ppo``): the policy's architecture with a one-output head on the final
    hidden states, trained by its own engine. ``critic.model.*``, ``critic.engine.*``, ``critic.sync.*`` and
    ``critic.optim.*`` take the actor's keys; what is not set is the actor's (:meth:`Config.critic_config`)."""

    model: dict[str, Any] = field(default_factory=dict)  # e.g. path (default: the policy's), lora.rank
    engine: dict[str, Any] = field(default_factory=dict)
    sync: dict[str, Any] = field(default_factory=dict)  # mode: auto by default, like the actor's
    optim: dict[str, Any] = field(default_factory=dict)  # e.g. lr
    cliprange_value: float = 0.5  # the value loss's clip around the old values (verl's default; 0: off)
    warmup_steps: int = 0  # steps that train only the critic before the actor starts
    export: bool = False  # also write the critic (with its value head) to <out_dir>/export/critic


@dataclass
class TrainConfig:
    steps: int = 60
    seed: int = 0
    out_dir: str = "runs/grpo"
    logger: str = "jsonl"  # jsonl | tensorboard (also writes TensorBoard event files)
    progress: bool = True  # a progress bar on rank 0
    checkpoint_every: int = 20  # 0: only the final checkpoint
    resume: str = "none"  # none | auto (from <out_dir>/checkpoints/latest) | a checkpoint directory
    export: bool = True  # write a Hugging Face model (safetensors) to <out_dir>/export at the end
    max_consecutive_skips: int = 5  # stop (with a checkpoint) after this many non-finite steps in a row


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def critic_config(self) -> Config:
        """The config the critic's engine runs under: the actor's, with ``critic.<section>`` keys over its
        model, engine, sync and optim sections (checked as the actor's are; an error names the critic key)."""
        sections = {}
        for name in CRITIC_SECTIONS:
            merged = _deep_merge(dataclasses.asdict(getattr(self, name)), getattr(self.critic, name))
            sections[name] = _build(type(getattr(self, name)), merged, prefix=f"critic.{name}.")
        critic = dataclasses.replace(self, **sections)
        try:
            return critic._validate_engine()
        except ConfigError as exc:  # every message starts with the key it names
            raise ConfigError(f"critic.{exc}") from None

    def validate(self) -> Config:
        self._validate_engine()
        _choice("rl.algorithm", self.rl.algorithm, ("grpo", "ppo"))
        _non_negative("rl.kl_in_reward", self.rl.kl_in_reward, "0: off")
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self.rl, key) <= 1:
                raise ConfigError(f"rl.{key}: must be in [0, 1], got {getattr(self.rl, key)}")
        _non_negative("critic.cliprange_value", self.critic.cliprange_value, "0: off")
        _non_negative("critic.warmup_steps", self.critic.warmup_steps)
        ppo = self.rl.algorithm == "ppo"
        if ppo:
            self.critic_config()
            if self.rl.skip_uniform_groups:
                raise ConfigError("rl.skip_uniform_groups: a GRPO option (uniform groups have zero group advantage); "
                                  "with rl.algorithm=ppo the critic's baseline gives them a signal")
        elif self.rl.kl_in_reward:
            raise ConfigError("rl.kl_in_reward: a PPO option (token-level rewards); with GRPO use rl.loss.kl_coef")
        return self._validate_rl(ppo)

    def _validate_engine(self) -> Config:
        """The model, engine, sync and optim sections (also the critic's, :meth:`critic_config`)."""
        _choice("engine.strategy", self.engine.strategy, STRATEGIES)
        _choice("sync.mode", self.sync.mode, MODE_NAMES)
        _choice("model.param_dtype", self.model.param_dtype, DTYPES)
        _choice("model.reduce_dtype", self.model.reduce_dtype, DTYPES)
        self.model.lora.validate()
        _choice("optim.name", self.optim.name, OPTIMIZERS)
        _choice("dist.backend", self.dist.backend, BACKENDS)
        _choice("optim.schedule", self.optim.schedule, ("constant", "cosine"))
        # YAML reads a bare `off` as false (and `on` as true)
        self.model.dropout = {"false": "off", "true": "keep"}.get(self.model.dropout, self.model.dropout)
        _choice("model.dropout", self.model.dropout, ("auto", "keep", "off"))
        _non_negative("engine.micro_batch_size", self.engine.micro_batch_size, "0 = the token cap decides")
        cap = self.engine.max_tokens_per_micro_batch
        if isinstance(cap, str) and cap != "auto":
            raise ConfigError(f"engine.max_tokens_per_micro_batch: expected a token count or auto, got {cap!r}")
        if not isinstance(cap, str):
            _non_negative("engine.max_tokens_per_micro_batch", cap, "0 = a fixed micro_batch_size; auto = chosen")
        if isinstance(self.engine.fused_lm_head, str) and self.engine.fused_lm_head != "auto":
            raise ConfigError(f"engine.fused_lm_head: expected true, false or auto, got {self.engine.fused_lm_head!r}")
        _positive("engine.hsdp_replicas", self.engine.hsdp_replicas)
        _non_negative("engine.logprob_chunk_size", self.engine.logprob_chunk_size, "0 = unchunked")
        _positive("dist.nproc", self.dist.nproc)
        _non_negative("sync.memory_budget", self.sync.memory_budget, "0 = 90% of the device")
        _non_negative("sync.peak_every", self.sync.peak_every)
        reason = unsupported_reason(self.sync.mode, self.engine.strategy, self.engine.hsdp_replicas > 1)
        if reason:
            raise ConfigError(reason)
        units = self.sync.deferred_units
        if self.sync.mode == "partial" and units in (0, ""):
            raise ConfigError("sync.mode=partial needs sync.deferred_units: a count K or unit names")
        if isinstance(units, int) and units < 0:
            raise ConfigError(f"sync.deferred_units: must be >= 0, got {units}")
        _positive("dist.timeout_s", self.dist.timeout_s)
        _non_negative("optim.lr", self.optim.lr, "0: the weights never move, as bench --workload grpo runs")
        if self.optim.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip: must be >= 0 (0 disables clipping), got {self.optim.grad_clip}")
        if self.engine.hsdp_replicas > 1 and self.engine.strategy not in SHARDED_STRATEGIES:
            raise ConfigError(
                f"engine.hsdp_replicas={self.engine.hsdp_replicas} needs engine.strategy fsdp2 or fsdp1, "
                f"got {self.engine.strategy!r}"
            )
        if self.model.param_dtype != "float32" and self.engine.strategy not in SHARDED_STRATEGIES:
            raise ConfigError(
                f"model.param_dtype={self.model.param_dtype!r} (mixed precision) needs engine.strategy "
                f"fsdp2 or fsdp1, got {self.engine.strategy!r}"
            )
        return self

    def _validate_rl(self, ppo: bool) -> Config:
        """The rl, train and sft sections."""
        _choice("rl.advantage", self.rl.advantage, ("grpo", "drgrpo", "rloo"))
        _choice("rl.rollout_engine", self.rl.rollout_engine, ROLLOUT_ENGINES)
        if self.rl.vllm_kv_cache_bytes < 0:
            raise ConfigError(f"rl.vllm_kv_cache_bytes: must be >= 0 (0: sized from the batch), got "
                              f"{self.rl.vllm_kv_cache_bytes}")
        _choice("rl.vllm_sleep_level", self.rl.vllm_sleep_level, VLLM_SLEEP_LEVELS)
        _choice("rl.rollout_dtype", self.rl.rollout_dtype, DTYPES)
        self.rl.loss.validate()
        if self.rl.dataset and not self.rl.reward_fn:
            raise ConfigError("rl.dataset needs rl.reward_fn (package.module:function): a prompt file brings no reward")
        _choice("train.logger", self.train.logger, ("jsonl", "tensorboard"))
        _positive("train.steps", self.train.steps)
        _positive("rl.prompts_per_rank", self.rl.prompts_per_rank)
        _positive("rl.samples_per_prompt", self.rl.samples_per_prompt)
        _non_negative("rl.warm_start_steps", self.rl.warm_start_steps)
        _non_negative("rl.balance_min_gain", self.rl.balance_min_gain)
        if self.rl.warm_start_steps and self.rl.dataset:
            raise ConfigError("rl.warm_start_steps: needs a built-in task's demonstrations, not rl.dataset")
        _non_negative("rl.max_new_tokens", self.rl.max_new_tokens, "0: the task's")
        _positive("rl.temperature", self.rl.temperature)
        _non_negative("rl.top_k", self.rl.top_k, "0: off")
        if not 0 < self.rl.top_p <= 1:
            raise ConfigError(f"rl.top_p: must be in (0, 1], got {self.rl.top_p}")
        if not 0 <= self.rl.min_p < 1:
            raise ConfigError(f"rl.min_p: must be in [0, 1), got {self.rl.min_p}")
        if any(not s for s in self.rl.stop):
            raise ConfigError("rl.stop: an empty stop string would end every response at once")
        _choice("rl.chat_template", self.rl.chat_template, ("auto", "true", "false"))
        _choice("rl.prompt_overflow", self.rl.prompt_overflow, ("truncate_left", "drop", "error"))
        _choice("rl.tool_parser", self.rl.tool_parser, ("auto", "hermes", "llama3_json"))
        _positive("rl.max_turns", self.rl.max_turns)
        _positive("rl.tool_timeout_s", self.rl.tool_timeout_s)
        _non_negative("rl.tool_step_timeout_s", self.rl.tool_step_timeout_s, "0: half of dist.timeout_s")
        if not self.rl.tool_step_timeout_s:  # resolved here: what runs is what config.yaml records
            self.rl.tool_step_timeout_s = self.dist.timeout_s / 2
        if self.rl.tool_step_timeout_s >= self.dist.timeout_s:
            raise ConfigError(f"rl.tool_step_timeout_s={self.rl.tool_step_timeout_s:g} must be less than "
                              f"dist.timeout_s={self.dist.timeout_s:g}: the other ranks wait for this one's tools at "
                              f"the next collective, which gives up after dist.timeout_s")
        _positive("rl.tool_max_chars", self.rl.tool_max_chars)
        _positive("rl.tool_workers", self.rl.tool_workers)
        if self.rl.tools and self.rl.chat_template == "false":
            raise ConfigError("rl.tools with rl.chat_template=false: tools are shown to the model and their results "
                              "given back through the chat template")
        _positive("rl.max_prompt_length", self.rl.max_prompt_length)
        functions = reward_paths(self.rl.reward_fn)
        if self.rl.reward_weights and len(self.rl.reward_weights) != len(functions):
            raise ConfigError(f"rl.reward_weights: {len(self.rl.reward_weights)} weight(s) for {len(functions)} "
                              f"reward function(s)")
        _positive("rl.mini_batches", self.rl.mini_batches)
        _positive("rl.epochs", self.rl.epochs)
        samples = self.rl.prompts_per_rank * self.rl.samples_per_prompt
        if self.rl.mini_batches > samples:
            raise ConfigError(
                f"rl.mini_batches={self.rl.mini_batches} is more than the {samples} samples each rank has per step "
                f"(rl.prompts_per_rank x rl.samples_per_prompt)"
            )
        # GRPO: a group of one is its own baseline, advantage 0, nothing to learn (PPO's baseline is the critic)
        if self.rl.samples_per_prompt < 2 and not ppo:
            raise ConfigError(
                f"rl.samples_per_prompt=1: rl.advantage={self.rl.advantage} compares samples of one prompt, and a "
                f"group of one has advantage 0 (no gradient, ever); use rl.samples_per_prompt >= 2"
            )
        if self.rl.rollout_engine == "vllm" and self.rl.truncates and self.rl.temperature != 1:
            raise ConfigError(
                f"rl.rollout_engine=vllm with rl.top_k/top_p/min_p needs rl.temperature=1 (got "
                f"{self.rl.temperature:g}): vLLM gives a drawn token's log-prob before the temperature or after the "
                f"truncation, never of the temperature-scaled full distribution the trainer's are; or use "
                f"rl.rollout_engine=compact")
        if self.rl.rollout_engine == "vllm" and self.rl.min_p > 0 and self.rl.top_p < 1:
            raise ConfigError(
                f"rl.min_p={self.rl.min_p:g} with rl.top_p={self.rl.top_p:g} on rl.rollout_engine=vllm: vLLM applies "
                f"min-p before top-p, the compact sampler and generate after it (transformers' order), so the "
                f"engines would sample different distributions; use one of the two (min-p with top-k agree), or "
                f"rl.rollout_engine=compact")
        if self.rl.loss.rollout_is == "auto":  # resolved here: what runs is what config.yaml records
            self.rl.loss.rollout_is = "token" if self.sampler_differs else "none"
        _non_negative("train.checkpoint_every", self.train.checkpoint_every)
        _validate_sft_config(self.sft)
        return self

    @property
    def sampler_differs(self) -> bool:
        """Whether the rollout samples from another network than the trainer computes: vLLM's kernels, or a
        copy in another dtype than the trainer's compute dtype (what rl.loss.rollout_is=auto corrects)."""
        return self.rl.rollout_engine == "vllm" or self.rl.rollout_dtype != self.model.param_dtype


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be > 0, got {value}")


def reward_paths(value: str | list[str] | None) -> list[str]:
    """``rl.reward_fn`` as a list of paths (one, several, or none)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _validate_sft_config(sft: SFTConfig) -> None:
    _choice("sft.task", sft.task, SFT_TASKS)
    _choice("sft.truncation", sft.truncation, SFT_TRUNCATION)
    _choice("sft.on_bad_row", sft.on_bad_row, ("error", "skip"))
    _non_negative("sft.steps", sft.steps, "0: sft.epochs passes")
    _positive("sft.epochs", sft.epochs)
    _positive("sft.batch_size", sft.batch_size)
    _non_negative("sft.batch_tokens", sft.batch_tokens, "0: sft.batch_size sequences")
    _positive("sft.max_length", sft.max_length)
    _non_negative("sft.eval_every", sft.eval_every, "0: at the end only")
    _non_negative("sft.checkpoint_every", sft.checkpoint_every, "0: the final checkpoint only")
    _positive("sft.log_every", sft.log_every)
    _positive("sft.min_len", sft.min_len)
    if sft.max_len < sft.min_len:
        raise ConfigError(f"sft.max_len: must be >= sft.min_len ({sft.min_len}), got {sft.max_len}")
    if not 0 <= sft.eval_fraction < 1:
        raise ConfigError(f"sft.eval_fraction: must be in [0, 1), got {sft.eval_fraction}")
    if sft.eval_fraction and sft.eval_dataset:
        raise ConfigError("sft.eval_fraction and sft.eval_dataset: give one (a held-out fraction, or a file)")
    if (sft.eval_fraction or sft.eval_dataset) and not sft.dataset:
        raise ConfigError("sft.eval_dataset / sft.eval_fraction need sft.dataset (a built-in task has its own)")


def _non_negative(key: str, value: float, zero: str = "") -> None:
    """``zero``: what 0 means, for the message."""
    if value < 0:
        raise ConfigError(f"{key}: must be >= 0{f' ({zero})' if zero else ''}, got {value}")


def packaged_config(name: str) -> Path:
    """A config file shipped with syncwise (``grpo.yaml``: the default ``syncwise train`` job)."""
    return Path(__file__).parent / "configs" / name


# Keys a packaged job config sets for its own preset (``grpo.yaml``'s LoRA targets include the LM head of its
# random-weight Llama): with a ``model.path`` the user's model is not that preset, and they keep their defaults.
PRESET_ONLY_KEYS = ("model.lora.target_modules",)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, packaged: bool = False) -> Config:
    """Build a validated :class:`Config` from an optional YAML file and ``section.key=value`` overrides.

    Values in overrides are parsed as YAML scalars (``lr=3e-4``, ``cpu_offload=true``, ``path=null``).
    ``packaged``: ``path`` is a config shipped with syncwise (:func:`packaged_config`), whose
    :data:`PRESET_ONLY_KEYS` do not apply to a ``model.path`` unless an override sets them.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            node[leaf] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:  # e.g. rl.stop=[####]: '#' starts a YAML comment
            problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
            raise ConfigError(f"{key.strip()}: cannot read {raw!r} as a YAML value ({problem}); quote it, e.g. "
                              f"{key.strip()}=\"['...']\"") from exc
    if packaged and (data.get("model") or {}).get("path"):
        overridden = {item.partition("=")[0].strip() for item in overrides or []}
        for key in set(PRESET_ONLY_KEYS) - overridden:
            *parents, leaf = key.split(".")
            node = data
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(leaf, None)
    return load_config_dict(data)


def load_config_dict(data: dict[str, Any]) -> Config:
    """A validated :class:`Config` from a nested dict (as :func:`config_to_dict` writes it)."""
    return _build(Config, data, prefix="").validate()


def config_to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for logging or writing back to YAML."""
    return yaml.safe_load(yaml.safe_dump(dataclasses.asdict(config), default_flow_style=False))


# Keys that moved into a section: named in the error instead of a guess.
MOVED = {f"rl.{old}": f"rl.loss.{new}" for old, new in (
    ("clip_low", "clip_low"), ("clip_high", "clip_high"), ("loss_agg", "agg"), ("entropy_coef", "entropy_coef"),
    ("kl_coef", "kl_coef"), ("kl_estimator", "kl_estimator"),
)} | {"rl.sampler": "rl.rollout_engine"}


def _build(cls: type, data: Any, prefix: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(data, dict):
        section = prefix.rstrip(".") or "config"
        raise ConfigError(
            f"{section}: is a section, got the value {data!r}; set its keys ({', '.join(names)}), "
            f"e.g. {section}.{names[0]}=..."
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            if f"{prefix}{key}" in MOVED:
                raise ConfigError(f"'{prefix}{key}' is now '{MOVED[prefix + key]}'")
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{prefix}{key}'{hint}; known keys: {', '.join(names)}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` written over it, section by section (``lora: {rank: 4}`` keeps lora's other
    keys)."""
    merged = dict(base)
    for key, value in overrides.items():
        inner = merged.get(key)
        merged[key] = _deep_merge(inner, value) if isinstance(inner, dict) and isinstance(value, dict) else value
    return merged


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, prefix=f"{key}.")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for candidate in inner[:-1]:  # the first type the value fits
            try:
                return _coerce(candidate, value, key)
            except ConfigError:
                pass
        return _coerce(inner[-1], value, key)
    if origin is dict:  # a section of overrides, checked where it is used (Config.critic_config)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: is a section, got the value {value!r}; set its keys, e.g. {key}.lr=...")
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # YAML 1.1 reads true/false, on/off, yes/no as booleans
            return "true" if value else "false"
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {tp}")  # pragma: no cover - a bug in this module
