"""Where a job's metrics go beside its ``metrics.jsonl`` (``train.logger`` / ``sft.logger``): TensorBoard, Weights &
Biases, MLflow and Trackio, through their own packages (optional extras), on rank 0 only. Each tracker gets every
step's numbers, the evaluations' rows, the completions table (:mod:`syncwise.logs.completions`) and the job's config;
a resumed job continues the same run, whose id its checkpoint keeps (:meth:`Tracker.run_id`).

Where each writes is its package's own setting: wandb's ``WANDB_PROJECT`` / ``WANDB_MODE`` (``offline``: a run
folder under ``<out_dir>/wandb`` for ``wandb sync``), MLflow's ``MLFLOW_TRACKING_URI`` (unset: a SQLite store
``<out_dir>/mlflow.db``) and ``MLFLOW_EXPERIMENT_NAME``, Trackio's ``TRACKIO_DIR`` and ``TRACKIO_PROJECT``; the
project or experiment is ``syncwise`` unless set, the run named after the output folder."""

from __future__ import annotations

import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from ..config.loading import flat_keys
from ..metrics import set_aside
from ..runtime.terminal import escape_controls

PROJECT = "syncwise"


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (a tracker plots numbers; the sync mode's name stays in the JSONL)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Tracker:
    """One logger's run: metrics by step, the completions table, the run's id (kept in checkpoints)."""

    name = ""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_table(self, frame: Any, step: int) -> None:
        """The step's completions (a pandas DataFrame)."""

    def run_id(self) -> str | None:
        return None

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    """Event files in ``<out_dir>/tensorboard`` (tensorboardX, no TensorFlow): the scalars, and the completions
    as a text table."""

    name = "tensorboard"

    def __init__(self, out_dir: Path, config: dict[str, Any], resumed: str | None, fresh: bool):
        from tensorboardX import SummaryWriter

        if fresh:  # an earlier run's events set aside, as metrics.jsonl is
            set_aside(out_dir / "tensorboard")
        self._writer = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in numbers(metrics).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_table(self, frame: Any, step: int) -> None:
        text = frame.to_markdown(index=False) if _has_tabulate() else frame.to_string(index=False)
        self._writer.add_text("completions", escape_controls(text), step)  # policy output, shown as text
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run (``WANDB_MODE=offline``: no network, synced later with ``wandb sync``)."""

    name = "wandb"

    def __init__(self, out_dir: Path, config: dict[str, Any], resumed: str | None, fresh: bool):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=out_dir.name,
                               dir=str(out_dir), config=config, id=resumed, resume="allow" if resumed else None)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log(numbers(metrics), step=step)

    def log_table(self, frame: Any, step: int) -> None:
        self._run.log({"completions": self._wandb.Table(dataframe=frame)}, step=step)

    def run_id(self) -> str:
        return self._run.id

    def close(self) -> None:
        self._run.finish()


MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"  # <out_dir>/...: the job's own MLflow store


class MlflowTracker(Tracker):
    """An MLflow run: the config as parameters (and ``config.yaml``), the metrics by step, each completions table
    as a JSON artifact (``completions/completions_<step>.json``, what ``mlflow.load_table`` reads). Where
    ``MLFLOW_TRACKING_URI`` is unset, a SQLite store ``<out_dir>/mlflow.db`` with its artifacts in
    ``<out_dir>/mlartifacts``."""

    name = "mlflow"

    def __init__(self, out_dir: Path, config: dict[str, Any], resumed: str | None, fresh: bool):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        own = not uri  # the job's own store: SQLite in the run folder, which MLflow 3 opens as it is
        if own:
            os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{(out_dir / MLFLOW_DB).resolve()}"
            for name in ("mlflow.store.db.utils", "alembic"):  # its tables' creation, said at INFO
                logging.getLogger(name).setLevel(logging.WARNING)
        elif _file_store(uri) and "MLFLOW_ALLOW_FILE_STORE" not in os.environ:
            # the user's own file store: MLflow 3 refuses to write one unless told, which would end the job
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
            print(f"syncwise: MLFLOW_TRACKING_URI={uri} is a file store, which MLflow 3 writes only with "
                  "MLFLOW_ALLOW_FILE_STORE=true: set for this job (open it with the same variable set)", flush=True)
        import mlflow

        self._mlflow = mlflow
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        if own and mlflow.get_experiment_by_name(experiment) is None:  # its artifacts beside it, not in the cwd
            mlflow.create_experiment(experiment, artifact_location=(out_dir / MLFLOW_ARTIFACTS).resolve().as_uri())
        mlflow.set_experiment(experiment)
        self._run = mlflow.start_run(run_id=resumed) if resumed else mlflow.start_run(run_name=out_dir.name)
        if not resumed:
            mlflow.log_params({_key(k): str(v)[:6000] for k, v in flat_keys(config).items()})
            mlflow.log_dict(config, "config.yaml")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._mlflow.log_metrics({_key(k): v for k, v in numbers(metrics).items()}, step=step)

    def log_table(self, frame: Any, step: int) -> None:
        self._mlflow.log_table(frame, artifact_file=f"completions/completions_{step:05d}.json")

    def run_id(self) -> str:
        return self._run.info.run_id

    def close(self) -> None:
        self._mlflow.end_run()


def _file_store(uri: str) -> bool:
    """Whether an MLflow tracking URI names a folder (``file:...`` or a plain path), not a server or a database."""
    return uri.startswith("file:") or "://" not in uri and not uri.startswith(("databricks", "sqlite", "postgresql",
                                                                             "mysql", "mssql", "http"))


class TrackioTracker(Tracker):
    """A Trackio run in its local store (``TRACKIO_DIR``), resumed by name."""

    name = "trackio"

    def __init__(self, out_dir: Path, config: dict[str, Any], resumed: str | None, fresh: bool):
        import trackio

        self._trackio = trackio
        self._name = resumed or f"{out_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=self._name, config=config,
                     resume="must" if resumed else "never")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._trackio.log(numbers(metrics), step=step)

    def log_table(self, frame: Any, step: int) -> None:
        self._trackio.log({"completions": self._trackio.Table(dataframe=frame)}, step=step)

    def run_id(self) -> str:
        return self._name

    def close(self) -> None:
        self._trackio.finish()


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                      "mlflow": MlflowTracker, "trackio": TrackioTracker}


def open_trackers(names: list[str], out_dir: Path, config: dict[str, Any],
                  resumed: dict[str, str] | None) -> list[Tracker]:
    """The trackers ``names`` asks for (jsonl is the job log's own), each continuing its run in ``resumed`` (a
    checkpoint's run ids; None: a new job)."""
    runs = resumed or {}
    return [TRACKERS[name](out_dir, config, runs.get(name), resumed is None) for name in names if name in TRACKERS]


def _key(name: str) -> str:
    """A name as MLflow takes it (letters, digits, ``_ - . / `` and spaces)."""
    return re.sub(r"[^\w\-./ ]", "_", name)


def _has_tabulate() -> bool:
    import importlib.util

    return importlib.util.find_spec("tabulate") is not None
