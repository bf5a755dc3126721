"""Run on 2 gloo ranks by test_rollout_engines.py: one vLLM engine per rank, built once, refreshed from the
sharded policy as the trainer refreshes it; its log-probs against the trainer's forward pass of the same
sequences, on a prompt longer than one KV block -- and what a skipped refresh, or a prefix cache left as it
was, does to them (the checks that catch either); and what the engine really holds (resident memory, with
glibc returning what is freed: ``MALLOC_MMAP_THRESHOLD_`` set by the test) against what it says it holds."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch

from scenarios_refresh import _peak_extra
from syncwise.config import load_config
from syncwise.engine import Engine
from syncwise.models import build_model
from syncwise.rl.env.tasks import end_token_ids, load_tokenizer, prompt_source
from syncwise.rl.rollout.front import Rollout

PROMPT_TOKENS = 700  # five whole 128-token KV blocks on CPU, the prefix cache's unit


def _scale_policy(engine: Engine, factor: float) -> None:
    """Change the policy (every rank its own shards, alike): the sampler must see the new weights."""
    with torch.no_grad():
        for param in engine.model.parameters():
            param.mul_(factor)


def _max_diff(rollout: Rollout, engine: Engine, source, rows, prompt_ids, step: int) -> float:
    """The largest |sampler - trainer| log-prob over the response tokens of one rollout at ``step``."""
    result = rollout.generate(rows, prompt_ids, step)
    trainer = engine.forward_batch(result.batch, temperature=rollout.cfg.temperature).outputs["log_probs"]
    mask = result.batch["loss_mask"][:, 1:].bool()
    return float((result.log_probs - trainer.cpu()).abs()[mask].max())


def _resident(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _memory_parts() -> dict[str, int]:
    """The resident memory's parts (anonymous, file pages, transparent huge pages) and the process's threads."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    rollup = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]
                  if ":" in line)
    parts = {key: int(status[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}
    parts["AnonHugePages"] = int(rollup.get("AnonHugePages", "0 kB").split()[0]) * 1024
    parts["Threads"] = int(status["Threads"])
    return parts


def _file_pages() -> dict[str, int]:
    """Resident bytes of each mapped file (``/proc/self/smaps``): what of the resident size is file pages, by file."""
    pages: dict[str, int] = {}
    path = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping: range perms offset dev inode [path]
            path = head[5] if len(head) > 5 and head[4] != "0" else None
        elif path and line.startswith("Rss:"):
            pages[path] = pages.get(path, 0) + int(head[1]) * 1024
    return pages


def _same_prompt_on_both_ranks(rollout: Rollout, info, prompt: list[int], n: int = 6) -> dict:
    """Every rank samples ``n`` responses to the same prompt with its own step-0 seed: how many of this rank's
    equal one of another rank's (the seeds of vLLM's samples once overlapped across ranks: most did)."""
    import torch.distributed as dist

    from syncwise.rl.rollout.base import sample_seed

    seed = sample_seed(0, 0, info.rank, info.world_size, 0, 1, n)
    ours = [t.tolist() for t in rollout.sampler.sample([prompt], n, 16, seed).tokens]
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, ours)
    others = [r for rank, responses in enumerate(everyone) if rank != info.rank for r in responses]
    return {"shared_responses": sum(r in others for r in ours), "distinct_own": len({tuple(r) for r in ours})}


def vllm_refresh_suite(info, model_dir: str, kv_cache_bytes: int) -> dict:
    config = load_config(None, [
        f"model.path={model_dir}", "rl.rollout_engine=vllm", "rl.prompts_per_rank=1", "rl.samples_per_prompt=2",
        f"rl.max_prompt_length={PROMPT_TOKENS + 68}", "rl.max_new_tokens=8", "rl.mask_truncated=false",
        f"rl.vllm_kv_cache_bytes={kv_cache_bytes}",
    ])
    tokenizer = load_tokenizer(config)
    source = prompt_source(config.rl.task, None, None, None)
    source.encode(tokenizer, config.rl)
    engine = Engine(config, build_model(config.model), info, total_steps=1)
    gc.collect()
    baseline = _resident()  # vLLM not imported yet: its imports are its memory too
    parts, files = _memory_parts(), _file_pages()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak resident size starts again from here
    rollout = Rollout.beside(config, engine, tokenizer, source, end_token_ids(model_dir))
    generator = torch.Generator().manual_seed(0)
    special = set(tokenizer.all_special_ids)
    ids = [t for t in torch.randint(0, len(tokenizer), (PROMPT_TOKENS * 2,), generator=generator).tolist()
           if t not in special][:PROMPT_TOKENS]
    rows, prompt_ids = source.rows[:1], [ids]
    rollout.sync_weights()
    out_seeds = _same_prompt_on_both_ranks(rollout, info, ids[:40])
    rollout.generate(source.rows[:1], source.prompt_ids[:1], 0)  # a prompt of the task's
    # what building the engine, its first refresh and its first rollout took, at the peak, against its word
    out = {"peak_bytes": _resident("VmHWM") - baseline, "held_bytes": rollout.held_bytes, **out_seeds}
    # where the peak went, for the record the test leaves: what differed between runs (+10% in whole-suite runs,
    # issue 77) was file pages -- the shared libraries vLLM maps, as many resident as the page cache held --
    # while the anonymous memory was the same to 0.1%
    out["parts"] = {key: value - parts[key] for key, value in _memory_parts().items()}
    # the engine's memory: the peak less the library pages mapped since (they only grow, so this is at most
    # the anonymous peak)
    out["measured_bytes"] = out["peak_bytes"] - out["parts"]["RssFile"]
    grown = {path: size - files.get(path, 0) for path, size in _file_pages().items()}
    out["files"] = dict(sorted(grown.items(), key=lambda kv: -kv[1])[:12])
    out["parts"].update(omp=os.environ.get("OMP_NUM_THREADS"), torch_threads=torch.get_num_threads())
    out["fresh"] = _max_diff(rollout, engine, source, rows, prompt_ids, 0)
    _scale_policy(engine, 1.5)  # a policy update the sampler has not seen
    out["refresh_skipped"] = _max_diff(rollout, engine, source, rows, prompt_ids, 1)
    rollout.sync_weights()
    out["refreshed"] = _max_diff(rollout, engine, source, rows, prompt_ids, 1)  # the stale prompt's blocks are gone too
    _scale_policy(engine, 1.5)
    llm = rollout.sampler.llm
    reset = llm.reset_prefix_cache
    llm.reset_prefix_cache = lambda *a, **k: True  # a refresh that leaves the prefix cache as it was
    try:
        rollout.sync_weights()
    finally:
        llm.reset_prefix_cache = reset
    out["prefix_kept"] = _max_diff(rollout, engine, source, rows, prompt_ids, 2)
    llm.reset_prefix_cache()
    out["prefix_reset"] = _max_diff(rollout, engine, source, rows, prompt_ids, 2)
    # what one refresh allocates beyond the trainer's model and vLLM's weights (torch's tensor tracker)
    vllm_model = llm.collective_rpc(lambda worker: worker.model_runner.model)[0]
    out["refresh_extra_bytes"] = _peak_extra(rollout.sync_weights, engine.model, vllm_model)
    out["largest_unit_bytes"] = rollout.sampler.largest_unit_bytes
    out["weight_bytes"] = rollout.sampler.footprint.weights
    return out
