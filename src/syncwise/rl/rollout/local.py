"""The rollout engines on a local, unsharded copy of the policy (``rl.rollout_engine=compact`` or
``generate``): the copy is built uninitialised in ``rl.rollout_dtype`` and refreshed in place from the sharded
model before each step, one wrapping unit at a time. Each call samples with torch's generator seeded by the seed
the call was given (:func:`~syncwise.rl.rollout.base.sample_seed`: job seed, step, rank, turn), the job's own
generator set aside meanwhile: what a rank draws depends on nothing else, so a resumed job, and a rollout rank
drawing for a trainer (``dist.rollout_ranks``), sample alike. Given a seed per sequence (the agent endpoint's
requests), each sequence draws by its own: the compact sampler from a hash of its seed, ``generate`` one call
per sequence."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ...engine.weights import load_by_unit
from ...models import uninitialised_model
from ...models.moe import RouteRecorder
from .base import RolloutSetup, Samples, StopStrings, sequence_seeds
from .compact import Truncation, left_padded, sample, sequence_routes


@contextmanager
def recorded_routes(model: torch.nn.Module, record: bool) -> Iterator[list[torch.Tensor]]:
    """Within it (where ``record``: a mixture of experts under router replay), each forward's chosen experts --
    [tokens, layers, k], the prefill's first, then one a decode step -- as ``generate`` runs them."""
    forwards: list[torch.Tensor] = []
    if not record:
        yield forwards
        return
    recorder = RouteRecorder(model)
    after_forward = model.register_forward_hook(lambda module, inputs, output: forwards.append(recorder.take()))
    try:
        yield forwards
    finally:
        after_forward.remove()
        recorder.close()


def generated_routes(forwards: list[torch.Tensor], prompts: list[list[int]], n: int,
                     responses: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sequence's routes (prompt-major, ``n`` a prompt, as ``generate`` returns them) filed as the compact
    sampler files its own (:func:`~syncwise.rl.rollout.compact.sequence_routes`): ``generate`` prefills every
    sequence's row and feeds every row at each decode step -- step s token s -- so a sequence's routes at step s are
    kept where token s is not its last (a finished sequence is fed padding)."""
    rows, counts = len(responses), [len(response) for response in responses]
    prefill = forwards[0].view(rows, -1, *forwards[0].shape[1:])  # [rows, width, layers, k]
    fed_by = []
    for step, chosen in enumerate(forwards[1:]):
        fed = torch.tensor([count - 1 > step for count in counts], device=chosen.device).nonzero().flatten()
        fed_by.append((fed, chosen[fed]))
    return sequence_routes(prefill, fed_by, [prompts[k // n] for k in range(rows)], 1, counts)


class LocalCopy:
    """The rank's own copy of the policy, refreshed in place; :meth:`sample` is each engine's."""

    name = ""

    def __init__(self, setup: RolloutSetup):
        self.cfg, self.tokenizer, self.end_ids, self.device = setup.rl, setup.tokenizer, setup.end_ids, setup.device
        self.record_routes = setup.record_routes
        self.cut = Truncation(self.cfg.top_k, self.cfg.top_p, self.cfg.min_p)
        self.stop = StopStrings(self.cfg.stop, self.tokenizer)
        # Built uninitialised: the first refresh writes every parameter (load_by_unit checks it).
        self.model = uninitialised_model(setup.hf_config, getattr(torch, self.cfg.rollout_dtype), setup.device)
        self.model.eval().requires_grad_(False)

    def held_bytes(self) -> int:
        """The copy's parameters and buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    def describe(self) -> str:
        return f"rollouts by {self.name} on a {self.cfg.rollout_dtype} copy"

    def refresh(self, weights_by_unit: Iterator[dict[str, torch.Tensor]]) -> None:
        load_by_unit(self.model, weights_by_unit)

    def release(self) -> None:
        """The copy stays (it is refreshed in place)."""

    def sample(self, prompts: list[list[int]], n: int, max_new_tokens: int, seed: int | list[int]) -> Samples:
        raise NotImplementedError

    @contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """Torch's generators seeded with ``seed`` inside, as they were outside."""
        on_cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if on_cuda else []):
            # on CPU the CPU generator alone: torch.manual_seed would also queue a seed for CUDA, formatting a
            # stack trace every call where CUDA is not initialised (~4% of a small job's rollout)
            torch.manual_seed(seed) if on_cuda else torch.default_generator.manual_seed(seed)
            yield


