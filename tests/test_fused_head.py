"""The fused LM head (``engine.fused_lm_head``): log-probs, entropy and their gradients from the hidden
states a chunk at a time equal those of materialised logits -- alone (fp64, every chunk size) and in the
engine on 2 gloo ranks (FSDP2 / FSDP1 / DDP, packed and padded, tied embeddings, bf16, checkpointed) --
with the same collectives; and the step's measured peak drops by the logits and their gradient."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from dist_harness import run_distributed
from numerics import FP32_RTOL, assert_all_close, assert_close
from scenarios_head import HEAD_CASES, head_suite, kinds_of
from syncwise.config import load_config
from syncwise.losses import (
    LogitsFromHidden,
    logprob_chunking,
    sft_loss,
    token_entropy,
    token_log_probs,
    token_log_probs_and_entropy,
    token_log_probs_and_predictions,
)
from syncwise.memory.activations import estimate_activations
from syncwise.models import build_model, preset_config
from syncwise.models.head import fused_head_unsupported

CASES = list(HEAD_CASES)
CASE_KINDS = [(case, kind) for case in CASES for kind in kinds_of(case)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [0, 7, 64, 10_000])
def test_values_and_gradients_equal_those_of_materialised_logits(bias, temperature, chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 41, 16, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(37, 16, generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(37, generator=gen, dtype=torch.float64).requires_grad_() if bias else None
    ids = torch.randint(0, 37, (3, 41), generator=gen)
    g_lp, g_ent = torch.randn(2, 3, 40, generator=gen, dtype=torch.float64)
    inputs = [t for t in (hidden, weight, b) if t is not None]
    logits = F.linear(hidden, weight, b)
    ref_lp, ref_ent = token_log_probs_and_entropy(logits, ids, temperature)
    ref = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), inputs, retain_graph=True)
    fused = LogitsFromHidden(hidden, weight, b)
    with logprob_chunking(chunk):
        lp, ent = token_log_probs_and_entropy(fused, ids, temperature)
        got = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), inputs)
        alone = torch.autograd.grad((token_log_probs(fused, ids, temperature) * g_lp).sum(), inputs)
        ent_alone = token_entropy(fused, temperature)
        _, predictions = token_log_probs_and_predictions(fused, ids)
    ref_alone = torch.autograd.grad((token_log_probs(logits, ids, temperature) * g_lp).sum(), inputs)
    assert_close(lp.detach(), ref_lp.detach(), 1e-12, "log-probs")
    assert_close(ent.detach(), ref_ent.detach(), 1e-12, "entropy")
    assert_close(ent_alone.detach(), ref_ent.detach(), 1e-12, "entropy alone")
    for name, a, r in zip(("hidden", "weight", "bias"), got, ref, strict=False):
        assert_close(a, r, 1e-12, f"grad {name} (log-probs + entropy)")
    for name, a, r in zip(("hidden", "weight", "bias"), alone, ref_alone, strict=False):
        assert_close(a, r, 1e-12, f"grad {name} (log-probs)")
    assert torch.equal(predictions, logits[:, :-1].argmax(-1))
    assert fused.shape == logits.shape


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_a_frozen_output_layer_gives_the_hidden_states_the_same_gradient(entropy, temperature):
    """LoRA's case: no gradient for the layer, so no logits are made in backward; the hidden states' gradient
    from forward's expectations equals the materialised path's."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 23, 12, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(29, 12, generator=gen, dtype=torch.float64)
    bias = torch.randn(29, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 29, (2, 23), generator=gen)
    g_lp, g_ent = torch.randn(2, 2, 22, generator=gen, dtype=torch.float64)

    def objective(logits):
        if entropy:
            lp, ent = token_log_probs_and_entropy(logits, ids, temperature)
            return (lp * g_lp + ent * g_ent).sum()
        return (token_log_probs(logits, ids, temperature) * g_lp).sum()

    (ref,) = torch.autograd.grad(objective(F.linear(hidden, weight, bias)), [hidden])
    with logprob_chunking(5):
        (got,) = torch.autograd.grad(objective(LogitsFromHidden(hidden, weight, bias)), [hidden])
    assert_close(got, ref, 1e-12, "hidden-state gradient")
    assert float(got[:, -1].abs().max()) == 0.0


@pytest.fixture(scope="module")
def results():
    return run_distributed(head_suite, 2, CASES)[0]


