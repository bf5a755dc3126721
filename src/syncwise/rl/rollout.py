"""Rollouts: sample responses from a local, unsharded copy of the policy (:mod:`syncwise.rl.sampling`, or
Hugging Face ``generate`` with ``rl.sampler=generate``).

Like verl's rollout worker, each rank keeps an inference copy of the model and refreshes its weights
from the sharded training model before each step -- one unit at a time, so the refresh needs one unit's
memory, not the whole model's -- then generates without any collective. The samples come back as a
right-padded training batch: prompt tokens, then the response up to and including its end-of-sequence
token, with ``loss_mask`` on the response.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ..config import RLConfig
from ..engine import Engine
from ..engine.weights import load_by_unit
from ..models import uninitialised_model
from .sampling import StopStrings, Truncation, left_padded, sample
from .scoring import score
from .tasks import PromptSource

TRUNCATION_NOTE = (
    "rl.top_k / rl.top_p / rl.min_p truncate the sampler's distribution, and the trainer's log-probs are of the "
    "full one: rollout/log_prob_diff and rl.loss.rollout_is use the sampler's log-probs of the drawn tokens under "
    "the untruncated distribution (the copies' own mismatch; the truncation's kept mass, rollout/kept_mass, is no "
    "policy change and is not weighted in); the gradient is the untruncated policy's at the truncated samples")


class Rollout:
    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, cfg: RLConfig,
                 end_ids: list[int] | None = None):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        # Every token that ends a response: the tokenizer's end token and the model's generation_config's
        self.end_ids = sorted(set(end_ids or []) | {tokenizer.eos_token_id})
        self.cut = Truncation(cfg.top_k, cfg.top_p, cfg.min_p)
        if self.cut.active and engine.info.is_main:
            warnings.warn(TRUNCATION_NOTE, stacklevel=2)
        self.stop = StopStrings(cfg.stop, tokenizer)
        # Built uninitialised: the first refresh writes every parameter (load_by_unit checks it).
        self.model = uninitialised_model(engine.features.plain_hf_config, getattr(torch, cfg.rollout_dtype),
                                         engine.info.device)
        self.model.eval().requires_grad_(False)

    @property
    def copy_bytes(self) -> int:
        """What the rollout copy holds (its parameters and buffers)."""
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Collective: copy the current (sharded) policy into the local inference model, one unit at a time
        (LoRA: merged weights)."""
        load_by_unit(self.model, self.engine.full_weights_by_unit())

    @torch.no_grad()
    def generate(self, rows: list[dict[str, Any]], prompt_ids: list[list[int]], source: PromptSource
                 ) -> tuple[dict[str, torch.Tensor], dict]:
        """``samples_per_prompt`` responses per row (its prompt already encoded: ``prompt_ids``); returns the
        training batch and what was sampled: rewards (the weighted total, and each function's in
        ``reward_parts``), texts, response lengths, which responses the length limit cut (``clipped``), the
        sampler's per-token log-probs ([B, T-1], aligned with the batch's targets; of the untruncated
        temperature-scaled distribution, as the trainer's), the mass each response token's truncation kept
        (``kept_mass``) and the seconds spent in the reward functions (``reward_s``).

        Samples of one prompt are consecutive (the GRPO group)."""
        tok, n = self.tokenizer, self.cfg.samples_per_prompt
        prompts = [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids]
        max_new_tokens = self.max_new_tokens(source)
        if self.cfg.sampler == "generate":
            responses_ids, drawn, full, ended = self._hf_generate(prompts, max_new_tokens)
        else:
            samples = sample(self.model, prompts, n, max_new_tokens, self.cfg.temperature, self.end_ids,
                             tok.pad_token_id, self.cut, self.stop)
            responses_ids, drawn, full, ended = samples.tokens, samples.log_probs, samples.full_log_probs, samples.ended
        # with truncation, how much of the full distribution's mass each drawn token's step kept
        kept_mass = torch.cat([(f.float() - d.float()).exp().cpu() for f, d in zip(full, drawn, strict=True)])
        sequences, response_masks, responses, sampler = [], [], [], []
        for i, (response_ids, response_log_probs) in enumerate(zip(responses_ids, full, strict=True)):
            prompt = prompts[i // n]
            response_ids, response_log_probs = response_ids.cpu(), response_log_probs.float().cpu()
            responses.append(tok.decode(response_ids, skip_special_tokens=True))
            sequences.append(torch.cat([prompt, response_ids]))
            trained = torch.ones_like(response_ids) * int(ended[i] or not self.cfg.mask_truncated)
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
            "response_lengths": torch.tensor([len(r) for r in responses_ids]),
            "clipped": torch.tensor([not e for e in ended]),
            # [B, T-1], like the trainer's: of the untruncated distribution (the trainer's), see sampling.py
            "log_probs": right_pad(sampler, total - 1, 0.0).cpu(),
            "kept_mass": kept_mass,  # per response token (1 without truncation)
            "reward_s": reward_s,  # spent in the reward functions
        }
        return {k: v.cpu() for k, v in batch.items()}, info

    def max_new_tokens(self, source: PromptSource) -> int:
        return self.cfg.max_new_tokens or source.max_new_tokens

    def _hf_generate(self, prompts: list[torch.Tensor], max_new_tokens: int) -> tuple[list, list, list, list]:
        """``rl.sampler=generate``: Hugging Face ``generate`` (each prompt prefilled once per sample, every
        sequence computed until the longest ends, every step's scores kept). Per sequence: the response up to
        its first end token or stop string, the log-prob of each token under the scores (after the
        temperature and truncation warpers: the distribution it was drawn from) and under the raw logits over
        the temperature (untruncated), and whether it ended."""
        tok, n, device = self.tokenizer, self.cfg.samples_per_prompt, self.engine.info.device
        input_ids, mask = left_padded(prompts, tok.pad_token_id, device)
        width = input_ids.shape[1]
        cut = self.cut
        out = self.model.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=self.cfg.temperature,
            top_k=cut.top_k, top_p=cut.top_p, min_p=cut.min_p or None, max_new_tokens=max_new_tokens,
            num_return_sequences=n, pad_token_id=tok.pad_token_id, eos_token_id=self.end_ids,
            stop_strings=self.cfg.stop or None, tokenizer=tok if self.cfg.stop else None,
            return_dict_in_generate=True, output_scores=True, output_logits=cut.active,
        )
        steps = torch.stack(out.scores, dim=1).float().log_softmax(dim=-1)  # [B * n, new tokens, V]
        drawn = steps.gather(-1, out.sequences[:, width:, None]).squeeze(-1)
        full = drawn
        if cut.active:
            raw = (torch.stack(out.logits, dim=1).float() / self.cfg.temperature).log_softmax(dim=-1)
            full = raw.gather(-1, out.sequences[:, width:, None]).squeeze(-1)
        cut_at = [self._end_of(generated[width:]) for generated in out.sequences]
        responses = [generated[width : width + length] for generated, (length, _) in zip(out.sequences, cut_at,
                                                                                          strict=True)]
        return (responses, [drawn[i, : len(r)] for i, r in enumerate(responses)],
                [full[i, : len(r)] for i, r in enumerate(responses)], [e for _, e in cut_at])

    def _end_of(self, ids: torch.Tensor) -> tuple[int, bool]:
        """(length, ended): up to and including the first end token or the token completing a stop string."""
        hits = torch.isin(ids, torch.tensor(self.end_ids, device=ids.device)).nonzero()
        length = int(hits[0]) + 1 if hits.numel() else len(ids)
        if self.stop:
            for i in range(length):
                if self.stop.hit(ids[: i + 1].tolist()):
                    return i + 1, True
        return length, bool(hits.numel())


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
