"""What ``syncwise plan`` is asked (:class:`PlanInput`) and the shapes it knows by name -- torch-free, so
the command line rejects a bad argument before importing torch or transformers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import DTYPES, ROLLOUT_ENGINES, LoraConfig

# Shapes of common models, from their public config.json files (weights are never needed).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
    ),
    "llama-3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    ),
    # a mixture of experts: 128 experts a layer, 8 a token (Qwen/Qwen3-30B-A3B's config.json)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, router_aux_loss_coef=0.001,
    ),
}


@dataclass
class PlanInput:
    model: str
    world_size: int = 8
    replicas: int = 1  # > 1: HSDP with this many replicas of world_size / replicas shards
    microbatches: int = 8
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    device_memory_gib: float = 80.0
    budget_fraction: float = 0.9
    activation_gib: float = 0.0  # per rank, for one micro-batch (what a profile of your job shows)
    seq_len: int = 0  # > 0: estimate activations from the model's shapes instead (tokens per sequence)
    micro_batch_size: int = 1
    activation_checkpointing: bool = False
    sequence_parallel: int = 1  # dist.sequence_parallel: ranks sharing each sequence (activations at 1/N)
    logprob_chunk: int = 1024  # tokens whose fp32 log-softmax exists at once (engine.logprob_chunk_size)
    # engine.fused_lm_head: true (no [tokens, vocabulary] logits kept), false, or auto (chosen with the mode)
    fused_lm_head: bool | str = "auto"
    # engine.max_tokens_per_micro_batch=auto: the step's sequences (microbatches x micro_batch_size of seq_len)
    # split under the token cap auto chooses with the mode (needs seq_len)
    auto_cap: bool = False
    compute_tflops: float = 400.0  # the device's dense matmul rate: what the fused head's extra compute costs
    lora_rank: int = 0  # > 0: only LoRA adapters of this rank train (model.lora.rank, target all-linear)
    # GRPO's rollout on every rank: sequences sampled at once (rl.prompts_per_rank x rl.samples_per_prompt;
    # 0: no rollout copy), their prompt and new tokens (rl.max_new_tokens), the copy's dtype.
    rollout_sequences: int = 0
    rollout_prompt_len: int = 0
    rollout_new_tokens: int = 0
    rollout_dtype: str = "float32"
    # rl.rollout_engine (what each holds: syncwise.memory.rollout)
    rollout_sampler: str = "compact"
    critic: bool = False  # PPO: a value model beside the policy (its own plan; each holds the other's state)
    # dist.rollout_ranks: the last M of world_size ranks only sample (the rollout engine alone on each); the
    # others train (their shards over world_size - M ranks, no rollout copy beside them)
    rollout_ranks: int = 0
    bandwidth_gbps: float = 100.0  # GB/s per rank within a shard group
    replica_bandwidth_gbps: float | None = None  # GB/s across replicas (default: bandwidth_gbps)
    latency_us: float = 10.0

    @property
    def trainers(self) -> int:
        """The ranks that train (and shard the model)."""
        return self.world_size - self.rollout_ranks

    def validate(self) -> None:
        if self.rollout_ranks and not 0 < self.rollout_ranks <= self.trainers:
            raise ValueError(f"--rollout-ranks {self.rollout_ranks} of --world-size {self.world_size}: at least as "
                             f"many ranks must train")
        if self.rollout_ranks and not self.rollout_sequences:
            raise ValueError("--rollout-ranks needs --rollout-sequences (what a rollout rank samples at once)")
        if self.world_size < 1 or self.replicas < 1 or self.trainers % self.replicas:
            raise ValueError(f"--replicas {self.replicas} must divide the {self.trainers} training ranks")
        if self.microbatches < 1:
            raise ValueError("--microbatches must be >= 1")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"--{name.replace('_', '-')}: {getattr(self, name)!r} is not one of "
                                 f"{', '.join(DTYPES)}")
        if self.bandwidth_gbps <= 0 or self.device_memory_gib <= 0:
            raise ValueError("--bandwidth-gbps and --device-memory-gib must be > 0")
        if not 0 < self.budget_fraction <= 1:
            raise ValueError(f"--budget-fraction must be in (0, 1], got {self.budget_fraction}")
        if self.latency_us < 0 or self.activation_gib < 0:
            raise ValueError("--latency-us and --activation-gib must be >= 0")
        if self.seq_len < 0 or self.micro_batch_size < 1 or self.logprob_chunk < 0:
            raise ValueError("--seq-len must be >= 0, --micro-batch-size >= 1, --logprob-chunk >= 0")
        if self.sequence_parallel < 1 or self.trainers % self.sequence_parallel:
            raise ValueError(f"--sequence-parallel {self.sequence_parallel} must divide the {self.trainers} training "
                             f"ranks")
        if self.fused_lm_head not in (True, False, "auto"):
            raise ValueError(f"--fused-lm-head: {self.fused_lm_head!r} is not one of auto, true, false")
        if self.auto_cap and not self.seq_len:
            raise ValueError("--auto-cap needs --seq-len (the sequences the cap splits)")
        if self.compute_tflops <= 0:
            raise ValueError("--compute-tflops must be > 0")
        if self.replica_bandwidth_gbps is not None and self.replica_bandwidth_gbps <= 0:
            raise ValueError("--replica-bandwidth-gbps must be > 0")
        LoraConfig(rank=self.lora_rank).validate(prefix="--lora-")  # >= 0; peft installed
        if min(self.rollout_sequences, self.rollout_prompt_len, self.rollout_new_tokens) < 0:
            raise ValueError("--rollout-sequences, --rollout-prompt-len and --rollout-new-tokens must be >= 0")
        if self.rollout_sequences and not self.rollout_new_tokens:
            raise ValueError("--rollout-sequences needs --rollout-new-tokens (rl.max_new_tokens)")
        if self.rollout_sampler not in ROLLOUT_ENGINES:
            raise ValueError(f"--rollout-sampler: {self.rollout_sampler!r} is not one of {', '.join(ROLLOUT_ENGINES)}")
        if self.rollout_dtype not in DTYPES:
            raise ValueError(f"--rollout-dtype: {self.rollout_dtype!r} is not one of {', '.join(DTYPES)}")
