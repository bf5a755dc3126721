"""Log-probs and entropy a chunk of positions at a time: the same values and gradients as the plain
computation, at any temperature, and memory that does not grow with length x vocabulary beyond a chunk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from syncwise.losses import logprob_chunking, token_entropy, token_log_probs, token_log_probs_and_entropy


def _reference(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [0, 7, 64, 10_000])
def test_chunked_values_and_gradients_equal_the_plain_ones(temperature, chunk):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, 37, generator=gen, dtype=torch.float64).requires_grad_()
    ids = torch.randint(0, 37, (3, 50), generator=gen)
    weights = torch.randn(3, 49, generator=gen, dtype=torch.float64)
    ref_lp, ref_ent = _reference(logits, ids, temperature)
    ref_lp_grads = torch.autograd.grad((ref_lp * weights).sum(), logits, retain_graph=True)[0]
    ref_grads = torch.autograd.grad(((ref_lp + ref_ent) * weights).sum(), logits)[0]
    with logprob_chunking(chunk):
        lp, ent = token_log_probs_and_entropy(logits, ids, temperature)
        alone = token_log_probs(logits, ids, temperature), token_entropy(logits, temperature)
    grads = torch.autograd.grad(((lp + ent) * weights).sum(), logits)[0]
    assert torch.allclose(lp, ref_lp, atol=1e-10) and torch.allclose(ent, ref_ent, atol=1e-10)
    assert torch.equal(alone[0], lp) and torch.equal(alone[1], ent)
    assert torch.allclose(grads, ref_grads, atol=1e-10)
    lp_grads = torch.autograd.grad((alone[0] * weights).sum(), logits)[0]
    assert torch.allclose(lp_grads, ref_lp_grads, atol=1e-10)
    assert F.cross_entropy(logits[0, :-1] / temperature, ids[0, 1:]).item() == pytest.approx(-lp[0].mean().item())


def _extra_peak(positions: int, vocab: int, chunk: int) -> int:
    """Peak memory of log-probs + entropy, forward and backward, beyond the logits and their gradient."""
    logits = torch.randn(1, positions, vocab).requires_grad_()
    ids = torch.randint(0, vocab, (1, positions))
    tracker = MemTracker()
    tracker.track_external(logits)
    with tracker, logprob_chunking(chunk):
        log_probs, entropy = token_log_probs_and_entropy(logits, ids)
        (log_probs.sum() + entropy.sum()).backward()
    peak = max(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
    return peak - 2 * logits.numel() * logits.element_size()


def test_memory_does_not_grow_with_length_times_vocabulary_beyond_one_chunk():
    chunk = 128
    for vocab in (1000, 4000):
        one_chunk = chunk * vocab * 4
        short, long = _extra_peak(512, vocab, chunk), _extra_peak(4096, vocab, chunk)
        assert short <= 6 * one_chunk and long <= 6 * one_chunk, (vocab, short, long)
        assert long - short < one_chunk  # 8x the positions, not even one more chunk
        assert _extra_peak(4096, vocab, 0) > 4096 * vocab * 4  # unchunked: the whole fp32 log-softmax
