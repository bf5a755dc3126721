"""Reliability scenarios on real gloo ranks: budgets that differ per rank, failing forward-only passes,
frozen units, forward-only collectives and the root resharded after them, DDP counted once."""

from __future__ import annotations

import torch

from scenarios import engine_config, full_grads, full_params, make_batch
from syncwise.data.batching import BatchError
from syncwise.engine import Engine
from syncwise.losses import sft_loss
from syncwise.memory.accounting import unsharded_param_bytes
from syncwise.memory.schedule import FORWARD_ALL_REDUCES, forward_traffic, uniform_units
from syncwise.models import build_model
from syncwise.sync.counting import count_collectives

TIGHT_BUDGET = int(5.3 * 2**20)  # bytes


def budgets_differ(info) -> list[dict]:
    """Rank 0 has memory to spare, rank 1 just what the job holds before a micro-batch (5.20 MiB) and ~100 KiB
    more, below what any mode but per_microbatch adds: auto must choose what fits on both (the min)."""
    budget = 2**40 if info.rank == 0 else TIGHT_BUDGET
    cfg = engine_config("fsdp2", "auto", f"sync.memory_budget={budget}", "dist.timeout_s=60")
    engine = Engine(cfg, build_model(cfg.model), info)
    return [engine.train_batch(make_batch(seed=300 + info.rank), sft_loss) for _ in range(3)]


def _failing_loss(outputs, micro_batch, norm):
    raise RuntimeError("evaluation loss failed")


class _FailOnce:
    """A forward hook that raises the first time: a failure inside FSDP2's forward, between units."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, module, args, output):
        if not self.fired:
            self.fired = True
            raise RuntimeError("failure inside the model's forward")
        return output


def forward_only_failures(info) -> dict:
    """Accumulate a batch (not stepped yet), then forward-only passes that fail three ways; the gradients
    survive, and the update equals that of a run whose evaluations never failed."""
    out: dict = {}
    runs = {}
    for label in ("failing", "clean"):
        cfg = engine_config("fsdp2", "deferred")
        engine = Engine(cfg, build_model(cfg.model), info)
        engine.forward_backward_batch(make_batch(seed=10 + info.rank), sft_loss)
        grads_before = full_grads(engine)
        evaluation = make_batch(seed=20 + info.rank)
        if label == "failing":
            errors = []
            try:
                engine.eval_batch(evaluation, _failing_loss)
            except RuntimeError as exc:
                errors.append(str(exc))
            bad_ids = {**evaluation, "input_ids": evaluation["input_ids"] + (10_000 if info.rank == 1 else 0)}
            try:
                engine.eval_batch(bad_ids)
            except BatchError as exc:
                errors.append(str(exc))
            hook = engine.model.model.layers[1].register_forward_hook(_FailOnce())
            try:
                engine.eval_batch(evaluation)
            except RuntimeError as exc:
                errors.append(str(exc))
            hook.remove()
            out["errors"] = errors
            out["grads_kept"] = sum(p.grad is not None for p in engine.model.parameters())
            kept = full_grads(engine)
            out["grads_unchanged"] = all(torch.equal(kept[k], grads_before[k]) for k in kept)
        out[f"{label}_log_probs"] = engine.eval_batch(evaluation).outputs["log_probs"]
        engine.optimizer_step()
        runs[label] = full_params(engine)
    out["max_param_diff"] = max((runs["failing"][k] - runs["clean"][k]).abs().max().item() for k in runs["clean"])
    return out


def frozen_unit(info) -> dict:
    """Every parameter of decoder layer 1 frozen: that unit is never reduce-scattered and holds no gradient."""
    out = {}
    for mode in ("per_microbatch", "deferred"):
        cfg = engine_config("fsdp2", mode, "sync.strict=true")
        model = build_model(cfg.model)
        model.model.layers[1].requires_grad_(False)
        engine = Engine(cfg, model, info)
        metrics = engine.train_batch(make_batch(seed=30 + info.rank), sft_loss)
        result = engine.forward_backward_batch(make_batch(seed=31 + info.rank), sft_loss)
        out[mode] = {
            "metrics": metrics,
            "retained": result.retained_grad_bytes,
            "predicted_retained": engine.memory_model.retained_grad_bytes(engine.active_mode, result.num_microbatches),
            "frozen_grads": sum(p.grad is not None for p in engine.model.model.layers[1].parameters()),
        }
    return out


def forward_only_collectives(info) -> dict:
    """A forward-only pass issues what the schedule says and frees every gathered parameter after it: the
    next training step gathers the root again (as the formula expects), and a frozen reference model
    holds nothing gathered between its passes."""
    cfg = engine_config("fsdp2", "deferred", "sync.strict=true")
    engine = Engine(cfg, build_model(cfg.model), info)
    with count_collectives() as counts:
        result = engine.eval_batch(make_batch(seed=40 + info.rank))
    units = engine.wrapped.num_units
    expected = forward_traffic(result.num_microbatches, uniform_units(units)).counts
    expected["all_reduce"] += FORWARD_ALL_REDUCES
    gathered_after = unsharded_param_bytes(engine.model)
    metrics = engine.train_batch(make_batch(seed=41 + info.rank), sft_loss)  # strict: raises on a mismatch
    reference = Engine(cfg, build_model(cfg.model), info, trainable=False)
    reference.forward_batch(make_batch(seed=42 + info.rank))
    return {
        "counted": dict(counts.counts), "expected": expected, "gathered_after": gathered_after,
        "next_step": metrics, "reference_gathered": unsharded_param_bytes(reference.model),
    }


def ddp_counted_once(info) -> dict:
    """DDP's bucket all-reduces are counted once: their bytes add up to every gradient once per micro-batch."""
    cfg = engine_config("ddp", "per_microbatch")
    engine = Engine(cfg, build_model(cfg.model), info)
    params = sum(p.numel() for p in engine.model.parameters())
    with count_collectives() as counts:
        result = engine.forward_backward_batch(make_batch(seed=50 + info.rank), sft_loss)
    return {"bytes": counts.bytes["all_reduce"], "count": counts.counts["all_reduce"], "params": params,
            "num_microbatches": result.num_microbatches}