class CompactRollout(LocalCopy):
    """``rl.rollout_engine=compact``: :func:`syncwise.rl.rollout.compact.sample` on the copy."""

    name = "the compact sampler"

    def sample(self, prompts: list[list[int]], n: int, max_new_tokens: int, seed: int | list[int]) -> Samples:
        tensors = [torch.tensor(ids, dtype=torch.long) for ids in prompts]
        if not isinstance(seed, int):
            return sample(self.model, tensors, n, max_new_tokens, self.cfg.temperature, self.end_ids,
                          self.tokenizer.pad_token_id, self.cut, self.stop, sequence_seeds(seed, len(prompts), n),
                          record_routes=self.record_routes)
        with self.seeded(seed):
            return sample(self.model, tensors, n, max_new_tokens, self.cfg.temperature, self.end_ids,
                          self.tokenizer.pad_token_id, self.cut, self.stop, record_routes=self.record_routes)


class GenerateRollout(LocalCopy):
    """``rl.rollout_engine=generate``: Hugging Face ``generate`` on the copy (each prompt prefilled once per
    sample, every sequence computed until the longest ends, every step's scores kept)."""

    name = "Hugging Face generate"

    def sample(self, prompts: list[list[int]], n: int, max_new_tokens: int, seed: int | list[int]) -> Samples:
        """Per sequence: the response up to its first end token or stop string, the log-prob of each token under
        the scores (after the temperature and truncation warpers: the distribution it was drawn from) and under
        the raw logits over the temperature (untruncated), and whether it ended. A seed per sequence: one call
        each, seeded with it."""
        if not isinstance(seed, int):
            alone = [self.sample([prompts[k // n]], 1, max_new_tokens, own)
                     for k, own in enumerate(sequence_seeds(seed, len(prompts), n))]
            return Samples([t for s in alone for t in s.tokens], [t for s in alone for t in s.log_probs],
                           sum(s.computed_rows for s in alone), [e for s in alone for e in s.ended],
                           [t for s in alone for t in s.full_log_probs],
                           [r for s in alone for r in s.routes] if self.record_routes else None)
        tok, cut = self.tokenizer, self.cut
        input_ids, mask = left_padded([torch.tensor(ids, dtype=torch.long) for ids in prompts], tok.pad_token_id,
                                      self.device)
        width = input_ids.shape[1]
        with self.seeded(seed), recorded_routes(self.model, self.record_routes) as forwards:
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
        return Samples(responses, [drawn[i, : len(r)] for i, r in enumerate(responses)],
                       computed_rows=len(responses) * (out.sequences.shape[1] - width),
                       ended=[e for _, e in cut_at],
                       full_log_probs=[full[i, : len(r)] for i, r in enumerate(responses)],
                       routes=generated_routes(forwards, prompts, n, responses) if self.record_routes else None)

    def _end_of(self, ids: torch.Tensor) -> tuple[int, bool]:
        """(length, ended): up to and including the first end token or the token completing a stop string."""
        hits = torch.isin(ids, torch.tensor(self.end_ids, device=ids.device)).nonzero()
        length = int(hits[0]) + 1 if hits.numel() else len(ids)
        if self.stop:
            for i in range(length):
                if self.stop.hit(ids[: i + 1].tolist()):
                    return i + 1, True
        return length, bool(hits.numel())
