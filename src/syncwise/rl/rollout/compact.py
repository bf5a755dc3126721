"""The compact sampler's kernel (``rl.rollout_engine=compact``): each prompt prefilled once, finished sequences
dropped from the batch, and the drawn token's log-prob kept instead of every step's scores.

Hugging Face ``generate(num_return_sequences=n)`` expands the prompts before the prefill (each prompt is
computed n times), keeps computing every sequence until the longest ends, and with ``output_scores`` keeps
a [sequences, vocabulary] tensor per step -- on long-tailed RL responses most of the batch's compute is
spent on sequences that have already ended, and the kept scores outgrow the KV cache (``syncwise plan``).
Here the prompts' KV cache is computed once and repeated for their samples; whenever an eighth of the
active sequences has ended, the cache and the batch are compacted to the ones still running. The
distribution is the one ``generate`` samples from: softmax(logits / temperature), truncated by top-k, then
top-p, then min-p (:func:`truncated_log_probs`, as transformers' warpers in that order) and renormalised.
Each drawn token's log-prob is kept twice: of that distribution, and of the untruncated softmax(logits /
temperature) -- the one the trainer computes, so the two copies of the policy are compared on the same
distribution (with truncation the first differs from it by log of the kept mass, which is no policy change:
TRL #6789). A sequence ends at any of its end tokens, or once its
text contains a stop string (the string kept, as vLLM's ``include_stop_str_in_output``). The prefill keeps
only each prompt's last position's logits (``logits_to_keep=1``, as ``generate`` does): the rest would be
[prompts, prompt length, vocabulary] for nothing. Given each sequence's own seed, a token is drawn by inverting
its distribution's CDF at a uniform that is a hash of (the seed, the step) (:func:`seeded_uniforms`): what a
sequence draws then depends on nothing else in the batch, where torch's generator serves the whole batch in turn.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from ...engine.step import positions_of
from ...models.moe import RouteRecorder
from .base import Samples, StopStrings

COMPACT_FRACTION = 8  # compact when at least 1/8 of the active sequences have ended
MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser (Steele, Lea, Flood 2014): a well-mixed 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def seeded_uniforms(seeds: list[int], step: int, device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per seed, a function of (seed, step) alone: 53 bits of a hash, in float64."""
    values = [(_splitmix64(_splitmix64(seed & MASK64) ^ step) >> 11) * 2.0**-53 for seed in seeds]
    return torch.tensor(values, dtype=torch.float64, device=device)


