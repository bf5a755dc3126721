"""Rollouts: sample responses from a local, unsharded copy of the policy (:mod:`syncwise.rl.sampling`, or
Hugging Face ``generate`` with ``rl.sampler=generate``).

Like verl's rollout worker, each rank keeps an inference copy of the model and refreshes its weights
from the sharded training model before each step -- one unit at a time, so the refresh needs one unit's
memory, not the whole model's -- then generates without any collective. The samples come back as a
right-padded training batch: prompt tokens, then the response up to and including its end-of-sequence
token, with ``loss_mask`` on the response.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ..config import RLConfig
from ..engine import Engine
from ..engine.weights import load_by_unit
from ..models import uninitialised_model
from .sampling import left_padded, sample
from .tasks import PromptSource


class Rollout:
    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, cfg: RLConfig):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
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
    def generate(self, rows: list[dict[str, Any]], source: PromptSource) -> tuple[dict[str, torch.Tensor], dict]:
        """``samples_per_prompt`` responses per row; returns the training batch and what was sampled:
        rewards, texts, response lengths, the sampler's per-token log-probs ([B, T-1], aligned with the
        batch's targets; the distribution softmax(logits / rl.temperature) each token was drawn from) and
        the seconds spent in the reward function (``reward_s``).

        Samples of one prompt are consecutive (the GRPO group)."""
        tok, n = self.tokenizer, self.cfg.samples_per_prompt
        prompts = [torch.tensor(tok(row["prompt"])["input_ids"], dtype=torch.long) for row in rows]
        max_new_tokens = self.cfg.max_new_tokens or source.max_new_tokens
        if self.cfg.sampler == "generate":
            responses_ids, drawn = self._hf_generate(prompts, max_new_tokens)
        else:
            samples = sample(self.model, prompts, n, max_new_tokens, self.cfg.temperature, tok.eos_token_id,
                             tok.pad_token_id)
            responses_ids, drawn = samples.tokens, samples.log_probs
        sequences, response_masks, rewards, responses, sampler = [], [], [], [], []
        reward_s = 0.0
        for i, (response_ids, response_log_probs) in enumerate(zip(responses_ids, drawn, strict=True)):
            row, prompt_ids = rows[i // n], prompts[i // n]
            response_ids, response_log_probs = response_ids.cpu(), response_log_probs.float().cpu()
            text = tok.decode(response_ids, skip_special_tokens=True)
            scoring = time.perf_counter()
            rewards.append(_score(source, row, text))
            reward_s += time.perf_counter() - scoring
            responses.append(text)
            sequences.append(torch.cat([prompt_ids, response_ids]))
            response_masks.append(torch.cat([torch.zeros_like(prompt_ids), torch.ones_like(response_ids)]))
            # Per target (position j predicts token j + 1): the response tokens' sampler log-probs.
            sampler.append(torch.cat([response_log_probs.new_zeros(len(prompt_ids) - 1), response_log_probs]))
        batch = response_batch(sequences, response_masks, tok.pad_token_id)
        total = batch["input_ids"].shape[1]
        info = {
            "rewards": torch.tensor(rewards),
            "responses": responses,
            "response_lengths": torch.tensor([int(m.sum()) for m in response_masks]),
            "log_probs": right_pad(sampler, total - 1, 0.0).cpu(),  # [B, T-1], like the trainer's
            "reward_s": reward_s,  # spent in the reward function
        }
        return {k: v.cpu() for k, v in batch.items()}, info

    def _hf_generate(self, prompts: list[torch.Tensor], max_new_tokens: int) -> tuple[list, list]:
        """``rl.sampler=generate``: Hugging Face ``generate`` (each prompt prefilled once per sample, every
        sequence computed until the longest ends, every step's scores kept). Per sequence: the response up to
        its end-of-sequence token and the log-prob of each token under the temperature-scaled scores."""
        tok, n, device = self.tokenizer, self.cfg.samples_per_prompt, self.engine.info.device
        input_ids, mask = left_padded(prompts, tok.pad_token_id, device)
        width = input_ids.shape[1]
        out = self.model.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=self.cfg.temperature, top_k=0,
            top_p=1.0, max_new_tokens=max_new_tokens, num_return_sequences=n, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id, return_dict_in_generate=True, output_scores=True,
        )
        # What the sampler drew each token from: its scores are the logits after the temperature warper.
        steps = torch.stack(out.scores, dim=1).float().log_softmax(dim=-1)  # [B * n, new tokens, V]
        drawn = steps.gather(-1, out.sequences[:, width:, None]).squeeze(-1)
        responses = [_until_eos(generated[width:], tok.eos_token_id) for generated in out.sequences]
        return responses, [drawn[i, : len(r)] for i, r in enumerate(responses)]


def _score(source: PromptSource, row: dict[str, Any], response: str) -> float:
    """The reward of one response; a reward function that fails says so, with the prompt it failed on."""
    try:
        reward = float(source.reward_fn(row["prompt"], response, row))
    except Exception as exc:  # user code: any exception
        raise ValueError(
            f"rl.reward_fn: raised {type(exc).__name__}: {exc} (prompt {row['prompt']!r}, response {response!r})"
        ) from exc
    if not math.isfinite(reward):
        raise ValueError(f"rl.reward_fn: returned {reward} (prompt {row['prompt']!r}, response {response!r}); "
                         f"a reward must be a finite number")
    return reward


def _until_eos(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The response up to and including its first end-of-sequence token (generate pads after it)."""
    hits = (ids == eos_id).nonzero()
    return ids[: int(hits[0]) + 1] if hits.numel() else ids


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
