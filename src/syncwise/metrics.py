"""Step metrics: a JSONL log (rank 0) and a one-line console summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlLogger:
    """Appends one JSON object per step to ``path`` (creating its folder)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log(self, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps(metrics, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def set_aside(path: Path) -> Path | None:
    """An earlier run's ``path`` (a log file or folder) renamed to ``<stem>.old-N<suffix>`` (the first free N),
    so a new run starts its own and nothing is lost; None where there is nothing at ``path``."""
    if not path.exists():
        return None
    n = 1
    while (aside := path.with_name(f"{path.stem}.old-{n}{path.suffix}")).exists():
        n += 1
    path.rename(aside)
    return aside


def open_job_log(path: str | Path, resumed_step: int | None, step_key: str = "train/step") -> tuple[JsonlLogger, str]:
    """The job's JSONL log and a note for its first line. A run that does not resume (``resumed_step`` None)
    starts its own: an earlier run's log in the folder is set aside (:func:`set_aside`), never mixed into
    this run's summary and curves. A resumed run keeps the rows up to its checkpoint's step and drops later
    ones (of a run whose steps it replays)."""
    path = Path(path)
    note = ""
    if resumed_step is None:
        aside = set_aside(path)
        note = f"; an earlier run's log in this folder moved to {aside.name}" if aside else ""
    elif path.is_file():
        rows = read_jsonl(path)
        kept = [row for row in rows if row.get(step_key, 0) <= resumed_step]
        if len(kept) < len(rows):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in kept))
            tmp.replace(path)
    return JsonlLogger(path), note


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def job_history(path: str | Path, step_key: str = "train/step") -> list[dict[str, Any]]:
    """Every step of a job from its JSONL log, across resumes (:func:`open_job_log`: a resumed run appends
    from its checkpoint's step on); where a step was logged twice, the last row counts. An evaluation's row
    (``eval/...`` only) joins its step's."""
    rows: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(path):
        if step_key not in row:
            continue
        evaluation = all(k == step_key or k.startswith("eval/") for k in row)
        if evaluation:
            rows.setdefault(row[step_key], {}).update(row)
        else:
            rows[row[step_key]] = {**{k: v for k, v in rows.get(row[step_key], {}).items() if k.startswith("eval/")},
                                   **row}
    return [rows[step] for step in sorted(rows)]


def format_step(metrics: dict[str, Any]) -> str:
    """An engine step's words: ``loss 2.1043 grad_norm 0.812 | AG 36 RS 5 AR 3 (deferred) | 0.21 s``"""
    return (
        f"loss {metrics.get('loss', float('nan')):.4f} "
        f"grad_norm {metrics['train/grad_norm']:.3f} | "
        f"AG {metrics['comm/all_gather_count']} "
        f"RS {metrics['comm/reduce_scatter_count']} "
        f"AR {metrics['comm/all_reduce_count']} ({metrics['sync/mode']}) | "
        f"{metrics['train/step_time_s']:.2f} s"
    )


def _pyplot():
    """matplotlib's pyplot on the file-only backend (ranks and CI have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curves(
    rows: list[dict[str, Any]], path: str | Path, keys: tuple[str | tuple[str, ...], ...] = ("reward/mean", "loss")
) -> Path:
    """A PNG with one panel per entry of ``keys`` against the step: a metric, or a tuple of metrics drawn
    together (e.g. the training loss and the evaluation loss)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5))
    for ax, panel in zip(axes if len(keys) > 1 else [axes], keys, strict=True):
        series = (panel,) if isinstance(panel, str) else panel
        for key in series:
            points = [(r["train/step"], r[key]) for r in rows if key in r]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="." if len(points) < 60 else None, linewidth=1, label=key)
        if len(series) > 1:
            ax.legend(fontsize=8)
        ax.set_title(" / ".join(series))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_phases(rows: list[dict[str, Any]], path: str | Path, keys: list[str]) -> Path:
    """A PNG of where each step's time went: the ``keys`` (seconds per phase) stacked against the step."""
    plt = _pyplot()
    steps = [r["train/step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.stackplot(steps, [[r.get(key, 0.0) for r in rows] for key in keys],
                 labels=[key.removeprefix("time/").removesuffix("_s") for key in keys])
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("time per step, by phase")
    ax.legend(loc="upper left", fontsize=8, ncol=3)
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_phase_bars(results: dict[str, dict[str, Any]], path: str | Path, phases: list[str]) -> Path:
    """Stacked horizontal bars: each configuration's (``results[name]["phases_s"]``) median step, split into
    its ``phases``."""
    plt = _pyplot()
    names = list(results)
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(names) + 1.5))
    left = [0.0] * len(names)
    for phase in phases:
        widths = [results[n]["phases_s"][phase] for n in names]
        ax.barh(names, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per GRPO step (median)")
    ax.set_title("where a GRPO step's time goes")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return _save(plt, fig, path)
