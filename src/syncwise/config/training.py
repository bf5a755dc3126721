"""The training sections: the model (and its LoRA adapters), how it is wrapped and fed (``engine``), when
gradients are communicated (``sync``), the optimizer and the process group (``dist``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sync.modes import MODE_NAMES
from .checks import ConfigError, choice, non_negative, positive

STRATEGIES = ("fsdp2", "fsdp1", "ddp", "none")
SHARDED_STRATEGIES = ("fsdp2", "fsdp1")  # parameters sharded in FSDP units
DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "sgd")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class LoraConfig:
    """LoRA adapters on the model (``model.lora.*``, built with peft: ``pip install 'syncwise[lora]'``).
    Only the adapters train; the base weights stay frozen."""

    rank: int = 0  # 0: off (the whole model trains)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input (model.dropout=auto turns it off for syncwise train)
    # "all-linear" (every linear projection of the decoder layers, not the LM head) or comma-separated
    # module names (q_proj,v_proj).
    target_modules: str = "all-linear"

    def validate(self, prefix: str = "model.lora.") -> LoraConfig:
        if self.rank < 0:
            raise ConfigError(f"{prefix}rank: must be >= 0 (0 = no LoRA), got {self.rank}")
        if not self.rank:
            return self
        positive(f"{prefix}alpha", self.alpha)
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

    preset: str = "qwen2-tiny"  # a built-in config (syncwise.models.PRESETS), built with seeded weights
    # a Hugging Face model folder (save_pretrained output), or a hub id (org/name) resolved to its snapshot in the
    # Hugging Face cache before any rank starts (downloaded unless HF_HUB_OFFLINE=1); wins over preset
    path: str | None = None
    param_dtype: str = "float32"  # the compute dtype of the wrapped model (the master weights stay fp32)
    reduce_dtype: str = "float32"  # the dtype gradients are reduced in across ranks
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2 | ... (what the model class supports)
    seed: int = 0  # a preset's initial weights and LoRA's adapters are drawn from it
    # Dropout in the model's config and in LoRA: keep | off | auto (off for `syncwise train`, whose ratios,
    # old log-probs and KL must see the same network the sampler drew from; kept for `syncwise sft`)
    dropout: str = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> ModelConfig:
        choice("model.param_dtype", self.param_dtype, DTYPES)
        choice("model.reduce_dtype", self.reduce_dtype, DTYPES)
        self.lora.validate()
        # YAML reads a bare `off` as false (and `on` as true)
        self.dropout = {"false": "off", "true": "keep"}.get(self.dropout, self.dropout)
        choice("model.dropout", self.dropout, ("auto", "keep", "off"))
        return self


@dataclass
class EngineConfig:
    """How the model is wrapped and fed."""

    strategy: str = "fsdp2"  # fsdp2 | fsdp1 | ddp | none: how the model is spread over the ranks
    # Sequences per micro-batch. 0 (the default): the token cap below splits the batch (2 where it is 0);
    # set, it wins over the cap's ``auto``.
    micro_batch_size: int = 0
    # > 0: a hard cap on the tokens of every micro-batch (real tokens when packed, rows x longest when
    # padded); the fewest micro-batches that keep within it, balanced by the workload estimate a·L + L²;
    # micro_batch_size is then ignored. auto: chosen with the sync mode from the memory budget (the
    # largest power of two whose predicted peak fits beside the fastest sync mode; see perf_tuning.md).
    max_tokens_per_micro_batch: int | str = "auto"
    workload_linear_coef: float = 24576.0  # a in the workload estimate a·L + L² that balances the micro-batches
    # Each micro-batch's sequences in one row without padding (models that keep packed sequences apart).
    packing: bool = True
    # Packed rows that begin alike (GRPO's samples of one prompt) compute their common start once and read it
    # from one row: the same gradient, the prompt's tokens computed once per group instead of once per sample
    # (models whose check passes, without dropout). auto: where packed rows run the per-sequence sdpa loop (CPU,
    # fp32); true: also in place of a variable-length kernel (bf16 / fp16 on a GPU; not measured there).
    share_prefixes: bool | str = "auto"
    # Recompute each decoder layer's activations in backward instead of keeping them.
    activation_checkpointing: bool = False
    # Tokens whose fp32 log-softmax over the vocabulary exists at once (log-probs, entropy); 0 = all.
    logprob_chunk_size: int = 1024
    # Log-probs and entropy straight from the final hidden states, a chunk of tokens at a time: the
    # [tokens, vocabulary] logits and their gradient never exist at once (models whose forward allows it).
    # auto: materialised where the logits and their gradient fit the memory budget beside the chosen sync
    # mode (faster), fused where they do not; decided with the sync mode.
    fused_lm_head: bool | str = "auto"
    reshard_after_forward: bool = True  # FSDP: free the gathered parameters after forward (gather again in backward)
    cpu_offload: bool = False  # FSDP: parameters, gradients and optimizer state in host memory
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

    def validate(self) -> EngineConfig:
        choice("engine.strategy", self.strategy, STRATEGIES)
        non_negative("engine.micro_batch_size", self.micro_batch_size, "0 = the token cap decides")
        cap = self.max_tokens_per_micro_batch
        if isinstance(cap, str) and cap != "auto":
            raise ConfigError(f"engine.max_tokens_per_micro_batch: expected a token count or auto, got {cap!r}")
        if not isinstance(cap, str):
            non_negative("engine.max_tokens_per_micro_batch", cap, "0 = a fixed micro_batch_size; auto = chosen")
        if isinstance(self.share_prefixes, str) and self.share_prefixes != "auto":
            raise ConfigError(f"engine.share_prefixes: expected true, false or auto, got {self.share_prefixes!r}")
        if isinstance(self.fused_lm_head, str) and self.fused_lm_head != "auto":
            raise ConfigError(f"engine.fused_lm_head: expected true, false or auto, got {self.fused_lm_head!r}")
        positive("engine.hsdp_replicas", self.hsdp_replicas)
        non_negative("engine.logprob_chunk_size", self.logprob_chunk_size, "0 = unchunked")
        if self.hsdp_replicas > 1 and self.strategy not in SHARDED_STRATEGIES:
            raise ConfigError(f"engine.hsdp_replicas={self.hsdp_replicas} needs engine.strategy fsdp2 or fsdp1, "
                              f"got {self.strategy!r}")
        return self


@dataclass
class SyncConfig:
    """When gradients are communicated across the micro-batches of one optimizer step."""

    # When a step's micro-batches sync their gradients: auto (chosen from the memory budget) | per_microbatch |
    # deferred | deferred_unsharded | partial | ... (syncwise.sync.modes; docs/perf_tuning.md)
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

    def validate(self) -> SyncConfig:
        choice("sync.mode", self.mode, MODE_NAMES)
        non_negative("sync.memory_budget", self.memory_budget, "0 = 90% of the device")
        non_negative("sync.peak_every", self.peak_every)
        if self.mode == "partial" and self.deferred_units in (0, ""):
            raise ConfigError("sync.mode=partial needs sync.deferred_units: a count K or unit names")
        if isinstance(self.deferred_units, int) and self.deferred_units < 0:
            raise ConfigError(f"sync.deferred_units: must be >= 0, got {self.deferred_units}")
        return self


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-3  # the peak learning rate (syncwise train on a model.path: 1e-6 unless set)
    weight_decay: float = 0.0  # decoupled (AdamW), or L2 (SGD)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam's moment decays
    momentum: float = 0.0  # SGD's
    grad_clip: float = 1.0  # the global gradient norm is clipped to this (0: no clipping)
    warmup_steps: int = 0  # linear warm-up from 0
    schedule: str = "constant"  # constant | cosine (decays to 10% over the job's steps)

    def validate(self) -> OptimConfig:
        choice("optim.name", self.name, OPTIMIZERS)
        choice("optim.schedule", self.schedule, ("constant", "cosine"))
        non_negative("optim.lr", self.lr, "0: the weights never move, as bench --workload grpo runs")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip: must be >= 0 (0 disables clipping), got {self.grad_clip}")
        return self


@dataclass
class DistConfig:
    """Process-group set-up. Under torchrun the environment wins and ``nproc`` is ignored."""

    nproc: int = 2  # local ranks the launcher starts (ignored under torchrun)
    backend: str = "auto"  # auto (nccl with a GPU, else gloo) | nccl | gloo
    timeout_s: float = 600.0  # a collective that waits longer ends the job, naming what it waited on
    # syncwise train: the job's last rollout_ranks ranks only sample (and score); the others train, and send them
    # the weights after each step (they draw step t + rl.off_policy_lag while step t trains, the lag 1 unless set;
    # with rl.max_staleness they draw partial rollouts on, taking each new policy between two rounds)
    rollout_ranks: int = 0
    # Ulysses sequence parallelism: groups of N consecutive ranks share every packed row, each holding 1/N of its
    # positions (its activations 1/N); 1: off; auto: the fewest that fit the longest sequence in the memory budget
    sequence_parallel: int | str = 1

    def validate(self) -> DistConfig:
        positive("dist.nproc", self.nproc)
        if self.sequence_parallel != "auto":
            if isinstance(self.sequence_parallel, bool) or not isinstance(self.sequence_parallel, int):
                raise ConfigError(f"dist.sequence_parallel: a number of ranks (1: off) or auto, "
                                  f"got {self.sequence_parallel!r}")
            positive("dist.sequence_parallel", self.sequence_parallel)
        non_negative("dist.rollout_ranks", self.rollout_ranks, "0: every rank trains and samples")
        if self.rollout_ranks and self.rollout_ranks > self.nproc - self.rollout_ranks:
            raise ConfigError(f"dist.rollout_ranks={self.rollout_ranks} of dist.nproc={self.nproc}: at least as many "
                              f"ranks must train (each rollout rank serves one or more trainers)")
        choice("dist.backend", self.backend, BACKENDS)
        positive("dist.timeout_s", self.timeout_s)
        return self
