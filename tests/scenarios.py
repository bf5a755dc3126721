"""Functions run on every rank of a real process group by the multi-process tests."""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from syncwise.config import load_config
from syncwise.engine import Engine
from syncwise.losses import sft_loss
from syncwise.models import build_model
from syncwise.sync.counting import count_collectives

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
            "engine.fused_lm_head=true",  # auto chooses the sync mode alone here (test_auto_tuning: all three)
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
    num_params = sum(p.numel() for p in model.parameters())
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
        "retained_grad_bytes": result.retained_grad_bytes,
        "num_params": num_params,
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


def _build_from_config(cfg) -> nn.Module:
    return build_model(cfg.model)


def full_batch_reference(
    world_size: int, *extra: str, build=_build_from_config, seed: int = 100
) -> dict[str, torch.Tensor]:
    """Gradients of the token-mean loss over every rank's batch (``make_batch(seed + rank)``) at once, in one
    plain process (no FSDP), of the model ``build(cfg)`` makes; frozen parameters have none."""
    cfg = engine_config("none", "deferred", "engine.micro_batch_size=1000", *extra)
    model = build(cfg)
    batches = [make_batch(seed=seed + r) for r in range(world_size)]
    batch = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    from syncwise.losses import Normalizer, target_mask

    mask = target_mask(batch)
    norm = Normalizer(tokens=float(mask.sum()), sequences=float((mask.sum(1) > 0).sum()), dp_size=1)
    sft_loss(out, batch, norm).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def equivalence_suite_with_reference(info, cases: list[str]) -> dict:
    out = equivalence_suite(info, cases)
    if info.rank == 0:
        out["reference"] = full_batch_reference(info.world_size)
    return out


def _sync_flags_all_on(engine: Engine) -> bool:
    from syncwise.sync.fsdp_internals import fsdp2_units
    from syncwise.sync.fsdp_internals import sync_flags as fsdp2_sync_flags

    return all(flags == (True, True) for u in fsdp2_units(engine.model) for flags in fsdp2_sync_flags(u))


def _fails_on_call(n: int):
    calls = {"n": 0}

    def loss_fn(outputs, micro_batch, norm):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError(f"injected failure in micro-batch {n}")
        return sft_loss(outputs, micro_batch, norm)

    return loss_fn


def recovery_case(info, strategy: str, mode: str) -> dict:
    """An exception in micro-batch 2 of 3, then a normal step, vs a run that never failed."""
    out = {}
    runs = {}
    for label in ("faulty", "clean"):
        cfg = engine_config(strategy, mode, "optim.name=adamw", "optim.lr=0.01", "optim.grad_clip=1.0")
        engine = Engine(cfg, build_model(cfg.model), info)
        engine.train_batch(make_batch(seed=10 + info.rank), sft_loss)
        if label == "faulty":
            try:
                engine.train_batch(make_batch(seed=20 + info.rank), _fails_on_call(2))
            except RuntimeError as exc:
                out["error"] = str(exc)
            out["flags_restored"] = _sync_flags_all_on(engine)
            out["grads_after_error"] = sum(p.grad is not None for p in engine.model.parameters())
        metrics = engine.train_batch(make_batch(seed=30 + info.rank), sft_loss)
        runs[label] = (full_params(engine), metrics)
    out["faulty_params"], out["faulty_metrics"] = runs["faulty"]
    out["clean_params"], out["clean_metrics"] = runs["clean"]
    return out


