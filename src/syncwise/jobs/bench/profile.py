"""``syncwise bench --workload rl --profile``: where one packed step's time goes, operator by operator."""

from __future__ import annotations

from pathlib import Path

import torch

from ...config import load_config
from ...engine import Engine
from ...losses import sft_loss
from ...models import build_model
from ...runtime.distributed import init_distributed


def profile_packed_step(batch: dict[str, torch.Tensor], cap: tuple[str, str], preset: str = "qwen2-20m",
                        rows: int = 14, out_dir: str = "runs/bench_rl") -> int:
    """``syncwise bench --workload rl --profile``: torch.profiler's top self-CPU operators of one packed step
    (rank 0's long-tailed sequences, one process, ``engine.strategy=none``, after warm-up steps): at a
    512-token cap with the fused LM head and with materialised logits, and on the defaults (head and cap
    auto's, profiled once auto has settled); printed and written to ``profile.md``. ``batch`` and ``cap``: the rl
    workload's (:mod:`syncwise.jobs.bench.rl`, which calls this)."""
    from torch.profiler import ProfilerActivity, profile

    info = init_distributed("gloo", 600.0)
    sections = []
    capped = list(cap)
    for label, overrides in ((f"engine.fused_lm_head=true, {cap[1]}", [*capped, "engine.fused_lm_head=true"]),
                             (f"engine.fused_lm_head=false, {cap[1]}", [*capped, "engine.fused_lm_head=false"]),
                             ("the defaults (LM head and token cap auto)", [])):
        cfg = load_config(None, [f"model.preset={preset}", "engine.strategy=none", *overrides])
        engine = Engine(cfg, build_model(cfg.model), info)
        engine.train_batch(batch, sft_loss)
        while not engine.governor.settled:  # auto's decision and its measured step
            engine.train_batch(batch, sft_loss)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.train_batch(batch, sft_loss)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        sections.append(f"{label} ({torch.get_num_threads()} thread(s)):\n\n```\n{table}\n```")
    text = "\n\n".join(sections)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.md").write_text(text + "\n")
    print(text, f"written: {out / 'profile.md'}", sep="\n", flush=True)
    return 0