def draw_by_cdf(log_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token where its CDF (float64) first exceeds the row's uniform: a draw from exp(log_p) that
    depends on the row alone (zero-probability tokens are never drawn)."""
    cdf = log_p.double().exp().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=log_p.shape[-1] - 1)


@dataclass(frozen=True)
class Truncation:
    """rl.top_k / rl.top_p / rl.min_p (0 / 1.0 / 0: off)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def truncated_log_probs(log_p: torch.Tensor, cut: Truncation) -> torch.Tensor:
    """[rows, vocab] log-probs of the distribution sampled from: top-k, then top-p (the smallest set of most
    likely tokens whose mass reaches p), then min-p (tokens at least min_p times the most likely one's
    probability), renormalised. The most likely token always stays."""
    if not cut.active:
        return log_p
    if cut.top_k > 0 and cut.top_k < log_p.shape[-1]:
        kth = log_p.topk(cut.top_k, dim=-1).values[:, -1:]
        log_p = log_p.masked_fill(log_p < kth, float("-inf"))
    if cut.top_p < 1.0:
        ordered, order = log_p.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        beyond = probs.cumsum(dim=-1) - probs >= cut.top_p  # in sorted order: the mass before reaches p
        drop = torch.zeros_like(beyond).scatter(-1, order, beyond)
        log_p = log_p.masked_fill(drop, float("-inf"))
    if cut.min_p > 0.0:
        floor = log_p.max(dim=-1, keepdim=True).values + math.log(cut.min_p)
        log_p = log_p.masked_fill(log_p < floor, float("-inf"))
    return log_p.log_softmax(dim=-1)


def left_padded(prompts: list[torch.Tensor], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the prompts left-padded: every prompt's last token in the last column,
    where generation continues. Both samplers start here, so an empty prompt stops here with its index."""
    if not prompts or any(len(p) == 0 for p in prompts):
        empty = [i for i, p in enumerate(prompts) if len(p) == 0]
        raise ValueError(f"sampling: prompt(s) {empty[:5]} have no tokens; a response needs a prompt to follow"
                         if prompts else "sampling: no prompts")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(input_ids)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = prompt.to(device)
        mask[i, width - len(prompt):] = 1
    return input_ids, mask


@torch.no_grad()
def sample(
    model: nn.Module, prompts: list[torch.Tensor], samples_per_prompt: int, max_new_tokens: int, temperature: float,
    end_ids: int | list[int], pad_id: int, cut: Truncation = Truncation(), stop: StopStrings | None = None,
    seeds: list[int] | None = None, record_routes: bool = False,
) -> Samples:
    """``samples_per_prompt`` responses to each prompt (1-D token tensors), drawn from softmax(logits /
    ``temperature``) truncated by ``cut``, with torch's global generator -- or, given ``seeds`` (one per
    sequence, prompt-major), each sequence by its own (:func:`seeded_uniforms`); a response ends at any of
    ``end_ids`` or once it contains a ``stop`` string. ``record_routes`` (a mixture of experts): each sequence's
    experts per token and layer as its forwards chose them (``Samples.routes``; the last token, never fed: -1)."""
    recorder = RouteRecorder(model) if record_routes else None
    try:
        samples = _sample(model, prompts, samples_per_prompt, max_new_tokens, temperature, end_ids, pad_id, cut, stop,
                          seeds, recorder)
    finally:
        if recorder is not None:
            recorder.close()
    return samples


def _sample(model: nn.Module, prompts: list[torch.Tensor], samples_per_prompt: int, max_new_tokens: int,
            temperature: float, end_ids: int | list[int], pad_id: int, cut: Truncation, stop: StopStrings | None,
            seeds: list[int] | None, recorder: RouteRecorder | None) -> Samples:
    device = next(model.parameters()).device
    input_ids, mask = left_padded(prompts, pad_id, device)
    positions = positions_of(mask)
    cache = DynamicCache(config=model.config)
    accepted = inspect.signature(model.forward).parameters
    # transformers >= 5.24 names the argument ``cache`` (``past_key_values`` is deprecated); older ones do not.
    cache_arg = "cache" if "cache" in accepted else "past_key_values"
    # The prefill needs only the last position's logits: [prompts, vocab], not [prompts, prompt length, vocab].
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   **{cache_arg: cache}, **last_only).logits[:, -1]
    prompt_routes = recorder.take().view(*input_ids.shape, -1, recorder.top_k) if recorder is not None else None
    step_routes: list[tuple[torch.Tensor, torch.Tensor]] = []  # per decode forward: (sequences, their routes)
    # Each prompt's samples share its prefill.
    n = samples_per_prompt
    cache.batch_repeat_interleave(n)
    logits, mask = logits.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
    next_position = positions[:, -1].repeat_interleave(n) + 1
    total = len(prompts) * n
    ends = torch.tensor([end_ids] if isinstance(end_ids, int) else list(end_ids), device=device)
    texts: list[list[int]] = [[] for _ in range(total)]  # each sequence's tokens so far (stop strings only)
    stopped = torch.zeros(total, dtype=torch.bool, device=device)  # ended by an end token or a stop string
    rows = torch.arange(total, device=device)  # the sequence each batch row is
    running = torch.ones_like(rows, dtype=torch.bool)  # rows whose sequence has not ended
    drawn_rows, drawn_tokens, drawn_log_probs, drawn_full = [], [], [], []  # per step, for the rows still running
    computed = 0
    for step in range(max_new_tokens):
        full = (logits.float() / temperature).log_softmax(dim=-1)
        log_p = truncated_log_probs(full, cut)
        if seeds is None:
            drawn = torch.multinomial(log_p.exp(), 1).squeeze(1)
        else:
            drawn = draw_by_cdf(log_p, seeded_uniforms([seeds[r] for r in rows.tolist()], step, device))
        live = running.nonzero().squeeze(1)
        drawn_rows.append(rows[live])
        drawn_tokens.append(drawn[live])
        drawn_log_probs.append(log_p[live].gather(1, drawn[live, None]).squeeze(1))
        if cut.active:
            drawn_full.append(full[live].gather(1, drawn[live, None]).squeeze(1))
        finished = torch.isin(drawn, ends)
        if stop:
            for r in live.tolist():
                sequence = int(rows[r])
                texts[sequence].append(int(drawn[r]))
                finished[r] |= stop.hit(texts[sequence])
        stopped[rows[finished & running]] = True
        running &= ~finished
        active = int(running.sum())
        if active == 0 or step == max_new_tokens - 1:
            break
        if len(rows) - active >= max(1, len(rows) // COMPACT_FRACTION):
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, running, drawn, mask, next_position = (t[keep] for t in (rows, running, drawn, mask, next_position))
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        computed += len(rows)
        logits = model(input_ids=drawn[:, None], attention_mask=mask, position_ids=next_position[:, None],
                       use_cache=True, **{cache_arg: cache}).logits[:, -1]
        if recorder is not None:  # the routes of the tokens drawn at this step
            step_routes.append((rows.clone(), recorder.take()))
        next_position = next_position + 1
    # Each sequence's tokens in step order: a stable sort by sequence keeps the steps' order.
    sequence = torch.cat(drawn_rows)
    order = torch.sort(sequence, stable=True).indices
    counts = torch.bincount(sequence, minlength=total).tolist()
    log_probs = list(torch.cat(drawn_log_probs)[order].split(counts))
    full_log_probs = list(torch.cat(drawn_full)[order].split(counts)) if cut.active else log_probs
    routes = sequence_routes(prompt_routes, step_routes, prompts, n, counts) if recorder is not None else None
    return Samples(list(torch.cat(drawn_tokens)[order].split(counts)), log_probs, computed, stopped.tolist(),
                   full_log_probs, routes)


def sequence_routes(prompt_routes: torch.Tensor, step_routes: list[tuple[torch.Tensor, torch.Tensor]],
                    prompts: list, n: int, counts: list[int]) -> list[torch.Tensor]:
    """Each sequence's routes (prompt-major, ``n`` a prompt): its prompt's from the prefill's left-padded rows (one
    a prompt), then each drawn token's from the decode step that fed it (``step_routes``: the sequences it ran and
    their routes); -1 for a token no forward was given (the last). ``generate``'s too
    (:func:`syncwise.rl.rollout.local.generated_routes`)."""
    drawn = torch.full((len(counts), max(counts), *prompt_routes.shape[2:]), -1, dtype=prompt_routes.dtype,
                       device=prompt_routes.device)
    for step, (sequences, chosen) in enumerate(step_routes):
        drawn[sequences, step] = chosen
    return [torch.cat([prompt_routes[k // n, -len(prompts[k // n]):], drawn[k, :count]]).cpu()
            for k, count in enumerate(counts)]
