"""The bench's roofline figure: the useful-FLOPs formula against torch's own FLOP counter on real Hugging
Face models built from configs (a Llama and GPT-2 with its Conv1D layers), and the GEMM rate it divides by."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from syncwise.jobs.bench.roofline import fraction_of_peak, gemm_rate
from syncwise.models.flops import UsefulFlops, attention_width, matmul_params


def _models():
    llama = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    gpt2 = GPT2Config(vocab_size=320, bos_token_id=0, eos_token_id=0, n_embd=64, n_layer=2, n_head=4,
                      n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return [(LlamaForCausalLM(llama), llama), (GPT2LMHeadModel(gpt2), gpt2)]


@pytest.mark.parametrize("index", [0, 1], ids=["llama", "gpt2"])
def test_useful_flops_are_what_torch_counts_less_the_masked_half_of_attention(index):
    torch.manual_seed(0)
    model, config = _models()[index]
    model.config._attn_implementation = "eager"  # attention as matmuls torch counts (CPU's sdpa kernel: not)
    lengths = [48, 17]
    with FlopCounterMode(display=False) as counter:
        for length in lengths:  # one sequence at a time: no padding, every token real
            ids = torch.randint(0, config.vocab_size, (1, length))
            model(input_ids=ids).logits.float().sum().backward()
    layers, width = attention_width(config)
    # torch counts attention's matmuls over every pair (4·L²·D forward, twice that backward); causal: half useful
    masked_half = 6 * layers * width * sum(n * n for n in lengths)
    assert counter.get_total_flops() == UsefulFlops.of(model, config).of_lengths(lengths) + masked_half
    trainable, frozen = matmul_params(model)
    assert frozen == 0 and trainable > config.vocab_size * 64  # the (tied) LM head is a matmul, counted once


def test_a_mixture_of_experts_counts_the_experts_a_token_uses_and_its_router():
    """A tiny Qwen3-MoE (8 fused experts, top-2; transformers' eager expert loop, which computes exactly the
    routed tokens): torch's count is the formula's with the experts at 2 of 8 and the router's (E, H) weight a
    matmul; the plan's active parameters are the same share."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from syncwise.models.moe import active_parameters

    config = Qwen3MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, experts_implementation="eager")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    lengths = [40, 13]
    with FlopCounterMode(display=False) as counter:
        for length in lengths:
            model(input_ids=torch.randint(0, 320, (1, length))).logits.float().sum().backward()
    layers, width = attention_width(config)
    masked_half = 6 * layers * width * sum(n * n for n in lengths)
    assert counter.get_total_flops() == UsefulFlops.of(model, config).of_lengths(lengths) + masked_half
    experts = 2 * 8 * 3 * 32 * 64  # two layers of 8 experts' gate_up (2I x H) and down (H x I)
    total = sum(p.numel() for p in model.parameters())
    active = active_parameters((tuple(p.shape) for p in model.parameters()), config)
    assert active == total - experts + experts // 8 * 2
    dense = UsefulFlops.of(model, None).per_token  # no config: not a decoder's, nothing counted
    assert dense == 0 and matmul_params(model)[0] == matmul_params(model, config)[0]  # k from the model's config


def test_a_frozen_weight_costs_its_forward_and_its_input_gradient_only():
    model, config = _models()[0]
    full = UsefulFlops.of(model, config).of_lengths([32])
    model.lm_head.weight.requires_grad_(False)  # tied: the embedding is frozen with it
    assert full - UsefulFlops.of(model, config).of_lengths([32]) == 2 * config.vocab_size * 64 * 32


def test_the_gemm_rate_and_the_fraction():
    config = _models()[0][1]
    rate = gemm_rate(config, torch.float32, torch.device("cpu"), repeats=1)
    assert rate > 1e8  # any CPU multiplies faster than 0.1 GFLOP/s
    assert fraction_of_peak(4e9, 2.0, 1e9, 2) == pytest.approx(1.0) and fraction_of_peak(1.0, 0.0, 1e9, 2) == 0.0
