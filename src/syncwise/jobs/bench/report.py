"""What every benchmark writes: ``<name>.json`` (the spec, the machine where it ran, the results),
``<name>.md`` (the table and a line per finding), the same table and lines on stdout, and where they went."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any


def machine(info) -> dict[str, Any]:
    """Where a launched benchmark ran: device, ranks, torch, threads per rank (and the GPU's name)."""
    import torch

    device = info.device
    return {"device": str(device), "world_size": info.world_size, "torch": torch.__version__,
            "threads_per_rank": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def write_report(out_dir: str | Path, name: str, spec: Any, results: dict[str, Any], table: str,
                 lines: list[str] = (), also: list[Path] = ()) -> None:
    """``out_dir/name.json`` ({"spec", **results}), ``out_dir/name.md`` and stdout; ``also``: other files the
    benchmark wrote (plots), named in the last line."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"spec": asdict(spec), **results}, indent=1))
    (out / f"{name}.md").write_text(table + ("\n\n" + "\n".join(f"- {line}" for line in lines) if lines else "")
                                    + "\n")
    written = [out / f"{name}.json", out / f"{name}.md", *also]
    print(table, *lines, "written: " + ", ".join(str(p) for p in written), sep="\n", flush=True)


def fmt(value: float | None, digits: int = 2, missing: str = "") -> str:
    """A table cell: ``value`` to ``digits`` places, ``missing`` where there is none."""
    return missing if value is None else f"{value:.{digits}f}"