def _described_once(info) -> dict:
    """Issue 77 (left from earlier): how often an Engine's set-up (FSDP2, activation checkpointing, a train step
    that calibrates auto's memory model) searches the model for its decoder layer classes and counts its FLOPs --
    every module that asks, counted."""
    from unittest import mock

    import syncwise.engine.features as features
    import syncwise.engine.wrap as wrap
    import syncwise.models as models
    import syncwise.models.flops as flops

    calls = {"layer_classes": 0, "matmul_params": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    layer_classes = counted("layer_classes", models.decoder_layer_classes)
    with mock.patch.object(models, "decoder_layer_classes", layer_classes), \
            mock.patch.object(features, "decoder_layer_classes", layer_classes), \
            mock.patch.object(wrap, "decoder_layer_classes", layer_classes), \
            mock.patch.object(flops, "matmul_params", counted("matmul_params", flops.matmul_params)):
        cfg = engine_config("fsdp2", "auto", "engine.activation_checkpointing=true")
        engine = Engine(cfg, build_model(cfg.model), info)
        engine.train_batch(make_batch(seed=70 + info.rank), sft_loss)
    return {**calls, "flops": engine.flops.per_token}


def engine_suite(info) -> dict:
    """train_batch metrics, recovery after an exception, forward-only passes, bad input, state dicts."""
    from syncwise.data.batching import BatchError

    out: dict = {}
    for strategy in ("fsdp2", "fsdp1"):
        for mode in ("per_microbatch", "deferred"):
            cfg = engine_config(strategy, mode)
            engine = Engine(cfg, build_model(cfg.model), info)
            out[("metrics", strategy, mode)] = engine.train_batch(make_batch(seed=info.rank), sft_loss)
    for strategy in ("fsdp2", "fsdp1", "ddp"):
        out[("recovery", strategy)] = recovery_case(info, strategy, "deferred")

    # Forward-only: log-probs in sample order, no gradient, no reduce-scatter, sync flags untouched.
    cfg = engine_config("fsdp2", "deferred")
    engine = Engine(cfg, build_model(cfg.model), info)
    batch = make_batch(seed=40 + info.rank, size=5)
    with count_collectives() as counts:
        result = engine.eval_batch(batch, sft_loss)
    reference_model = build_model(cfg.model)
    with torch.no_grad():
        logits = reference_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    from syncwise.losses import token_log_probs

    out["forward_only"] = {
        "log_probs": result.outputs["log_probs"],
        "reference": token_log_probs(logits, batch["input_ids"]),
        "target_mask": batch["attention_mask"][:, 1:],
        "counts": dict(counts.counts),
        "grads": sum(p.grad is not None for p in engine.model.parameters()),
        "flags_on": _sync_flags_all_on(engine),
        "loss": result.metrics["loss"],
    }

    # Bad input on rank 1 only: every rank raises, none hangs, and the engine still trains afterwards.
    good = make_batch(seed=50 + info.rank)
    bad = {k: v for k, v in good.items() if k != "input_ids"} if info.rank == 1 else good
    try:
        engine.train_batch(bad, sft_loss)
        out["bad_input_error"] = None
    except BatchError as exc:
        out["bad_input_error"] = str(exc)
    # Keys a loss reads: missing on rank 1, laid out per token instead of per target on rank 0 -- a BatchError
    # on every rank before any collective, not a KeyError on one rank and a broken connection on the other.
    from syncwise.rl.algorithm.losses import make_policy_loss

    rl_batch = {**good, "advantages": torch.ones(good["input_ids"].shape[0])}
    for case, bad in (("missing_key", {k: v for k, v in rl_batch.items() if k != "advantages"}),
                      ("wrong_layout", {**rl_batch, "old_log_probs": torch.zeros(good["input_ids"].shape)})):
        rank_with_it = 1 if case == "missing_key" else 0
        try:
            engine.train_batch(bad if info.rank == rank_with_it else rl_batch, make_policy_loss())
            out[case] = None
        except BatchError as exc:
            out[case] = str(exc)
    uneven = make_batch(seed=60, size=6 if info.rank == 0 else 2)
    out["uneven"] = engine.train_batch(uneven, sft_loss)  # rank 1 runs 3 micro-batches, one empty
    out["after_errors"] = engine.train_batch(good, sft_loss)

    out["described"] = _described_once(info)

    # State dict round trip into a fresh engine.
    other = Engine(cfg, build_model(cfg.model), info)
    other.load_state_dict(engine.state_dict())
    other.load_engine_state(engine.engine_state())
    out["state_dict_equal"] = all(
        torch.equal(a, b) for a, b in zip(full_params(engine).values(), full_params(other).values(), strict=True)
    )
    out["state_dict_step"] = (engine.step, other.step)
    return out