def failing_clean_up(info) -> dict:
    """Issue 59: a forward that fails inside a training step, then a clean-up that fails too (as torch 2.11's
    missing ``reset_iter_state`` did): the step raises the forward's error, the clean-up's failure a note on it and
    on its one line. Then, the real clean-up: a failure mid-step leaves the next step training as if it never
    happened."""
    from syncwise.runtime.launcher import describe
    from syncwise.sync import fsdp_internals

    out: dict = {}
    cfg = engine_config("fsdp2", "deferred")
    engine = Engine(cfg, build_model(cfg.model), info)
    hook = engine.model.model.layers[1].register_forward_hook(_FailOnce())
    original = fsdp_internals._reset_root

    def broken(module):
        raise AttributeError("'FSDPQwen2ForCausalLM' object has no attribute 'reset_iter_state'")

    fsdp_internals._reset_root = broken
    try:
        engine.train_batch(make_batch(seed=60 + info.rank), sft_loss)
    except Exception as exc:  # noqa: BLE001 - what reached the caller is the result
        out["raised"] = (type(exc).__name__, str(exc), describe(exc))
    finally:
        fsdp_internals._reset_root = original
        hook.remove()
    runs = {}
    for label in ("failed first", "clean"):
        engine = Engine(cfg, build_model(cfg.model), info)
        if label == "failed first":
            hook = engine.model.model.layers[1].register_forward_hook(_FailOnce())
            try:
                engine.train_batch(make_batch(seed=61 + info.rank), sft_loss)
            except RuntimeError as exc:
                out["real_clean_up"] = describe(exc)
            hook.remove()
        runs[label] = engine.train_batch(make_batch(seed=62 + info.rank), sft_loss)["loss"], full_params(engine)
    out["loss_after_failure"], out["loss_clean"] = runs["failed first"][0], runs["clean"][0]
    out["max_param_diff"] = max((runs["failed first"][1][k] - runs["clean"][1][k]).abs().max().item()
                                for k in runs["clean"][1])
    return out


def reliability_suite(info) -> dict:
    return {
        "failing_clean_up": failing_clean_up(info),
        "budgets": budgets_differ(info),
        "forward_only_failures": forward_only_failures(info),
        "frozen": frozen_unit(info),
        "forward_only_collectives": forward_only_collectives(info),
        "ddp": ddp_counted_once(info),
    }

