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
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from ..config import Config
from ..engine import Engine
from .multi_turn import ToolLoop, counts_tensor
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
        drew from (``log_probs``, else None). ``seed``: the first of ``len(prompts) * n`` consecutive seeds
        reserved for this call (:func:`sample_seed`), sample k of prompt i's ``seed + i * n + k`` (engines that
        keep their own RNG state in the checkpoint may ignore it)."""

    def release(self) -> None:
        """A rollout is over (every turn sampled): free what the engine need not hold through the update, until
        the next :meth:`refresh` (vLLM's sleep mode on CUDA)."""

    def describe(self) -> str:
        """A few words for the job's first line."""


def make_rollout_engine(config: Config, engine: Engine, tokenizer: PreTrainedTokenizerBase, end_ids: list[int],
                        max_new_tokens: int, beside_bytes: int = 0) -> RolloutEngine:
    """``rl.rollout_engine``'s engine for this rank (built alike on every rank); ``beside_bytes``: what the
    job keeps beside the policy (a frozen reference, PPO's critic), for an engine that plans its memory."""
    if config.rl.rollout_engine == "vllm":
        from .vllm_rollout import VllmRollout

        return VllmRollout(config, engine, tokenizer, end_ids, max_new_tokens, beside_bytes)
    from .hf_rollout import LocalCopyRollout

    return LocalCopyRollout(config.rl, engine, tokenizer, end_ids)


# vLLM seeds a torch.Generator per request: any value below 2**64 is taken as it is
SEED_SPACE = 2**62


def sample_seed(seed: int, step: int, rank: int, world_size: int, turn: int, turns: int, sequences: int) -> int:
    """The first of ``sequences`` consecutive sampling seeds reserved for (job seed, step, rank, turn): an engine
    that seeds each sample gives sample k of prompt i ``base + i * n + k`` (vLLM adds k to a request's seed for
    its n samples), so no two samples of a job -- across steps, ranks, turns, prompts and samples -- share a seed
    (up to 2**40 of them), and a resumed job draws the same."""
    index = ((step * world_size + rank) * turns + turn) * sequences
    return (seed * 2**40 + index) % SEED_SPACE


class Rollout:
    """This rank's rollout: the engine ``rl.rollout_engine`` names, and the training batch from its samples."""

    def __init__(self, config: Config, engine: Engine, tokenizer: PreTrainedTokenizerBase, source: PromptSource,
                 end_ids: list[int] | None = None, beside_bytes: int = 0):
        self.config, self.cfg, self.engine, self.tokenizer = config, config.rl, engine, tokenizer
        # Every token that ends a response: the tokenizer's end token and the model's generation_config's
        self.end_ids = sorted(set(end_ids or []) | {tokenizer.eos_token_id})
        self.max_new_tokens = self.cfg.max_new_tokens or source.max_new_tokens
        if self.cfg.truncates and engine.info.is_main:
            warnings.warn(TRUNCATION_NOTE, stacklevel=2)
        self.sampler = make_rollout_engine(config, engine, tokenizer, self.end_ids, self.max_new_tokens,
                                           beside_bytes)
        self.tool_loop = ToolLoop(self.cfg, tokenizer, source.tools, self.end_ids) if source.tools else None

    @property
    def held_bytes(self) -> int:
        """What the rollout engine holds for the whole job on this rank."""
        return self.sampler.held_bytes()

    def describe(self) -> str:
        loop = f", {self.tool_loop.describe()}" if self.tool_loop is not None else ""
        return self.sampler.describe() + loop

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Collective: the rollout engine refreshed from the current (sharded) policy, one unit at a time
        (LoRA: merged weights)."""
        self.sampler.refresh(self.engine.full_weights_by_unit())

    @torch.no_grad()
    def generate(self, rows: list[dict[str, Any]], prompt_ids: list[list[int]], source: PromptSource, step: int = 0,
                 tool_schemas: list | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """``samples_per_prompt`` responses per row (its prompt already encoded: ``prompt_ids``; with
        ``rl.tools``, conversations, the rows' tools shown as ``tool_schemas``) at ``step``; returns the training
        batch and what was sampled: rewards (the weighted total, and each function's in ``reward_parts``),
        responses (texts; with tools, each conversation's messages after the prompt), response lengths (every
        token after the prompt), which responses the length limit cut (``clipped``), the sampler's per-token
        log-probs ([B, T-1], aligned with the batch's targets; of the untruncated temperature-scaled
        distribution, as the trainer's; 0 where nothing was sampled), the mass each sampled token's truncation
        kept (``kept_mass``; empty where the engine does not report the drawn distribution), the seconds spent
        in the reward functions (``reward_s``) and the tools (``tool_s``), and with tools the counts of
        :data:`~syncwise.rl.multi_turn.TOOL_COUNTS` (``tool_counts``).

        Samples of one prompt are consecutive (the GRPO group)."""
        n, info = self.cfg.samples_per_prompt, self.engine.info
        turns = self.cfg.max_turns if self.tool_loop is not None else 1
        seeds = [sample_seed(self.config.train.seed, step, info.rank, info.world_size, turn, turns,
                             len(prompt_ids) * n) for turn in range(turns)]
        if self.tool_loop is not None:
            conversations, tool_s = self.tool_loop.run(self.sampler, rows, prompt_ids, tool_schemas or
                                                       [None] * len(rows), n, self.max_new_tokens, seeds)
            responses = [c.messages for c in conversations]
            drawn_known = all(c.drawn_log_probs is not None for c in conversations)
            sampled = [_Sampled(torch.tensor(c.tokens, dtype=torch.long), torch.tensor(c.sampled, dtype=torch.long),
                                torch.tensor(c.full_log_probs), torch.tensor(c.drawn_log_probs) if drawn_known
                                else None, c.ended) for c in conversations]
        else:
            samples = self.sampler.sample(prompt_ids, n, self.max_new_tokens, seeds[0])
            tool_s, conversations = 0.0, None
            responses = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in samples.tokens]
            drawn_all = samples.log_probs if samples.log_probs is not None else [None] * len(samples.tokens)
            sampled = [_Sampled(ids.cpu(), torch.ones_like(ids.cpu()), full.float().cpu(),
                                drawn.float().cpu() if drawn is not None else None, ended)
                       for ids, full, drawn, ended in zip(samples.tokens, samples.full_log_probs, drawn_all,
                                                          samples.ended, strict=True)]
        self.sampler.release()  # every turn sampled: the engine may free what the update does not need
        # with truncation, how much of the full distribution's mass each drawn token's step kept
        kept_mass = (torch.cat([(s.full - s.drawn).exp()[s.sampled.bool()] for s in sampled])
                     if all(s.drawn is not None for s in sampled) else torch.zeros(0))
        prompts = [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids]
        sequences, response_masks, sampler = [], [], []
        for i, one in enumerate(sampled):
            prompt = prompts[i // n]
            sequences.append(torch.cat([prompt, one.tokens]))
            trained = one.sampled * int(one.ended or not self.cfg.mask_truncated)
            response_masks.append(torch.cat([torch.zeros_like(prompt), trained]))
            # Per target (position j predicts token j + 1): the response tokens' sampler log-probs.
            sampler.append(torch.cat([one.full.new_zeros(len(prompt) - 1), one.full * one.sampled]))
        scoring = time.perf_counter()
        group_rows = [rows[i // n] for i in range(len(responses))]
        rewards, parts = score(source.rewards, [row["prompt"] for row in group_rows], responses, group_rows)
        reward_s = time.perf_counter() - scoring
        batch = response_batch(sequences, response_masks, self.tokenizer.pad_token_id)
        total = batch["input_ids"].shape[1]
        info = {
            "rewards": torch.tensor(rewards),
            "reward_parts": {name: torch.tensor(values) for name, values in parts.items()},
            "responses": responses,
            "response_lengths": torch.tensor([len(s.tokens) for s in sampled]),
            "clipped": torch.tensor([not s.ended for s in sampled]),
            # [B, T-1], like the trainer's: of the untruncated distribution (the trainer's), see sampling.py
            "log_probs": right_pad(sampler, total - 1, 0.0).cpu(),
            "kept_mass": kept_mass.double(),  # per sampled token (1 without truncation)
            "reward_s": reward_s,  # spent in the reward functions
            "tool_s": tool_s,  # spent in the tools
        }
        if conversations is not None:
            info["tool_counts"] = counts_tensor(conversations)
        return {k: v.cpu() for k, v in batch.items()}, info


@dataclass
class _Sampled:
    """One sample after its prompt: its tokens, which the policy drew (1) and which the template wrote (0), the
    sampler's log-prob of each (full distribution; the drawn one's, or None) and whether it ended by itself."""

    tokens: torch.Tensor
    sampled: torch.Tensor
    full: torch.Tensor
    drawn: torch.Tensor | None
    ended: bool


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
