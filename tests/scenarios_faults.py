"""Fault scenarios on real gloo ranks: bad input on one rank, non-finite steps, a rank that never arrives."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from scenarios import engine_config, full_params, make_batch
from syncwise.data.batching import BatchError
from syncwise.engine import CollectiveTimeout, Engine
from syncwise.losses import LossOutput, sft_loss
from syncwise.models import build_model
from syncwise.rl.algorithm.losses import make_policy_loss


def _bad_batches(rank: int) -> dict[str, tuple[dict, object]]:
    good = make_batch(seed=50 + rank)
    rl = {**good, "advantages": torch.ones(6)}
    cases = {
        "missing_key": {k: v for k, v in good.items() if k != "input_ids"},
        "shape_mismatch": {**good, "loss_mask": good["loss_mask"][:, :-2]},
        "length_mismatch": {**good, "attention_mask": good["attention_mask"][:4]},
        "wrong_dtype": {**good, "input_ids": good["input_ids"].float()},
        "float_mask": {**good, "loss_mask": good["loss_mask"].float()},
        "empty": {k: v[:0] for k, v in good.items()},
        "nan_advantages": {**rl, "advantages": torch.tensor([1.0, float("nan"), 0, 0, 0, 0])},
    }
    out = {}
    for name, bad in cases.items():
        loss = make_policy_loss() if name == "nan_advantages" else sft_loss
        good_for_case = rl if name == "nan_advantages" else good
        out[name] = (bad if rank == 1 else good_for_case, loss)
    masked = {**good, "loss_mask": torch.zeros_like(good["loss_mask"])}
    out["all_masked_everywhere"] = (masked, sft_loss)
    return out


def bad_input_suite(info) -> dict:
    cfg = engine_config("fsdp2", "deferred", "optim.name=adamw", "optim.lr=0.01")
    engine = Engine(cfg, build_model(cfg.model), info)
    before = full_params(engine)
    out: dict = {"errors": {}}
    for name, (batch, loss_fn) in _bad_batches(info.rank).items():
        try:
            engine.train_batch(batch, loss_fn)
            out["errors"][name] = None
        except BatchError as exc:
            out["errors"][name] = str(exc)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before.values(), full_params(engine).values(),
                                                            strict=True))
    out["after"] = engine.train_batch(make_batch(seed=70 + info.rank), sft_loss)
    return out


def nonfinite_suite(info) -> dict:
    cfg = engine_config("fsdp2", "deferred", "optim.name=adamw", "optim.lr=0.01")
    engine = Engine(cfg, build_model(cfg.model), info)
    before = full_params(engine)

    def nan_loss(outputs, micro_batch, norm):
        result = sft_loss(outputs, micro_batch, norm)
        return LossOutput(loss=result.loss * float("nan"), metrics=result.metrics)

    skipped = engine.train_batch(make_batch(seed=1 + info.rank), nan_loss)
    out = {
        "skipped": skipped,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before.values(), full_params(engine).values(),
                                                          strict=True)),
        "grads_left": sum(p.grad is not None for p in engine.model.parameters()),
        "skipped_steps": engine.skipped_steps,
    }
    out["next"] = engine.train_batch(make_batch(seed=2 + info.rank), sft_loss)
    return out


def missing_rank(info, rank0_done: str) -> dict:
    """Rank 1 never joins the step; rank 0's collective must fail with a clear error, not hang.

    Rank 1 stays away until rank 0 has raised (a file rank 0 writes), so the error can only come from the
    timeout, however slow the machine -- no wall-clock bound is asserted."""
    cfg = engine_config("fsdp2", "deferred", "dist.timeout_s=4")
    engine = Engine(cfg, build_model(cfg.model), info)
    engine.train_batch(make_batch(seed=info.rank), sft_loss)  # a normal step first
    error, saw_rank0_fail = None, False
    done = Path(rank0_done)
    if info.rank == 0:
        try:
            engine.train_batch(make_batch(seed=info.rank), sft_loss)
        except CollectiveTimeout as exc:
            error = str(exc)
        done.write_text("raised" if error else "returned")
    else:
        # stuck (a hung data loader, a deadlock) until rank 0 is done; bounded so a broken timeout fails
        # the test instead of hanging it
        deadline = time.monotonic() + 300
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        saw_rank0_fail = done.exists() and done.read_text() == "raised"
    return {"error": error, "rank1_saw_rank0_fail": saw_rank0_fail}
