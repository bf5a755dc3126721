"""Checkpoints under faults, in one process: a crash mid-write, truncated or corrupted files, a crafted
pickle, and a run that keeps producing non-finite steps."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from syncwise.checkpoint import CheckpointError, CheckpointManager
from syncwise.config import load_config, packaged_config
from syncwise.engine import Engine

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _engine() -> Engine:
    cfg = load_config(None, ["engine.strategy=none", "model.preset=qwen2-test", "sync.mode=deferred"])
    return Engine(cfg)


def _params(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


CRASH = textwrap.dedent("""
    import os, sys, torch
    import syncwise.checkpoint as ckpt
    from syncwise.config import load_config
    from syncwise.engine import Engine
    engine = Engine(load_config(None, ["engine.strategy=none", "model.preset=qwen2-test", "sync.mode=deferred"]))
    manager = ckpt.CheckpointManager(sys.argv[1])
    manager.save(2, engine, {"step": 2})
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(1.0)
    real_save = torch.save
    def die(*args, **kwargs):  # the process is killed after the shards, before the rename
        os._exit(9)
    ckpt.torch.save = die
    manager.save(4, engine, {"step": 4})
""")


def test_crash_mid_write_leaves_latest_on_the_previous_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path)], env=ENV, capture_output=True, timeout=300)
    assert proc.returncode == 9
    assert (tmp_path / ".tmp-step_000004" / "dcp").is_dir(), "the interrupted write is really there"
    assert (tmp_path / "latest").read_text() == "step_000002"
    manager = CheckpointManager(tmp_path)
    assert manager.resolve("auto") == tmp_path / "step_000002"
    engine = _engine()
    fresh = _params(engine)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.mul_(0.0)
    assert manager.load(manager.resolve("auto"), engine) == {"step": 2}
    for name, value in _params(engine).items():
        assert torch.equal(value, fresh[name]), name  # the step-2 state, not the +1 of the crashed write
    manager.save(4, engine, {"step": 4})
    assert not (tmp_path / ".tmp-step_000004").exists() and (tmp_path / "latest").read_text() == "step_000004"


RESAVE_CRASH = textwrap.dedent("""
    import os, sys, torch
    import syncwise.checkpoint as ckpt
    from syncwise.config import load_config
    from syncwise.engine import Engine
    root, point = sys.argv[1], sys.argv[2]
    engine = Engine(load_config(None, ["engine.strategy=none", "model.preset=qwen2-test", "sync.mode=deferred"]))
    manager = ckpt.CheckpointManager(root)
    manager.save(4, engine, {"step": 4, "version": "A"})
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(1.0)
    def crash_at(self, reached):
        if reached == point:
            os._exit(9)
    ckpt.CheckpointManager._reached = crash_at
    manager.save(4, engine, {"step": 4, "version": "B"})  # the same step again: latest already names it
""")


@pytest.mark.parametrize(
    ("point", "survivor"),
    [("written", "A"), ("old_aside", "A"), ("new_in", "B"), ("latest", "B"), ("old_removed", "B")],
)
def test_resave_of_the_latest_step_is_atomic_at_every_point(tmp_path, point, survivor):
    """Re-saving the checkpoint `latest` names, killed at each point of the protocol: `latest` still leads
    to one complete checkpoint (the old or the new, never a mix), and the next save tidies up."""
    proc = subprocess.run([sys.executable, "-c", RESAVE_CRASH, str(tmp_path), point], env=ENV, capture_output=True,
                          timeout=300)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    manager = CheckpointManager(tmp_path)
    engine = _engine()
    fresh = _params(engine)
    assert manager.load(manager.resolve("auto"), engine)["version"] == survivor
    shift = 1.0 if survivor == "B" else 0.0
    for name, value in _params(engine).items():
        assert torch.equal(value, fresh[name] + shift), name
    manager.save(4, engine, {"step": 4, "version": "C"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004"]
    assert manager.load(manager.resolve("auto"), _engine())["version"] == "C"


@pytest.fixture
def saved(tmp_path) -> Path:
    manager = CheckpointManager(tmp_path)
    return manager.save(2, _engine(), {"step": 2})


def test_truncated_shard_names_the_file(saved):
    shard = next((saved / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=str(saved / "dcp")):
        CheckpointManager(saved.parent).load(saved, _engine())


def test_corrupted_trainer_state_names_the_file(saved):
    (saved / "trainer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{saved / 'trainer.json'}: unreadable"):
        CheckpointManager(saved.parent).load(saved, _engine())
    (saved / "trainer.json").unlink()
    with pytest.raises(CheckpointError, match="trainer.json: missing"):
        CheckpointManager(saved.parent).load(saved, _engine())


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {_Exploit.marker}",))


def test_crafted_metadata_is_refused_not_executed(saved, tmp_path):
    _Exploit.marker = tmp_path / "pwned"
    (saved / "dcp" / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointError, match="not allowed"):
        CheckpointManager(saved.parent).load(saved, _engine())
    assert not _Exploit.marker.exists()


def test_resume_errors_name_the_path(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.resolve("auto") is None  # nothing yet: a fresh start
    with pytest.raises(CheckpointError, match="checkpoint directory not found: /nope"):
        manager.resolve("/nope")
    (tmp_path / "latest").write_text("step_000009")
    with pytest.raises(CheckpointError, match="names step_000009, which does not exist"):
        manager.resolve("auto")


def test_training_stops_after_consecutive_non_finite_steps(tmp_path, monkeypatch):
    import syncwise.rl.trainer as trainer
    from syncwise.losses import LossOutput

    real = trainer.make_policy_loss

    def nan_policy_loss(cfg, **kwargs):
        inner = real(cfg, **kwargs)

        def loss_fn(outputs, micro_batch, norm):
            result = inner(outputs, micro_batch, norm)
            return LossOutput(loss=result.loss * float("nan"), metrics=result.metrics, outputs=result.outputs)

        return loss_fn

    monkeypatch.setattr(trainer, "make_policy_loss", nan_policy_loss)
    cfg = load_config(
        packaged_config("grpo.yaml"),
        ["engine.strategy=none", "sync.mode=deferred", f"train.out_dir={tmp_path}", "train.progress=false",
         "train.max_consecutive_skips=3", "train.steps=10", "rl.prompts_per_rank=2", "rl.samples_per_prompt=2"],
    )
    with pytest.raises(trainer.TrainingStopped, match="3 consecutive steps had a non-finite gradient norm"):
        trainer.run_rl(cfg)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000003"
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line]
    assert len(rows) == 3 and all('"train/skipped": 1' in row for row in rows)
