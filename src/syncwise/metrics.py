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


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def format_step(metrics: dict[str, Any], total_steps: int) -> str:
    """``step 3/30 loss 2.1043 grad_norm 0.812 | AG 36 RS 5 AR 3 (deferred) | 0.21 s``"""
    return (
        f"step {metrics['train/step']:>3}/{total_steps} "
        f"loss {metrics.get('loss', float('nan')):.4f} "
        f"grad_norm {metrics['train/grad_norm']:.3f} | "
        f"AG {metrics['comm/all_gather_count']} "
        f"RS {metrics['comm/reduce_scatter_count']} "
        f"AR {metrics['comm/all_reduce_count']} ({metrics['sync/mode']}) | "
        f"{metrics['train/step_time_s']:.2f} s"
    )
