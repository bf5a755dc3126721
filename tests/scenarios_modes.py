"""Sync-mode scenarios run on every rank of a real process group (W=2 FSDP2, W=4 HSDP 2x2)."""

from __future__ import annotations

from scenarios import _fails_on_call, engine_config, full_grads, full_params, make_batch
from syncwise.engine import Engine
from syncwise.losses import sft_loss
from syncwise.memory.meter import PeakMeter
from syncwise.models import build_model
from syncwise.sync.fsdp_internals import fsdp2_units
from syncwise.sync.fsdp_internals import reshard_flags as fsdp2_reshard_flags
from syncwise.sync.fsdp_internals import sync_flags as fsdp2_sync_flags

NUM_MICROBATCHES = 3


def _flags(engine: Engine) -> list:
    return [(fsdp2_sync_flags(u), fsdp2_reshard_flags(u)) for u in fsdp2_units(engine.model)]


def mode_step(info, mode: str, *extra: str) -> dict:
    """One accumulation over 3 micro-batches under a tracker; then an SGD step."""
    cfg = engine_config("fsdp2", mode, *extra)
    engine = Engine(cfg, build_model(cfg.model), info)
    flags_before = _flags(engine)
    batch = make_batch(seed=200 + info.rank)
    meter = PeakMeter(engine.model, engine.optimizer, engine.info.device)
    with meter:
        engine._peak_meter = meter
        result = engine.forward_backward_batch(batch, sft_loss)
        engine._peak_meter = None
    grads = full_grads(engine)
    flags_after = _flags(engine)
    metrics = engine.train_batch(batch, sft_loss)  # a full step: counted and checked against the formula
    return {
        "grads": grads,
        "params": full_params(engine),
        "metrics": metrics,
        "flags_restored": flags_before == flags_after,
        "held_between_microbatches": meter.held_between_microbatches,
        "retained_grad_bytes": result.retained_grad_bytes,
        "unsharded_param_bytes": result.unsharded_param_bytes,
        "predicted_retained": engine.memory_model.retained_grad_bytes(engine.active_mode, NUM_MICROBATCHES),
        "predicted_unsharded": engine.memory_model.unsharded_param_bytes(engine.active_mode, NUM_MICROBATCHES),
        "predicted_extra": engine.memory_model.extra_bytes(engine.active_mode, NUM_MICROBATCHES),
        "choice": engine.active_mode,
        "unit_extra": engine.memory_model.unit_held_extra(),
        "num_units": engine.wrapped.num_units,
    }


def recovery(info, mode: str, *extra: str) -> dict:
    """Exception in micro-batch 2 of 3, then a normal step; compared with a run that never failed."""
    out: dict = {}
    params = {}
    for label in ("faulty", "clean"):
        cfg = engine_config("fsdp2", mode, *extra, "optim.name=adamw", "optim.lr=0.01")
        engine = Engine(cfg, build_model(cfg.model), info)
        engine.train_batch(make_batch(seed=10 + info.rank), sft_loss)
        before = _flags(engine)
        if label == "faulty":
            try:
                engine.train_batch(make_batch(seed=20 + info.rank), _fails_on_call(2))
            except RuntimeError as exc:
                out["error"] = str(exc)
            out["flags_restored"] = before == _flags(engine)
        out[f"{label}_metrics"] = engine.train_batch(make_batch(seed=30 + info.rank), sft_loss)
        params[label] = full_params(engine)
    out["max_param_diff"] = max((params["faulty"][k] - params["clean"][k]).abs().max().item() for k in params["clean"])
    return out


FSDP2_MODES = {
    "per_microbatch": ("per_microbatch", ()),
    "deferred": ("deferred", ()),
    "deferred_unsharded": ("deferred_unsharded", ("sync.unsharded_forward=true",)),
    "deferred_unsharded_reshard_fwd": ("deferred_unsharded", ("sync.unsharded_forward=false",)),
    "deferred_unsharded_bf16": (
        "deferred_unsharded", ("model.param_dtype=bfloat16", "model.reduce_dtype=float32"),
    ),
    "per_microbatch_bf16": ("per_microbatch", ("model.param_dtype=bfloat16", "model.reduce_dtype=float32")),
    "partial_1": ("partial", ("sync.deferred_units=1",)),  # the unit that saves most per byte: the root
    "partial_named": ("partial", ("sync.deferred_units=model.layers.1,root",)),
}


