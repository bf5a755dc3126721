"""Where a job's steps go on rank 0, for ``syncwise train``, ``sft`` and ``dpo`` alike: its ``config.yaml``,
``metrics.jsonl`` (continued where a resumed job starts), the loggers of ``train.logger`` / ``sft.logger`` /
``dpo.logger`` (:mod:`syncwise.logs.trackers`), the completions table (:mod:`syncwise.logs.completions`), and the
console -- a progress bar, or with the bar off a line every ``log_every`` steps."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..metrics import open_job_log, set_aside
from .callbacks import script_callbacks
from .completions import FOLDER, write_table
from .trackers import Tracker, open_trackers


@dataclass
class LogSettings:
    """A job's logging keys (``train.*`` or ``sft.*``): its loggers, bar, line interval and length."""

    loggers: list[str]
    progress: bool | str  # true | false | auto (a bar where stderr is a terminal)
    log_every: int
    steps: int
    name: str  # the bar's label

    @property
    def bar(self) -> bool:
        return self.progress is True or (self.progress == "auto" and sys.stderr.isatty())


class JobLogs:
    """A job's logs on rank 0; ``history``: the steps of this run, for its summary."""

    def __init__(self):
        self.history: list[dict[str, Any]] = []
        self.trackers: list[Tracker] = []
        self.jsonl = None
        self.bar = None
        self.settings: LogSettings | None = None
        self.out_dir = Path(".")

    def open(self, config: dict[str, Any], out_dir: Path, settings: LogSettings, resumed_at: int | None,
             runs: dict[str, str] | None = None) -> str:
        """``config.yaml`` written and the logs opened (``resumed_at``: the checkpoint's step, None for a new
        job; ``runs``: the loggers' run ids its checkpoint kept); what the job's first line says of them."""
        self.out_dir, self.settings = out_dir, settings
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config))
        self.jsonl, note = open_job_log(out_dir / "metrics.jsonl", resumed_at)
        if resumed_at is None:  # an earlier run's tables set aside, as its metrics.jsonl is
            set_aside(out_dir / FOLDER)
        self.trackers = open_trackers(settings.loggers, out_dir, config, runs if resumed_at is not None else None)
        self.trackers += script_callbacks(settings.steps, resumed_at)
        note = f"; its config in {out_dir / 'config.yaml'}{note}"
        if self.trackers:
            note += "; logging to " + ", ".join(t.name for t in self.trackers)
        if settings.bar:
            from tqdm import tqdm

            self.bar = tqdm(total=settings.steps, initial=resumed_at or 0, desc=settings.name, dynamic_ncols=True)
        return note

    def log(self, metrics: dict[str, Any], progress: str, always: bool = False) -> None:
        """One step's metrics; ``progress``: the bar's words for it (with the bar off, a line every ``log_every``
        steps, at the last, and where ``always``)."""
        step = int(metrics["train/step"])
        self.jsonl.log(metrics)
        for tracker in self.trackers:
            tracker.log(metrics, step)
        self.history.append(metrics)
        if self.bar is not None:
            self.bar.set_postfix_str(progress)
            self.bar.update(1)
        elif always or step % self.settings.log_every == 0 or step == self.settings.steps:
            print(f"step {step}/{self.settings.steps} {progress}", flush=True)

    def log_eval(self, row: dict[str, Any]) -> None:
        """An evaluation's row (its step and ``eval/...``): in the logs beside the steps' rows, not a step."""
        self.jsonl.log(row)
        for tracker in self.trackers:
            tracker.log(row, int(row["train/step"]))
        words = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        if self.bar is not None:
            self.bar.write(words)
        else:
            print(words, flush=True)

    def log_completions(self, rows: list[dict[str, Any]], step: int) -> None:
        """The step's samples: their Parquet file, and a table in each logger."""
        if not rows:
            return
        frame = write_table(rows, self.out_dir, step)
        for tracker in self.trackers:
            tracker.log_table(frame, step)

    def run_ids(self) -> dict[str, str]:
        """Each logger's run id, for the checkpoint (a resumed job continues those runs)."""
        return {t.name: run for t in self.trackers if (run := t.run_id()) is not None}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
