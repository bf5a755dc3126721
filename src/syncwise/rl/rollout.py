"""Rollouts: ``samples_per_prompt`` responses per prompt from the current policy, by a rollout engine
(``rl.rollout_engine``), returned as a right-padded training batch: prompt tokens, then the response up to and
including its end token, with ``loss_mask`` on the response.

The trainer talks to :class:`Rollout` only; :class:`Rollout` talks to a :class:`RolloutEngine` -- refresh its
weights from the sharded policy, sample, say what it holds -- and does the rest alike for every engine: the
batch, the sampler's log-probs aligned with the trainer's targets, the rewards. The engines:

- ``compact`` / ``generate`` (:mod:`syncwise.rl.hf_rollout`): a local, unsharded copy of the model on each
  rank, sampled by :mod:`syncwise.rl.sampling` or by Hugging Face ``generate``;
- ``vllm`` (:mod:`syncwise.rl.vllm_rollout`): a vLLM engine colocated on each rank.

Like verl's rollout worker, each rank refreshes its engine from the sharded training model before each step,
one unit at a time (one unit's memory, not the whole model's), then samples without any collective. SGLang or
a remote server is one more module with the three methods of :class:`RolloutEngine`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from ..config import Config
from ..engine import Engine
from .sampling import Samples
from .scoring import score
from .tasks import PromptSource

TRUNCATION_NOTE = (
    "rl.top_k / rl.top_p / rl.min_p truncate the sampler's distribution, and the trainer's log-probs are of the "
    "full one: rollout/log_prob_diff and rl.loss.rollout_is use the sampler's log-probs of the drawn tokens under "
    "the untruncated distribution (the copies' own mismatch; the truncation's kept mass, rollout/kept_mass, is no "
    "policy change and is not weighted in); the gradient is the untruncated policy's at the truncated samples")


class RolloutEngine(Protocol):
    """What samples the responses (``rl.rollout_engine``)."""

    def held_bytes(self) -> int:
        """What the engine keeps in memory on this rank for the whole job (its weights, a KV cache it keeps)."""

    def refresh(self, weights_by_unit: Iterator[dict[str, torch.Tensor]]) -> None:
        """Load the policy's current weights, given one wrapping unit at a time, keyed as the plain Hugging Face
        model's (LoRA merged). Collective through the iterator: consume it all."""

    def sample(self, prompts: list[list[int]], n: int, max_new_tokens: int, seed: int) -> Samples:
        """``n`` responses per prompt (consecutive), each with its drawn tokens' log-probs under the untruncated
        temperature-scaled distribution (``full_log_probs``) and, where the engine knows it, under the one it
        drew from (``log_probs``, else None). ``seed``: this rank's and step's (engines that keep their own
        RNG state in the checkpoint may ignore it)."""

    def describe(self) -> str:
        """A few words for the job's first line."""


def make_rollout_engine(config: Config, engine: Engine, tokenizer: PreTrainedTokenizerBase, end_ids: list[int],
                        max_new_tokens: int) -> RolloutEngine:
    """``rl.rollout_engine``'s engine for this rank (built alike on every rank)."""
    if config.rl.rollout_engine == "vllm":
        from .vllm_rollout import VllmRollout

        return VllmRollout(config, engine, tokenizer, end_ids, max_new_tokens)
    from .hf_rollout import LocalCopyRollout

    return LocalCopyRollout(config.rl, engine, tokenizer, end_ids)


