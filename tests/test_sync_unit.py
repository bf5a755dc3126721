"""Call-sequence tests of the gradient-sync context and the engine's schedule, with fake FSDP modules.

These pin down *which* calls happen in which order; the real multi-process runs (test_equivalence.py,
test_engine_dist.py) check that the result is right.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn.parallel import DistributedDataParallel as DDP

from syncwise.config import load_config
from syncwise.engine import Engine
from syncwise.losses import LossOutput
from syncwise.sync.fsdp_internals import sync_flags as fsdp2_sync_flags
from syncwise.sync.modes import SyncMode, spec
from syncwise.sync.switches import gradient_sync


class FakeFSDP2(FSDPModule, nn.Module):
    """Quacks like a ``fully_shard``-ed module: records setter calls, keeps FSDP2's per-group flags."""

    def __new__(cls, *args, **kwargs):  # FSDPModule.__new__ expects fully_shard's dynamic class
        return object.__new__(cls)

    def __init__(self, name: str, log: list, inner: nn.Module | None = None):
        nn.Module.__init__(self)
        self.name = name
        self.log = log
        self.inner = inner if inner is not None else nn.Identity()
        self.group = SimpleNamespace(
            reduce_grads=True, all_reduce_grads=True, fsdp_params=[], _partial_reduce_output=None
        )

    def _apply(self, *args, **kwargs):  # FSDPModule._apply reshards real parameter groups
        return nn.Module._apply(self, *args, **kwargs)

    def _get_fsdp_state(self):
        return SimpleNamespace(_fsdp_param_groups=[self.group], _is_root=False)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        assert recurse is False, "syncwise sets each unit itself"
        self.log.append((self.name, "sync", requires_gradient_sync))
        self.group.reduce_grads = requires_gradient_sync
        self.group.all_reduce_grads = requires_gradient_sync

    def reshard(self) -> None:  # nothing is gathered in a fake
        pass

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        self.log.append((self.name, "all_reduce", requires_all_reduce))
        self.group.all_reduce_grads = requires_all_reduce

    def forward(self, x):
        self.log.append((self.name, "forward", self.group.reduce_grads))
        out = self.inner(x)
        if out.requires_grad:
            name, log, group = self.name, self.log, self.group
            out.register_hook(lambda g: log.append((name, "backward", group.reduce_grads)))
        return out


class FakeFSDP1(FSDP1):
    def __init__(self, log: list):
        nn.Module.__init__(self)
        self.log = log

    @contextmanager
    def no_sync(self):
        self.log.append("fsdp1 enter")
        try:
            yield
        finally:
            self.log.append("fsdp1 exit")


class FakeDDP(DDP):
    def __init__(self, log: list):
        nn.Module.__init__(self)
        self.log = log

    @contextmanager
    def no_sync(self):
        self.log.append("ddp enter")
        try:
            yield
        finally:
            self.log.append("ddp exit")


def test_fsdp1_no_sync_entered_and_exited_around_body():
    log: list = []
    module = FakeFSDP1(log)
    with gradient_sync(module, enabled=False):
        log.append("body")
    assert log == ["fsdp1 enter", "body", "fsdp1 exit"]


def test_ddp_no_sync_entered_and_exited_around_body():
    log: list = []
    with gradient_sync(FakeDDP(log), enabled=False):
        log.append("body")
    assert log == ["ddp enter", "body", "ddp exit"]


def test_fsdp1_no_sync_exits_on_exception():
    log: list = []
    with pytest.raises(RuntimeError), gradient_sync(FakeFSDP1(log), enabled=False):
        raise RuntimeError("boom")
    assert log == ["fsdp1 enter", "fsdp1 exit"]


def test_fsdp2_turns_sync_off_then_back_on():
    log: list = []
    unit = FakeFSDP2("root", log)
    with gradient_sync(unit, enabled=False):
        assert unit.group.reduce_grads is False
        log.append("body")
    assert log == [("root", "sync", False), "body", ("root", "sync", True)]
    assert fsdp2_sync_flags(unit) == [(True, True)]


def test_fsdp2_restored_after_exception():
    log: list = []
    unit = FakeFSDP2("root", log)
    with pytest.raises(ValueError, match="inside"), gradient_sync(unit, enabled=False):
        raise ValueError("raised inside the context")
    assert log == [("root", "sync", False), ("root", "sync", True)]
    assert unit.group.reduce_grads is True


def test_fsdp2_restores_previous_off_state_not_true():
    log: list = []
    unit = FakeFSDP2("root", log)
    unit.set_requires_gradient_sync(False, recurse=False)  # the caller had already turned sync off
    log.clear()
    with gradient_sync(unit, enabled=False):
        pass
    assert log == [("root", "sync", False), ("root", "sync", False)]
    assert unit.group.reduce_grads is False


def test_fsdp2_restores_replica_only_flags():
    """A unit with reduce-scatter on but all-reduce off (HSDP replica deferral) gets both back."""
    log: list = []
    unit = FakeFSDP2("root", log)
    unit.set_requires_all_reduce(False, recurse=False)
    log.clear()
    with gradient_sync(unit, enabled=False):
        assert fsdp2_sync_flags(unit) == [(False, False)]
    assert fsdp2_sync_flags(unit) == [(True, False)]
    assert log == [("root", "sync", False), ("root", "sync", True), ("root", "all_reduce", False)]