@pytest.mark.parametrize(("case", "kind"), CASE_KINDS)
@pytest.mark.parametrize("packing", ["true", "false"])
def test_engine_gradients_and_collectives_equal_with_and_without_the_fused_head(results, case, kind, packing):
    on, off = results[(case, kind, packing, "true")], results[(case, kind, packing, "false")]
    assert on["fused"] and not off["fused"], case
    assert on["microbatches"] >= 3  # several micro-batches (rank 1 runs empty ones): accumulation is exercised
    rtol = 2e-2 if case.endswith("bf16") else FP32_RTOL  # bf16: the head's sums are rounded per chunk
    assert_all_close(on["grads"], off["grads"], rtol, f"{case} {kind} packing={packing}")
    assert_close(on["log_probs"], off["log_probs"], 1e-3 if case.endswith("bf16") else FP32_RTOL, "log_probs")
    for key, value in off["metrics"].items():
        assert on["metrics"][key] == pytest.approx(value, rel=2e-2 if case.endswith("bf16") else 1e-4, abs=1e-6), key
    assert on["counts"] == off["counts"]  # no collective more or less: the formula and the audit still hold
    assert on["tied"] == (case == "fsdp2_tied")


def _measured_peak(fused: bool, vocab: int, tokens: int, chunk: int) -> int:
    from syncwise.engine import Engine

    cfg = load_config(None, ["engine.strategy=none", "model.preset=qwen2-test", "sync.mode=per_microbatch",
                             "engine.micro_batch_size=2", "sync.peak_every=1", f"engine.fused_lm_head={fused}",
                             f"engine.logprob_chunk_size={chunk}", "engine.packing=false"])
    engine = Engine(cfg, build_model(cfg.model, vocab_size=vocab))
    ids = torch.randint(1, vocab, (4, tokens // 2), generator=torch.Generator().manual_seed(0))
    engine.train_batch({"input_ids": ids}, sft_loss)
    metrics = engine.train_batch({"input_ids": ids}, sft_loss)  # AdamW's state exists by now
    assert metrics["memory/peak_measured"] == 1 and engine.features.fused_head == fused
    return int(metrics["memory/peak_bytes"])


def test_the_steps_peak_drops_by_the_logits_and_their_gradient():
    """qwen2-test (hidden 128) with a 8192-word vocabulary, micro-batches of 2 x 512 tokens, chunks of 128:
    the materialised path keeps the logits (fp32) and makes their gradient; the fused one neither, and has
    one chunk of logits, the hidden states and the output layer's gradient instead -- the drop the estimate predicts,
    measured by the engine's tracker."""
    vocab, tokens, chunk = 8192, 1024, 128
    config = preset_config("qwen2-test", vocab_size=vocab)
    logits_and_grad = 2 * tokens * vocab * 4
    # one chunk of logits, the output layer's gradient, the kept copy of the hidden states and its gradient
    in_flight = chunk * vocab * 4 + vocab * config.hidden_size * 4 + 2 * tokens * config.hidden_size * 4
    estimate = {fused: estimate_activations(config, tokens // 2, 2, dtype="float32", logprob_chunk=chunk,
                                            fused_head=fused) for fused in (False, True)}
    predicted_drop = estimate[False].peak_bytes - estimate[True].peak_bytes
    assert predicted_drop == logits_and_grad - in_flight
    drop = _measured_peak(False, vocab, tokens, chunk) - _measured_peak(True, vocab, tokens, chunk)
    assert drop >= 0.95 * predicted_drop, (drop, predicted_drop, logits_and_grad)


def test_where_the_model_does_not_allow_it():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=30.0))
    assert "soft-capping" in fused_head_unsupported(gemma)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = build_model(load_config(None, ["model.preset=qwen2-test", "model.lora.rank=4",
                                              "model.lora.target_modules=q_proj,lm_head"]).model)
    assert fused_head_unsupported(lora) == (
        "a LoRA adapter sits on the output layer (model.lora.target_modules names it)")
    assert fused_head_unsupported(build_model(load_config(None, ["model.preset=qwen2-test"]).model)) is None


def test_an_installed_model_still_copies_and_gives_logits_outside_the_engine():
    import copy

    from syncwise.models.head import hidden_states_out, install

    model = build_model(load_config(None, ["model.preset=qwen2-test"]).model)
    ids = torch.randint(1, 500, (1, 6))
    before = model(input_ids=ids).logits
    install(model)
    twin = copy.deepcopy(model)
    assert torch.equal(twin(input_ids=ids).logits, before) and torch.equal(model(input_ids=ids).logits, before)
    with hidden_states_out() as call:
        hidden = model(input_ids=ids).logits
    assert call.weight is model.lm_head.weight and hidden.shape == (1, 6, model.config.hidden_size)
    assert model.state_dict().keys() == twin.state_dict().keys() and "lm_head.weight" in model.state_dict()