def sample_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of (job seed, step, rank): a resumed job samples the same responses. Engines that
    seed each prompt derive theirs from it (within 2**31, vLLM's range)."""
    return ((seed * 1_000_003 + step) * 1_009 + rank) % (2**31 - 2**20)


class Rollout:
    """This rank's rollout: the engine ``rl.rollout_engine`` names, and the training batch from its samples."""

    def __init__(self, config: Config, engine: Engine, tokenizer: PreTrainedTokenizerBase, source: PromptSource,
                 end_ids: list[int] | None = None):
        self.config, self.cfg, self.engine, self.tokenizer = config, config.rl, engine, tokenizer
        # Every token that ends a response: the tokenizer's end token and the model's generation_config's
        self.end_ids = sorted(set(end_ids or []) | {tokenizer.eos_token_id})
        self.max_new_tokens = self.cfg.max_new_tokens or source.max_new_tokens
        if self.cfg.truncates and engine.info.is_main:
            warnings.warn(TRUNCATION_NOTE, stacklevel=2)
        self.sampler = make_rollout_engine(config, engine, tokenizer, self.end_ids, self.max_new_tokens)

    @property
    def held_bytes(self) -> int:
        """What the rollout engine holds for the whole job on this rank."""
        return self.sampler.held_bytes()

    def describe(self) -> str:
        return self.sampler.describe()

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Collective: the rollout engine refreshed from the current (sharded) policy, one unit at a time
        (LoRA: merged weights)."""
        self.sampler.refresh(self.engine.full_weights_by_unit())

    @torch.no_grad()
    def generate(self, rows: list[dict[str, Any]], prompt_ids: list[list[int]], source: PromptSource, step: int = 0
                 ) -> tuple[dict[str, torch.Tensor], dict]:
        """``samples_per_prompt`` responses per row (its prompt already encoded: ``prompt_ids``) at ``step``;
        returns the training batch and what was sampled: rewards (the weighted total, and each function's in
        ``reward_parts``), texts, response lengths, which responses the length limit cut (``clipped``), the
        sampler's per-token log-probs ([B, T-1], aligned with the batch's targets; of the untruncated
        temperature-scaled distribution, as the trainer's), the mass each response token's truncation kept
        (``kept_mass``; empty where the engine does not report the drawn distribution) and the seconds spent
        in the reward functions (``reward_s``).

        Samples of one prompt are consecutive (the GRPO group)."""
        tok, n = self.tokenizer, self.cfg.samples_per_prompt
        seed = sample_seed(self.config.train.seed, step, self.engine.info.rank)
        samples = self.sampler.sample(prompt_ids, n, self.max_new_tokens, seed)
        full = samples.full_log_probs
        # with truncation, how much of the full distribution's mass each drawn token's step kept
        kept_mass = (torch.cat([(f.float() - d.float()).exp().cpu() for f, d in zip(full, samples.log_probs,
                                                                                     strict=True)])
                     if samples.log_probs is not None else torch.zeros(0))
        prompts = [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids]
        sequences, response_masks, responses, sampler = [], [], [], []
        for i, (response_ids, response_log_probs) in enumerate(zip(samples.tokens, full, strict=True)):
            prompt = prompts[i // n]
            response_ids, response_log_probs = response_ids.cpu(), response_log_probs.float().cpu()
            responses.append(tok.decode(response_ids, skip_special_tokens=True))
            sequences.append(torch.cat([prompt, response_ids]))
            trained = torch.ones_like(response_ids) * int(samples.ended[i] or not self.cfg.mask_truncated)
            response_masks.append(torch.cat([torch.zeros_like(prompt), trained]))
            # Per target (position j predicts token j + 1): the response tokens' sampler log-probs.
            sampler.append(torch.cat([response_log_probs.new_zeros(len(prompt) - 1), response_log_probs]))
        scoring = time.perf_counter()
        group_rows = [rows[i // n] for i in range(len(responses))]
        rewards, parts = score(source.rewards, [row["prompt"] for row in group_rows], responses, group_rows)
        reward_s = time.perf_counter() - scoring
        batch = response_batch(sequences, response_masks, tok.pad_token_id)
        total = batch["input_ids"].shape[1]
        info = {
            "rewards": torch.tensor(rewards),
            "reward_parts": {name: torch.tensor(values) for name, values in parts.items()},
            "responses": responses,
            "response_lengths": torch.tensor([len(r) for r in samples.tokens]),
            "clipped": torch.tensor([not e for e in samples.ended]),
            # [B, T-1], like the trainer's: of the untruncated distribution (the trainer's), see sampling.py
            "log_probs": right_pad(sampler, total - 1, 0.0).cpu(),
            "kept_mass": kept_mass,  # per response token (1 without truncation)
            "reward_s": reward_s,  # spent in the reward functions
        }
        return {k: v.cpu() for k, v in batch.items()}, info


def response_batch(sequences: list[torch.Tensor], response_masks: list[torch.Tensor], pad_id: int) -> dict:
    """A right-padded training batch of prompt + response sequences, ``loss_mask`` on the responses."""
    width = max(len(s) for s in sequences)
    return {
        "input_ids": right_pad(sequences, width, pad_id),
        "attention_mask": right_pad([torch.ones_like(s) for s in sequences], width, 0),
        "loss_mask": right_pad(response_masks, width, 0),
    }


def right_pad(rows: list[torch.Tensor], width: int, value: int) -> torch.Tensor:
    """Stack 1-D tensors, each right-padded with ``value`` to ``width``."""
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=value) for r in rows])
