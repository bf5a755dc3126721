"""Run on 2 gloo ranks by test_refresh.py: the rollout copy refreshed one unit at a time, against the whole
model's full state dict gathered at once -- the same weights, and the extra memory each path needs."""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM

from scenarios import engine_config
from syncwise.engine import Engine
from syncwise.engine.weights import full_weights_by_unit, load_by_unit, params_by_unit
from syncwise.models import build_model

LAYERS = 6  # several decoder units, so one unit is a small part of the model


def _peak_extra(fn, *existing) -> int:
    """Bytes in use at the peak of ``fn()`` beyond what was in use before (torch's CPU tensor tracker;
    the ``existing`` modules' tensors are counted from the start, so writing into them is no allocation)."""
    tracker = MemTracker()
    tracker.track_external(*existing)
    with tracker:
        before = sum(dev["Total"] for dev in tracker.get_tracker_snapshot("current").values())
        fn()
    return max(dev["Total"] for dev in tracker.get_tracker_snapshot("peak").values()) - before


def _perturb(engine: Engine) -> None:
    """Move every trainable parameter (rank-identically), so the copy must really be refreshed."""
    with torch.no_grad():
        for param in engine.model.parameters():
            if param.requires_grad:
                param.add_(0.01)


def refresh_case(info, strategy: str, *extra: str) -> dict:
    cfg = engine_config(strategy, "per_microbatch", *extra)
    engine = Engine(cfg, build_model(cfg.model, num_hidden_layers=LAYERS), info)
    _perturb(engine)
    copy = AutoModelForCausalLM.from_config(engine.features.plain_hf_config)
    expected = engine.full_model_state()  # the whole model at once (the old path)
    load_by_unit(copy, full_weights_by_unit(engine.wrapped, engine.features.lora_merge))
    state = copy.state_dict()
    out = {
        "mismatched": sorted(k for k in expected if not torch.equal(state[k], expected[k])),
        "keys_missing": sorted(set(expected) - set(state)),
    }
    del expected
    if strategy == "fsdp2":
        unit_bytes = [sum(p.numel() * 4 for _, p in params)  # a DTensor's numel is the full one
                      for _, params in params_by_unit(engine.wrapped)]
        out["largest_unit_bytes"] = max(unit_bytes)
        out["model_bytes"] = sum(p.numel() * p.element_size() for p in copy.parameters())
        out["by_unit_extra"] = _peak_extra(
            lambda: load_by_unit(copy, full_weights_by_unit(engine.wrapped, engine.features.lora_merge)),
            copy, engine.model)
        out["whole_model_extra"] = _peak_extra(lambda: copy.load_state_dict(engine.full_model_state()),
                                               copy, engine.model)
    return out


def refresh_suite(info) -> dict:
    return {
        "fsdp2": refresh_case(info, "fsdp2"),
        "fsdp1": refresh_case(info, "fsdp1"),
        "ddp": refresh_case(info, "ddp"),
        "fsdp2_lora": refresh_case(info, "fsdp2", "model.lora.rank=4"),
        "fsdp2_checkpointed": refresh_case(info, "fsdp2", "engine.activation_checkpointing=true"),
    }