def auto_case(info, budget: float, *extra: str, batches: list[dict] | None = None) -> list[dict]:
    cfg = engine_config("fsdp2", "auto", f"sync.memory_budget={budget}", *extra)
    engine = Engine(cfg, build_model(cfg.model), info)
    batches = batches or [make_batch(seed=300 + info.rank)] * 3
    return [engine.train_batch(batch, sft_loss) for batch in batches]


def modes_suite(info) -> dict:
    out: dict = {}
    for name, (mode, extra) in FSDP2_MODES.items():
        out[("step", name)] = mode_step(info, mode, *extra)
    for mode, extra in (("deferred", ()), ("deferred_unsharded", ("sync.unsharded_forward=false",)),
                        ("deferred_unsharded", ())):
        out[("recovery", mode, extra)] = recovery(info, mode, *extra)

    # auto: measure the base with an ample budget, then budgets that leave room for less.
    ample = auto_case(info, 2**40)
    out[("auto", "ample")] = ample
    base = ample[0]["memory/peak_bytes"]
    extra_deferred = out[("step", "deferred")]["predicted_extra"]
    extra_unsharded = out[("step", "deferred_unsharded")]["predicted_extra"]
    medium = base + (extra_deferred + extra_unsharded) // 2
    smallest_unit = min(out[("step", "deferred")]["unit_extra"])
    tight = base + smallest_unit // 2  # not even one unit's unsharded gradient fits
    between = base + smallest_unit + smallest_unit // 4  # one unit's fits, two don't
    out[("auto", "medium")] = auto_case(info, medium)
    out[("auto", "tight")] = auto_case(info, tight)
    out[("auto", "partial")] = auto_case(info, between)
    out["auto_budgets"] = (base, medium, tight)
    # Mid-run: longer sequences raise the activation peak over a budget that fit the first batches.
    short = make_batch(seed=300 + info.rank)
    long = make_batch(seed=400 + info.rank, size=6, seq_len=128)
    out[("auto", "step_down")] = auto_case(
        info, medium, "sync.peak_every=1", batches=[short, short, long, short]
    )
    out["silent_noop"] = silent_noop(info)
    return out


HSDP_MODES = ("per_microbatch", "deferred", "deferred_unsharded", "replica_deferred")


def hsdp_suite(info) -> dict:
    out: dict = {}
    for mode in HSDP_MODES:
        out[("step", mode)] = mode_step(info, mode, "engine.hsdp_replicas=2")
    out[("recovery", "replica_deferred")] = recovery(info, "replica_deferred", "engine.hsdp_replicas=2")
    return out



def silent_noop(info) -> dict:
    """A sync switch that silently does nothing (the commonest deferral bug): detected by counting."""
    import contextlib
    import warnings

    import syncwise.engine.step as step_module
    from syncwise.engine import SyncNoOpError

    out = {}
    real = step_module.apply_switches
    step_module.apply_switches = lambda module, switches: contextlib.nullcontext()
    try:
        cfg = engine_config("fsdp2", "deferred")
        engine = Engine(cfg, build_model(cfg.model), info)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.train_batch(make_batch(seed=1), sft_loss)
            engine.train_batch(make_batch(seed=2), sft_loss)
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        strict = Engine(engine_config("fsdp2", "deferred", "sync.strict=true"), build_model(cfg.model), info)
        try:
            strict.train_batch(make_batch(seed=1), sft_loss)
            out["strict_error"] = None
        except SyncNoOpError as exc:
            out["strict_error"] = str(exc)
    finally:
        step_module.apply_switches = real
    return out
