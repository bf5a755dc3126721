"""Jobs on the memorised tool model (``user_models.memorized_tool_model``'s ``qwen2-tools``) as the tool and agent
tests run them: ``syncwise train`` in the fixture's folder with the module's job keys, and what the job wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def train(folder: Path, out: str, job: list[str], *overrides: str, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    """``syncwise train`` on ``folder/qwen2-tools`` into ``folder/out`` (``env`` added to the environment)."""
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    environ.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "syncwise", "train", *job, f"model.path={folder / 'qwen2-tools'}",
                           f"train.out_dir={folder / out}", *overrides], cwd=folder, capture_output=True, text=True,
                          env=environ, timeout=600)


def metric_rows(folder: Path, out: str) -> list[dict]:
    return [json.loads(line) for line in (folder / out / "metrics.jsonl").read_text().splitlines()]


def completions_table(folder: Path, out: str, step: int):
    """The job's completions table of ``step``, as pandas reads it."""
    import pandas as pd

    return pd.read_parquet(folder / out / "completions" / f"completions_{step:05d}.parquet")
