"""``syncwise bench --workload loss``: the log-prob path alone against autograd's, side by side.

Forward and backward from fp32 logits [tokens x vocabulary] (default 4096 x 32000, the shape the issue
measured) of a weighted sum of the token log-probs -- and of log-probs plus entropy -- through syncwise's
chunked path (:func:`syncwise.losses.token_log_probs`, :func:`~syncwise.losses.token_log_probs_and_entropy`)
and through the plain one a user would write (``torch.log_softmax(x / T).gather(...)``, entropy
``-(p * log p).sum(-1)``), at each temperature. Rounds are interleaved; medians; one process, no ranks.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..losses import logprob_chunking, token_log_probs, token_log_probs_and_entropy


@dataclass
class LossBenchSpec:
    tokens: int = 4096
    vocab: int = 32000
    temperatures: list[float] = field(default_factory=lambda: [1.0, 0.6])
    chunk: int = 1024  # engine.logprob_chunk_size
    repeats: int = 5
    out_dir: str = "runs/bench_loss"

    @classmethod
    def quick(cls, out_dir: str = "runs/bench_loss") -> LossBenchSpec:
        return cls(tokens=1024, temperatures=[1.0], repeats=3, out_dir=out_dir)


def _cases(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, temperature: float, chunk: int
           ) -> dict[str, Callable[[], None]]:
    def plain(entropy: bool) -> None:
        x = logits.detach().requires_grad_()
        log_p = torch.log_softmax(x[:, :-1] / temperature, dim=-1)
        out = log_p.gather(-1, ids[:, 1:, None]).squeeze(-1)
        if entropy:
            out = out - (log_p.exp() * log_p).sum(-1)
        (out * weights).sum().backward()

    def chunked(entropy: bool) -> None:
        x = logits.detach().requires_grad_()
        with logprob_chunking(chunk):
            if entropy:
                log_probs, ent = token_log_probs_and_entropy(x, ids, temperature)
                out = log_probs + ent
            else:
                out = token_log_probs(x, ids, temperature)
        (out * weights).sum().backward()

    return {"plain log-probs": lambda: plain(False), "syncwise log-probs": lambda: chunked(False),
            "plain log-probs + entropy": lambda: plain(True), "syncwise log-probs + entropy": lambda: chunked(True)}


def run_loss_bench(spec: LossBenchSpec) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, spec.tokens, spec.vocab, generator=gen)
    ids = torch.randint(0, spec.vocab, (1, spec.tokens), generator=gen)
    weights = torch.randn(1, spec.tokens - 1, generator=gen)
    records = []
    for temperature in spec.temperatures:
        cases = _cases(logits, ids, weights, temperature, spec.chunk)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for round_index in range(spec.repeats + 1):  # the first round warms up
            for name, run in cases.items():
                start = time.perf_counter()
                run()
                if round_index:
                    times[name].append(time.perf_counter() - start)
        for what in ("log-probs", "log-probs + entropy"):
            plain, ours = statistics.median(times[f"plain {what}"]), statistics.median(times[f"syncwise {what}"])
            records.append({"what": what, "temperature": temperature, "plain_s": plain, "syncwise_s": ours,
                            "ratio": ours / plain, "threads": torch.get_num_threads()})
    return records


def markdown_table(records: list[dict[str, Any]], spec: LossBenchSpec) -> str:
    lines = [f"forward + backward from fp32 logits [{spec.tokens} x {spec.vocab}], chunk {spec.chunk}, "
             f"{records[0]['threads'] if records else 0} thread(s), median of {spec.repeats}",
             "", "| what | T | plain s | syncwise s | syncwise / plain |", "|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['what']} | {r['temperature']} | {r['plain_s']:.3f} | {r['syncwise_s']:.3f} "
                     f"| {r['ratio']:.3f} |")
    return "\n".join(lines)


def bench_loss(spec: LossBenchSpec) -> int:
    """Run, print and write ``bench_loss.json`` / ``bench_loss.md``; the exit status."""
    records = run_loss_bench(spec)
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_loss.json").write_text(json.dumps({"spec": asdict(spec), "records": records}, indent=1))
    table = markdown_table(records, spec)
    worst = max(r["ratio"] for r in records)
    line = f"slowest syncwise / plain ratio {worst:.3f} (target <= 1.00)"
    (out / "bench_loss.md").write_text(f"{table}\n\n- {line}\n")
    print(table, line, f"written: {out / 'bench_loss.json'}, {out / 'bench_loss.md'}", sep="\n", flush=True)
    return 0