def test_nested_contexts_restore_outer_state():
    unit = FakeFSDP2("root", [])
    with gradient_sync(unit, enabled=False):
        with gradient_sync(unit, enabled=False):
            pass
        assert unit.group.reduce_grads is False, "inner exit must not turn sync back on"
    assert unit.group.reduce_grads is True


def test_root_not_fsdp_module_applies_to_every_fsdp_submodule():
    """A PEFT-style wrapper whose root is a plain module: every FSDP unit inside is switched."""
    log: list = []
    wrapper = nn.Sequential(nn.Linear(2, 2), nn.Sequential(FakeFSDP2("a", log), FakeFSDP2("b", log)))
    with gradient_sync(wrapper, enabled=False):
        log.append("body")
    assert log == [("a", "sync", False), ("b", "sync", False), "body", ("a", "sync", True), ("b", "sync", True)]


def test_enabled_and_plain_modules_are_untouched():
    log: list = []
    unit = FakeFSDP2("root", log)
    with gradient_sync(unit, enabled=True):
        pass
    with gradient_sync(nn.Linear(2, 2), enabled=False):
        pass
    assert log == []


def test_sync_mode_schedule():
    def syncs(mode: SyncMode, i: int, n: int) -> bool:
        return spec(mode).switches(i, n).sync_grads

    assert [syncs(SyncMode.DEFERRED, i, 3) for i in range(3)] == [False, False, True]
    assert [syncs(SyncMode.PER_MICROBATCH, i, 3) for i in range(3)] == [True, True, True]
    assert syncs(SyncMode.DEFERRED, 0, 1) is True


# ------------------------------------------------------------------------------------------------
# The engine's schedule, on a fake model whose layers are fake FSDP2 units
# ------------------------------------------------------------------------------------------------
class FakeCausalLM(nn.Module):
    """Embedding -> two fake FSDP2 units -> head; returns an object with ``.logits`` like HF models."""

    def __init__(self, log: list, vocab: int = 16, hidden: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([FakeFSDP2(f"layer{i}", log, nn.Linear(hidden, hidden)) for i in range(2)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return SimpleNamespace(logits=self.head(h))


def _fake_engine(mode: str, log: list) -> Engine:
    cfg = load_config(None, ["engine.strategy=none", f"sync.mode={mode}", "engine.micro_batch_size=2"])
    return Engine(cfg, FakeCausalLM(log))


def _batch(size: int = 6) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(size * 5).reshape(size, 5) % 16}


def _loss(outputs, micro_batch, norm):
    return LossOutput(loss=outputs.logits.float().pow(2).mean())


def _per_microbatch_flags(log: list, event: str) -> list[bool]:
    return [flag for name, kind, flag in (e for e in log if isinstance(e, tuple)) if name == "layer0" and kind == event]


def test_engine_three_microbatches_toggle_off_off_sync():
    log: list = []
    engine = _fake_engine("deferred", log)
    engine.forward_backward_batch(_batch(6), _loss)
    assert _per_microbatch_flags(log, "forward") == [False, False, True]
    assert _per_microbatch_flags(log, "backward") == [False, False, True]
    # Exactly two off/on pairs per unit; the final micro-batch runs with no call around it.
    assert _per_microbatch_flags(log, "sync") == [False, True, False, True]
    last_sync_call = max(i for i, e in enumerate(log) if e[1] == "sync")
    assert all(e[1] in ("forward", "backward") for e in log[last_sync_call + 1 :])


def test_engine_per_microbatch_mode_never_disables_sync():
    log: list = []
    engine = _fake_engine("per_microbatch", log)
    engine.forward_backward_batch(_batch(6), _loss)
    assert _per_microbatch_flags(log, "sync") == []
    assert _per_microbatch_flags(log, "backward") == [True, True, True]


def test_engine_forward_only_never_enters_the_context():
    log: list = []
    engine = _fake_engine("deferred", log)
    result = engine.forward_backward_batch(_batch(6), forward_only=True)
    assert _per_microbatch_flags(log, "sync") == []
    assert _per_microbatch_flags(log, "forward") == [True, True, True]
    assert result.outputs["log_probs"].shape == (6, 4)
    assert all(p.grad is None for p in engine.model.parameters())


def test_engine_restores_sync_after_exception_in_second_microbatch():
    log: list = []
    engine = _fake_engine("deferred", log)
    calls = {"n": 0}

    def failing_loss(outputs, micro_batch, norm):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("loss failed in micro-batch 2")
        return _loss(outputs, micro_batch, norm)

    with pytest.raises(RuntimeError, match="micro-batch 2"):
        engine.forward_backward_batch(_batch(6), failing_loss)
    assert all(unit.group.reduce_grads for unit in engine.model.layers)
    assert all(p.grad is None for p in engine.model.parameters()), "partial gradients are dropped"
