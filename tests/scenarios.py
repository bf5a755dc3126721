"""Functions run on every rank of a real process group by the multi-process tests."""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from syncwise.comm import count_collectives
from syncwise.config import load_config
from syncwise.engine import Engine
from syncwise.losses import sft_loss
from syncwise.models import build_model

VOCAB = 512  # the qwen2-test / llama-test presets


def make_batch(seed: int, size: int = 6, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Padded batch with ragged lengths and a loss mask that skips each prompt's first tokens."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (size, seq_len), generator=gen)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (size,), generator=gen)
    attention_mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    return {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask, "loss_mask": loss_mask}


def engine_config(strategy: str, mode: str, *extra: str):
    return load_config(
        None,
        [
            f"engine.strategy={strategy}",
            f"sync.mode={mode}",
            "model.preset=qwen2-test",
            "engine.micro_batch_size=2",
            "optim.name=sgd",
            "optim.lr=0.5",
            "optim.grad_clip=0",
            *extra,
        ],
    )


def add_unused_parameter(model: nn.Module) -> nn.Module:
    """A projection no forward ever calls: its parameters never get a gradient."""
    layer = model.model.layers[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)  # same weights on every rank and in every run
        layer.unused_proj = nn.Linear(model.config.hidden_size, 8)
    return model


_WRAPPER_PREFIX = re.compile(r"(_fsdp_wrapped_module\.|module\.|_checkpoint_wrapped_module\.)")


def _clean(name: str) -> str:
    return _WRAPPER_PREFIX.sub("", name)


def full_grads(engine: Engine) -> dict[str, torch.Tensor]:
    """Unsharded gradient of every parameter (zeros where none), keyed by the plain HF name."""
    model = engine.model
    if engine.wrapped.strategy == "fsdp1":
        with FSDP1.summon_full_params(model, with_grads=True):
            return {_clean(n): _grad_or_zeros(p) for n, p in model.named_parameters()}
    out = {}
    for name, param in model.named_parameters():
        grad = _grad_or_zeros(param)
        out[_clean(name)] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return out


def full_params(engine: Engine) -> dict[str, torch.Tensor]:
    model = engine.model
    if engine.wrapped.strategy == "fsdp1":
        with FSDP1.summon_full_params(model):
            return {_clean(n): p.detach().clone() for n, p in model.named_parameters()}
    return {
        _clean(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    if param.grad is not None:
        return param.grad.detach().clone()
    return torch.zeros_like(param).detach()


def one_step(info, strategy: str, mode: str, *extra: str, unused: bool = False) -> dict:
    """Accumulate over 3 micro-batches, record grads and collectives, take an SGD step, record params."""
    cfg = engine_config(strategy, mode, *extra)
    model = build_model(cfg.model)
    if unused:
        add_unused_parameter(model)
    engine = Engine(cfg, model, info)
    batch = make_batch(seed=100 + info.rank)
    with count_collectives() as counts:
        result = engine.forward_backward_batch(batch, sft_loss)
    grads = full_grads(engine)
    with count_collectives() as step_counts:
        grad_norm = engine.optimizer_step()
    return {
        "grads": grads,
        "params": full_params(engine),
        "counts": dict(counts.counts),
        "bytes": dict(counts.bytes),
        "step_counts": dict(step_counts.counts),
        "num_units": engine.wrapped.num_units,
        "num_microbatches": result.num_microbatches,
        "grad_norm": grad_norm,
        "loss": result.metrics["loss"],
    }


EQUIVALENCE_CASES = {
    "fsdp2": ("fsdp2", ()),
    "fsdp2_bf16": ("fsdp2", ("model.param_dtype=bfloat16", "model.reduce_dtype=float32")),
    "fsdp2_unused": ("fsdp2", ()),
    "fsdp2_bf16_unused": ("fsdp2", ("model.param_dtype=bfloat16", "model.reduce_dtype=float32")),
    "fsdp1": ("fsdp1", ()),
    "fsdp1_unused": ("fsdp1", ()),
    "ddp": ("ddp", ()),
    "ddp_unused": ("ddp", ("engine.find_unused_parameters=true",)),
}


def equivalence_suite(info, cases: list[str]) -> dict:
    """Every case in both modes, in one process group."""
    out = {}
    for case in cases:
        strategy, extra = EQUIVALENCE_CASES[case]
        for mode in ("per_microbatch", "deferred"):
            out[(case, mode)] = one_step(info, strategy, mode, *extra, unused=case.endswith("_unused"))
    return out
