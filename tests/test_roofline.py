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
