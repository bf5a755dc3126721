"""The completions table: every logged step's samples -- prompt, completion, each reward, the advantage, the
length, how it ended -- one Parquet file a step, ``<out_dir>/completions/completions_<step:05d>.parquet`` (TRL's
layout; pandas reads it), and the view ``syncwise show`` prints of a step's best and worst samples."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..runtime.terminal import escape_controls

FOLDER = "completions"
# what the view prints above each sample's prompt and completion, where the table has it
SHOWN = ("reward", "advantage", "length", "finish_reason", "turns", "tool_calls", "tool_errors", "policy_version",
         "staleness")


def table_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / FOLDER / f"completions_{step:05d}.parquet"


def write_table(rows: list[dict[str, Any]], out_dir: str | Path, step: int) -> Any:
    """The step's rows as a DataFrame, written to its Parquet file; returns the frame (for the loggers)."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    path = table_path(out_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    frame.to_parquet(tmp, index=False)
    tmp.replace(path)
    return frame


def logged_steps(run: str | Path) -> list[int]:
    """The steps whose table ``run`` (a job's output folder) holds, in order."""
    folder = Path(run) / FOLDER
    found = (re.fullmatch(r"completions_(\d+)\.parquet", p.name) for p in folder.glob("completions_*.parquet"))
    return sorted(int(m.group(1)) for m in found if m)


def read_table(run: str | Path, step: int | None = None) -> tuple[int, Any]:
    """(the step, its table) of ``run``: ``step``'s, or the last logged; a ValueError in one line where there is
    none."""
    import pandas as pd

    steps = logged_steps(run)
    if not steps:
        raise ValueError(f"{Path(run) / FOLDER}: no completions table (a job writes them with "
                         "train.log_completions_every > 0)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        shown = steps if len(steps) <= 6 else [*steps[:3], "...", *steps[-3:]]
        near = ", ".join(map(str, shown))
        raise ValueError(f"{Path(run) / FOLDER}: no table for step {step} (logged: {near})")
    return step, pd.read_parquet(table_path(run, step))


def view(run: str | Path, step: int | None = None, best: int = 2, worst: int = 2) -> str:
    """A step's ``best`` highest- and ``worst`` lowest-rewarded samples as text: each one's reward, its parts,
    advantage, length and ending, its prompt and its completion (a conversation turn by turn)."""
    step, frame = read_table(run, step)
    frame = frame.sort_values("reward", ascending=False, kind="stable").reset_index(drop=True)
    chosen = list(range(min(best, len(frame))))
    chosen += [i for i in range(max(len(frame) - worst, 0), len(frame)) if i not in chosen]
    parts = [c for c in frame.columns if c.startswith("reward/")]
    mean = frame["reward"].mean()
    out = [f"step {step}: {len(frame)} samples, reward mean {mean:.3f} (min {frame['reward'].min():.3f}, max "
           f"{frame['reward'].max():.3f}); the best {min(best, len(frame))} and the worst {min(worst, len(frame))}"]
    for rank, i in enumerate(chosen):
        row = frame.iloc[i]
        label = f"best {rank + 1}" if rank < best else f"worst {len(frame) - i}"
        facts = [f"{key} {_fmt(row[key])}" for key in (*SHOWN[:1], *parts, *SHOWN[1:]) if key in frame.columns]
        out += ["", f"--- {label} of {len(frame)}: " + ", ".join(facts), "[prompt]", str(row["prompt"]),
                "[completion]", str(row["completion"])]
    return escape_controls("\n".join(out))  # policy output: it may hold ESC, CR, OSC sequences


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "none" if value != value else f"{value:.4g}"
    return str(value)
