"""Run on 2 gloo ranks by test_lora_merge.py: LoRA merged on model directories as users bring them (GPT-2's
Conv1D layers, a Llama with tied embeddings and its LM head or embeddings adapted). For each: the rollout
copy refreshed one unit at a time and the merged export against the adapter model itself."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from scenarios import engine_config
from syncwise.engine import Engine
from syncwise.export import export_hf
from syncwise.models import build_model, uninitialised_model

VOCAB = 384

# name -> (architecture, tied embeddings, LoRA targets, strategy)
MERGE_CASES = {
    "gpt2_conv1d_square": ("gpt2", True, "attn.c_proj", "fsdp2"),
    "gpt2_conv1d_nonsquare": ("gpt2", True, "c_attn,mlp.c_fc", "fsdp2"),
    "gpt2_conv1d_nonsquare_fsdp1": ("gpt2", True, "c_attn,mlp.c_fc", "fsdp1"),
    "gpt2_lm_head_tied": ("gpt2", True, "c_attn,lm_head", "fsdp2"),
    "llama_lm_head_tied": ("llama", True, "q_proj,lm_head", "fsdp2"),
    "llama_lm_head_tied_ddp": ("llama", True, "q_proj,lm_head", "ddp"),
    "llama_embedding_tied": ("llama", True, "embed_tokens,q_proj", "fsdp2"),
    "llama_embedding_untied": ("llama", False, "embed_tokens,v_proj", "fsdp2"),
}


def model_dir(root: Path, arch: str, tied: bool) -> Path:
    """A ``save_pretrained`` directory: GPT-2 2 layers / 64 wide (dropout 0), or Llama 2 layers / 64 wide."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    path = root / f"{arch}_{'tied' if tied else 'untied'}"
    if arch == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied)
    else:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=tied)
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _randomised_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """Every adapter tensor drawn at random (peft starts B -- or an embedding's A -- at zero, where any merge
    is right): the same on every rank."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def merge_case(info, root: Path, name: str) -> dict:
    arch, tied, targets, strategy = MERGE_CASES[name]
    path = root / f"{arch}_{'tied' if tied else 'untied'}"
    cfg = engine_config(strategy, "deferred", f"model.path={path}", "model.lora.rank=4", "model.lora.alpha=8",
                        f"model.lora.target_modules={targets}")
    model = _randomised_adapters(build_model(cfg.model))
    reference = _logits(model.eval(), _inputs())  # the peft model itself, before wrapping
    engine = Engine(cfg, model, info)
    copy = uninitialised_model(engine.features.plain_hf_config)
    from syncwise.engine.weights import load_by_unit

    load_by_unit(copy, engine.full_weights_by_unit())
    out = {"refreshed": _logits(copy.eval(), _inputs()), "adapter_model": reference,
           "unties": engine.features.lora_merge.unties}
    export_hf(engine, None, root / f"export_{name}", base_path=str(path))
    if info.rank == 0:
        from peft import AutoPeftModelForCausalLM
        from transformers import AutoModelForCausalLM

        export = root / f"export_{name}"
        out["merged_export"] = _logits(AutoModelForCausalLM.from_pretrained(export).eval(), _inputs())
        out["adapter_export"] = _logits(AutoPeftModelForCausalLM.from_pretrained(export / "adapter").eval(),
                                        _inputs())
    torch.distributed.barrier()
    return out


def _inputs() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(3))


def merge_suite(info) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = [tmp]
        torch.distributed.broadcast_object_list(folder, src=0)  # one folder for every rank
        root = Path(folder[0])
        if info.rank == 0:
            for arch, tied in {(a, t) for a, t, _, _ in MERGE_CASES.values()}:
                model_dir(root, arch, tied)
        torch.distributed.barrier()
        return {name: merge_case(info, root, name) for name in MERGE_CASES}
