"""Issue 69: a job's metrics, config and completions where a team looks -- Weights & Biases (offline mode), MLflow
(its file store), Trackio (its local store) and TensorBoard -- through the real packages, on rank 0 only; a job
resumed from its checkpoint continues the same runs (their ids in the checkpoint); ``syncwise sft`` logs through
the same loggers. Each store is read back as its own tools read it: wandb's run file (its records, as ``wandb
sync`` reads them), ``MlflowClient``, Trackio's SQLite database."""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from job_output import failed

LOGGERS = "train.logger=[jsonl,wandb,mlflow,trackio,tensorboard]"


def _syncwise(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp / "wandb-config"), "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
           "TRACKIO_DIR": str(tmp / "trackio"), "MLFLOW_TRACKING_URI": ""}
    env.pop("PYTHONPATH", None)
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)  # the job's own MLflow store is one MLflow 3 opens as it is
    proc = subprocess.run([sys.executable, "-m", "syncwise", *args], cwd=tmp, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    return proc


def _wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """Each logged step's numbers in an offline run's ``.wandb`` file: LevelDB-log blocks of wandb's protobuf
    ``Record``s, as ``wandb sync`` reads them."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunk, steps = run_file.read_bytes(), 7, b"", {}
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the block's padding
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or a record's last part
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                steps.setdefault(record.history.step.num, {}).update(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item})
    return steps


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_runs(tmp: Path, out: Path, key: str, steps: int, checkpoint: Path) -> tuple:
    """wandb, MLflow and Trackio each hold one run of the job, ``key`` at every step 1..steps as metrics.jsonl has
    it, the job's config, and each step's completions table (a GRPO job's); the checkpoint names those runs."""
    logged = {row["train/step"]: row[key] for row in _jsonl(out / "metrics.jsonl") if key in row}
    assert sorted(logged) == list(range(1, steps + 1))
    runs = json.loads((checkpoint / "trainer.json").read_text())["trainer"]["loggers"]
    assert set(runs) >= {"wandb", "mlflow", "trackio"}
    # wandb: one folder per process that ran it (the first job and its resumption), one run id
    folders = sorted((out / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(f"-{runs['wandb']}") for f in folders), folders
    history = {}
    for folder in folders:
        history.update(_wandb_history(folder / f"run-{runs['wandb']}.wandb"))
    assert {s: h[key] for s, h in history.items() if key in h} == pytest.approx(logged, rel=1e-6)
    # MLflow: the job's SQLite store <out_dir>/mlflow.db (read with no MLFLOW_ALLOW_FILE_STORE: issue 80), its
    # artifacts in <out_dir>/mlartifacts, one run, continued
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "syncwise"]
    assert experiment.artifact_location == (out / "mlartifacts").resolve().as_uri()
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == runs["mlflow"]
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} == pytest.approx(logged, rel=1e-6)
    # Trackio: its SQLite store, the run by name
    with sqlite3.connect(tmp / "trackio" / "syncwise.db") as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics").fetchall()
        configs = db.execute("SELECT run_name, config FROM configs").fetchall()
    names = {name for name, _, _ in rows if name.startswith(out.name)}
    assert names == {runs["trackio"]}
    tracked = {step: json.loads(m)[key] for name, step, m in rows if name in names and key in json.loads(m)}
    assert tracked == pytest.approx(logged, rel=1e-6)
    assert any(name in names and "train" in json.loads(config) for name, config in configs)
    return run, client, history, rows




def test_grpo_metrics_config_and_completions_go_to_wandb_mlflow_trackio_and_a_resume_continues_them(tmp_path):
    out = tmp_path / "grpo"
    job = ["train", f"train.out_dir={out}", LOGGERS, "train.progress=false", "train.export=false"]
    first = _syncwise(tmp_path, *job, "train.steps=2", "train.checkpoint_every=2")
    assert "logging to wandb, mlflow, trackio, tensorboard" in first.stdout
    _syncwise(tmp_path, *job, "train.steps=3", "train.resume=auto")
    run, client, history, rows = _check_runs(tmp_path, out, "reward/mean", 3, out / "checkpoints" / "step_000003")
    assert run.data.params["train.steps"] == "2"  # the config, as the run started
    tables = {a.path for a in client.list_artifacts(run.info.run_id, "completions")}
    assert tables == {f"completions/completions_{s:05d}.json" for s in (1, 2, 3)}
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "completions/completions_00003.json",
                                                      str(tmp_path / "dl"))).read_text())
    assert {"prompt", "completion", "reward", "advantage"} <= set(table["columns"]) and len(table["data"]) == 128
    # wandb's table a step (its file, as the run file names it)
    assert all(history[s]["completions/_type"] == "table-file" and history[s]["completions/nrows"] == 128
               for s in (1, 2, 3))
    assert sum("completions" in json.loads(m) for _, _, m in rows) == 3  # Trackio's
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    import pandas as pd  # and the job's own table, a step a file

    frame = pd.read_parquet(out / "completions" / "completions_00003.parquet")
    assert len(frame) == 128 and frame["reward"].tolist() == [row[table["columns"].index("reward")]
                                                         for row in table["data"]]


