"""``syncwise bench --workload loss``: the log-prob path alone against autograd's, side by side.

Forward and backward from fp32 logits [tokens x vocabulary] (default 4096 x 32000, the shape the issue
measured) of a weighted sum of the token log-probs -- and of log-probs plus entropy -- through syncwise's
chunked path (:func:`syncwise.losses.token_log_probs`, :func:`~syncwise.losses.token_log_probs_and_entropy`)
and through the plain one a user would write (``torch.log_softmax(x / T).gather(...)``, entropy
``-(p * log p).sum(-1)``), at each temperature. With the LM head: from hidden states [tokens x hidden]
and the head's weight [vocabulary x hidden], ``F.linear`` then the plain path, against ``F.linear`` then
syncwise's (``engine.fused_lm_head=false``) and against the fused head (:class:`~syncwise.losses.LogitsFromHidden`,
no [tokens x vocabulary] logits) -- with the head trained and frozen (LoRA). Rounds are interleaved; medians;
one process, no ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ...losses import LogitsFromHidden, logprob_chunking, token_log_probs, token_log_probs_and_entropy
from .report import write_report


@dataclass
class LossBenchSpec:
    tokens: int = 4096
    vocab: int = 32000
    temperatures: list[float] = field(default_factory=lambda: [1.0, 0.6])
    chunk: int = 1024  # engine.logprob_chunk_size
    hidden: int = 512  # the LM head's input width (0: no LM-head rows)
    repeats: int = 5
    out_dir: str = "runs/bench_loss"

    @classmethod
    def quick(cls, out_dir: str = "runs/bench_loss") -> LossBenchSpec:
        # a smoke run: every row, at a size where a chunk is still a part of the sequence
        return cls(tokens=256, chunk=128, temperatures=[1.0], repeats=3, out_dir=out_dir)


def _cases(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, temperature: float, chunk: int,
           head: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, Callable[[], None]]:
    def plain(entropy: bool, with_head: bool = False, frozen: bool = False) -> None:
        x = _head_logits(frozen) if with_head else logits.detach().requires_grad_()
        log_p = torch.log_softmax(x[:, :-1] / temperature, dim=-1)
        out = log_p.gather(-1, ids[:, 1:, None]).squeeze(-1)
        if entropy:
            out = out - (log_p.exp() * log_p).sum(-1)
        (out * weights).sum().backward()

    def _head(frozen: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states and the head's weight as fresh leaves; a frozen head (LoRA) has no gradient."""
        return head[0].detach().requires_grad_(), head[1].detach().requires_grad_(not frozen)

    def _head_logits(frozen: bool) -> torch.Tensor:
        return F.linear(*_head(frozen))

    def chunked(entropy: bool, with_head: str = "", frozen: bool = False) -> None:
        if with_head == "fused":
            x = LogitsFromHidden(*_head(frozen))
        else:
            x = _head_logits(frozen) if with_head else logits.detach().requires_grad_()
        with logprob_chunking(chunk):
            if entropy:
                log_probs, ent = token_log_probs_and_entropy(x, ids, temperature)
                out = log_probs + ent
            else:
                out = token_log_probs(x, ids, temperature)
        (out * weights).sum().backward()

    cases = {"plain log-probs": lambda: plain(False), "syncwise log-probs": lambda: chunked(False),
             "plain log-probs + entropy": lambda: plain(True), "syncwise log-probs + entropy": lambda: chunked(True)}
    if head is not None:
        for what, entropy in (("log-probs", False), ("log-probs + entropy", True)):
            for head_name, frozen in (("LM head", False), ("frozen LM head", True)):
                name = f"{head_name} + {what}"
                cases[f"plain {name}"] = lambda e=entropy, f=frozen: plain(e, with_head=True, frozen=f)
                cases[f"syncwise {name}, logits materialised"] = (
                    lambda e=entropy, f=frozen: chunked(e, "materialised", frozen=f))
                cases[f"syncwise {name}, fused"] = lambda e=entropy, f=frozen: chunked(e, "fused", frozen=f)
    return cases


def run_loss_bench(spec: LossBenchSpec) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, spec.tokens, spec.vocab, generator=gen)
    ids = torch.randint(0, spec.vocab, (1, spec.tokens), generator=gen)
    weights = torch.randn(1, spec.tokens - 1, generator=gen)
    head = None
    if spec.hidden:  # scaled so that the logits have unit variance, like those above
        head = (torch.randn(1, spec.tokens, spec.hidden, generator=gen),
                torch.randn(spec.vocab, spec.hidden, generator=gen) / spec.hidden**0.5)
    records = []
    for temperature in spec.temperatures:
        cases = _cases(logits, ids, weights, temperature, spec.chunk, head)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for round_index in range(spec.repeats + 1):  # the first round warms up
            for name, run in cases.items():
                start = time.perf_counter()
                run()
                if round_index:
                    times[name].append(time.perf_counter() - start)
        for what in ("log-probs", "log-probs + entropy"):
            rows = [(what, f"plain {what}")]
            if head is not None:
                rows += [(f"{head_name} + {what}, {how}", f"plain {head_name} + {what}")
                         for head_name in ("LM head", "frozen LM head") for how in ("logits materialised", "fused")]
            for name, reference in rows:
                plain, ours = statistics.median(times[reference]), statistics.median(times[f"syncwise {name}"])
                records.append({"what": name, "temperature": temperature, "plain_s": plain, "syncwise_s": ours,
                                "ratio": ours / plain, "threads": torch.get_num_threads()})
    return records


def markdown_table(records: list[dict[str, Any]], spec: LossBenchSpec) -> str:
    head = f"; LM head rows from hidden states [{spec.tokens} x {spec.hidden}]" if spec.hidden else ""
    lines = [f"forward + backward from fp32 logits [{spec.tokens} x {spec.vocab}]{head}, chunk {spec.chunk}, "
             f"{records[0]['threads'] if records else 0} thread(s), median of {spec.repeats}",
             "", "| what | T | plain s | syncwise s | syncwise / plain |", "|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['what']} | {r['temperature']} | {r['plain_s']:.3f} | {r['syncwise_s']:.3f} "
                     f"| {r['ratio']:.3f} |")
    return "\n".join(lines)


def run(args) -> int:
    """``syncwise bench --workload loss``: one process, no ranks to launch."""
    from . import out_dir

    spec = LossBenchSpec.quick(out_dir(args, "bench_loss")) if args.quick else LossBenchSpec(
        out_dir=out_dir(args, "bench_loss"))
    if args.repeats is not None:
        spec.repeats = args.repeats
    return bench_loss(spec)


def bench_loss(spec: LossBenchSpec) -> int:
    """Run, print and write ``bench_loss.json`` / ``bench_loss.md``; the exit status."""
    records = run_loss_bench(spec)
    table = markdown_table(records, spec)
    worst = max(r["ratio"] for r in records if "LM head" not in r["what"])
    lines = [f"slowest syncwise / plain ratio of the loss path from logits {worst:.3f} (target <= 1.00)"]
    by_name = {(r["what"], r["temperature"]): r["syncwise_s"] for r in records}
    for (what, temperature), fused in by_name.items():
        if what.endswith(", fused"):
            materialised = by_name[(what.replace(", fused", ", logits materialised"), temperature)]
            lines.append(f"{what.removesuffix(', fused')}, T {temperature}: fused / materialised logits "
                         f"{fused / materialised:.3f}")
    write_report(spec.out_dir, "bench_loss", spec, {"records": records}, table, lines)
    return 0