def test_sft_logs_through_the_same_loggers_and_a_resume_continues_them(tmp_path):
    out = tmp_path / "sft"
    job = ["sft", f"sft.out_dir={out}", LOGGERS.replace("train.", "sft."), "sft.progress=false", "sft.export=false"]
    _syncwise(tmp_path, *job, "sft.steps=2", "sft.checkpoint_every=2")
    _syncwise(tmp_path, *job, "sft.steps=3", "sft.resume=auto")
    _check_runs(tmp_path, out, "loss", 3, out / "checkpoints" / "step_000003")


# What a byte-level tokenizer can sample: a window title, a screen clear, an OSC 52 clipboard write, a carriage
# return that overwrites the line, a C1 CSI, a right-to-left override
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x1b]52;c;ZXZpbA==\x07 wrong\rfake: all good \x9b31m\u202eevil"


def test_syncwise_show_and_tensorboard_show_a_completion_s_control_characters_escaped(tmp_path):
    """Issue 77 (5): completions are policy output, and `syncwise show` printed them raw to the terminal. Every
    control character but newline and tab is shown escaped, there and in TensorBoard's text."""
    from cli_harness import run_cli
    from syncwise.logs.completions import write_table
    from syncwise.logs.trackers import TensorBoardTracker

    rows = [{"prompt": "say hi\n", "completion": HOSTILE + "\n\tindented", "reward": 1.0},
            {"prompt": "p", "completion": "plain", "reward": 0.0}]
    frame = write_table(rows, tmp_path, 1)
    shown = run_cli(["show", str(tmp_path)])
    assert shown.returncode == 0, shown.stderr
    assert not any(c in shown.stdout for c in "\x1b\x07\r\x9b\u202e"), repr(shown.stdout)
    assert ("\\x1b]0;pwned\\x07\\x1b[2J\\x1b]52;c;ZXZpbA==\\x07 wrong\\rfake: all good \\x9b31m\\u202eevil\n"
            "\tindented") in shown.stdout
    tracker = TensorBoardTracker(tmp_path, {}, None, fresh=True)
    tracker.log_table(frame, 1)
    tracker.close()
    [text] = _tensorboard_texts(tmp_path / "tensorboard")
    assert "fake: all good" in text and not any(c in text for c in "\x1b\x07\r\x9b\u202e"), repr(text)
    assert "\\x1b]0;pwned" in text


def _tensorboard_texts(folder: Path) -> list[str]:
    """The text summaries in an event folder, read as TensorBoard reads them (TFRecord frames of Event protos)."""
    from tensorboardX.proto import event_pb2

    texts = []
    for path in folder.glob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            texts += [s.decode() for v in event.summary.value for s in v.tensor.string_val]
    return texts


def test_a_file_store_the_user_names_is_written_with_a_line_instead_of_ending_the_job(tmp_path, monkeypatch, capsys):
    """Issue 80 (4): MLflow 3 refuses to write a file store unless MLFLOW_ALLOW_FILE_STORE is set, so a
    MLFLOW_TRACKING_URI=file:... the user set ended the job on rank 0. The job sets it, and says so in a line."""
    from mlflow import MlflowClient

    from syncwise.logs.trackers import MlflowTracker

    store = tmp_path / "mine"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    tracker = MlflowTracker(tmp_path / "run", {"optim": {"lr": 0.1}}, None, fresh=True)
    tracker.log({"loss": 1.5}, 1)
    tracker.close()
    assert (f"syncwise: MLFLOW_TRACKING_URI={store.as_uri()} is a file store, which MLflow 3 writes only with "
            "MLFLOW_ALLOW_FILE_STORE=true: set for this job") in capsys.readouterr().out
    history = MlflowClient(store.as_uri()).get_metric_history(tracker.run_id(), "loss")
    assert [m.value for m in history] == [1.5]
