"""A GRPO / PPO step's metrics beside the engine's: the rollout's statistics over every rank (rewards,
lengths, the sampler against the trainer, what the truncation kept, the tools' counts), the wall-clock seconds of
each phase, and one row for a step of several optimizer steps."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..losses import is_maximum
from ..runtime.distributed import DistInfo, agree, agree_fields
from .env.tools import ANSWER_KINDS, ERROR_KINDS
from .rollout.agent_loop import AGENT_COUNTS
from .rollout.queue import ScoredBatch
from .rollout.turns import TOOL_COUNTS


def rollout_stats(
    result: ScoredBatch, trainer_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, response_mask: torch.Tensor,
    counts: tuple[int, int, int], info: DistInfo, timeout_s: float, step: int | None = None,
) -> dict[str, float]:
    """Over every rank (one small all-reduce): rewards, response lengths, the groups without signal and the
    samples that train (``counts``: uniform groups and groups sampled on this rank, samples it trains on),
    how far the trainer's log-probs (before any update) are from the sampler's over the response tokens
    that train, both of the untruncated distribution -- any mismatch between the two copies of the policy
    (dtype, temperature, padding, stale weights) biases the gradient -- and the probability mass the
    sampler's truncation kept. ``step`` (an off-policy job's): how many versions behind it each sample
    started, and the samples dropped for age."""
    rewards, lengths = result.rewards.double(), result.response_lengths.double()
    diff = (sampler_log_probs - trainer_log_probs.cpu()).abs() * response_mask
    kept = result.kept_mass.double()
    stale = (step - result.start_versions).double() if step is not None else torch.zeros(0, dtype=torch.float64)
    longest = float(lengths.max()) if len(lengths) else 0.0
    # the decode batch: rows x longest response per engine call (partial rollouts count theirs; one call here)
    one_call = {"drawn_tokens": float(lengths.sum()), "lockstep": len(lengths) * longest, "dropped": 0.0,
                "decode_steps": longest}
    decode = result.decode if result.decode is not None else one_call
    uniform_groups, groups, trained = counts
    fields = {
        "reward": rewards.sum(), "reward_squares": (rewards**2).sum(), "samples": len(rewards),
        "response_tokens": lengths.sum(), "solved": (rewards >= 1).sum(), "log_prob_diff": diff.sum(),
        "trained_tokens": response_mask.sum(), "uniform_groups": uniform_groups, "groups": groups,
        "trained_samples": trained, "clipped": result.clipped.sum(), "kept_mass": kept.sum(),
        "kept_tokens": kept.numel(), "staleness": stale.sum(), **{f"decode/{k}": v for k, v in decode.items()},
        **reward_part_sums(result.reward_parts), "all_none": _all_none(result.reward_parts),
        **({f"tools/{k}": v for k, v in zip(TOOL_COUNTS, result.tool_counts.tolist(), strict=True)}
           if result.tool_counts is not None else {}),
        **({f"agent/{k}": v for k, v in zip(AGENT_COUNTS, result.agent_counts.tolist(), strict=True)}
           if result.agent_counts is not None else {}),
        "agent_samples": len(result.per_sample(rewards)),
    }
    own = {"log_prob_diff_max": float(diff.max()) if diff.numel() else 0.0,
           "staleness_max": float(stale.max()) if stale.numel() else 0.0}
    totals, per_rank = agree_fields({k: float(v) for k, v in fields.items()}, own,
                                    "the rollout statistics all-reduce", info.device, timeout_s)
    count, drawn = totals["samples"], totals["decode/drawn_tokens"]
    mean = totals["reward"] / count
    # each function's mean over the samples it scored (a None, TRL's "not applicable", is left out; one that scored
    # none this step is not logged, as TRL logs None)
    by_function = {k: v / totals["scored_by/" + k.removeprefix("reward/")] for k, v in totals.items()
                   if k.startswith("reward/") and totals["scored_by/" + k.removeprefix("reward/")]}
    tools = [totals[f"tools/{k}"] for k in TOOL_COUNTS] if result.tool_counts is not None else []
    return {
        **(tool_metrics(tools, count) if tools else {}),
        **(agent_metrics(totals) if result.agent_counts is not None else {}),
        **by_function,  # a single function's too, as TRL logs rewards/<name>/mean for each
        **({"reward/all_none_fraction": totals["all_none"] / count} if totals["all_none"] else {}),
        "response/clipped_fraction": totals["clipped"] / count,  # cut by rl.max_new_tokens
        "reward/mean": mean,
        "reward/std": math.sqrt(max(totals["reward_squares"] / count - mean * mean, 0.0)),
        "reward/solved_fraction": totals["solved"] / count,
        "response/length_mean": totals["response_tokens"] / count,
        "rollout/response_tokens": totals["response_tokens"],  # over every rank
        # how full the engine's decode batch stays, each call run until its longest response: the long tail's cost
        "rollout/decode_fill": drawn / max(totals["decode/lockstep"], 1.0),
        "rollout/decode_steps": totals["decode/decode_steps"] / info.world_size,  # per rank: each call's longest
        "rollout/log_prob_diff": totals["log_prob_diff"] / max(totals["trained_tokens"], 1.0),
        "rollout/log_prob_diff_max": float(per_rank["log_prob_diff_max"].max()),
        # what rl.top_k/top_p/min_p kept, per token (absent where the engine does not report it: vLLM's)
        **({"rollout/kept_mass": totals["kept_mass"] / totals["kept_tokens"]} if totals["kept_tokens"] else {}),
        "rollout/uniform_group_fraction": totals["uniform_groups"] / totals["groups"],
        "rollout/trained_samples": totals["trained_samples"],  # over every rank (rl.skip_uniform_groups)
        # partial rollouts: every token sampled this step, also those of groups still in flight
        **({"rollout/drawn_tokens": drawn} if result.decode is not None else {}),
        **({"rollout/staleness_mean": totals["staleness"] / count,
            "rollout/staleness_max": float(per_rank["staleness_max"].max()),
            "rollout/dropped_stale": totals["decode/dropped"]} if step is not None else {}),
    }


def drawn_tokens(metrics: dict[str, Any]) -> float:
    """The tokens a step's rollout sampled over every rank: partial rollouts' ``rollout/drawn_tokens`` (also
    those that train later), else the responses it trained on."""
    return metrics["rollout/drawn_tokens"] if "rollout/drawn_tokens" in metrics else metrics["rollout/response_tokens"]


def tool_metrics(sums: list[float], samples: float) -> dict[str, float]:
    """Multi-turn rollouts' metrics from the all-reduced :data:`TOOL_COUNTS` (over every rank)."""
    counts = dict(zip(TOOL_COUNTS, sums, strict=True))
    errors = {kind: counts[kind] for kind in (*ERROR_KINDS, "refused_by_template")}
    return {
        "rollout/turns_mean": counts["turns"] / samples,
        "rollout/tool_calls_per_sample": counts["tool_calls"] / samples,
        "rollout/tool_errors": sum(errors.values()),  # calls that went wrong, over every rank
        **{f"rollout/tool_errors/{kind}": value for kind, value in errors.items()},
        # answers that are no errors: JSON values (a dict, None), and those cut to rl.tool_max_chars
        **{f"rollout/tool_{kind}": counts[kind] for kind in ANSWER_KINDS},
    }


PHASES = ("weight_sync", "rollout", "tools", "reward", "rollout_wait", "balance", "ref_log_prob", "old_log_prob",
          "values", "critic_update", "update")  # rollout_wait: a trainer waiting for its rollout rank's batch


class PhaseClock:
    """Wall-clock seconds of each phase of a GRPO step on this rank (``time/<phase>_s``)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def move(self, source: str, target: str, seconds: float) -> None:
        """Book ``seconds`` measured inside ``source`` (the tools, run between the rollout's turns) to ``target``."""
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def metrics(self) -> dict[str, float]:
        return {f"time/{phase}_s": value for phase, value in self.seconds.items()}


def combine_updates(updates: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a rollout step of several optimizer steps: the loss metrics averaged (maxima: the
    maximum), skipped updates counted, a stop requested in any of them kept, the rest from the last."""
    row = dict(updates[-1])
    for key in updates[-1]:
        if key == "loss" or key.startswith("actor/"):
            values = [u[key] for u in updates]
            row[key] = max(values) if is_maximum(key) else sum(values) / len(values)
    row["train/skipped"] = sum(u["train/skipped"] for u in updates)
    row["stop/signal"] = max(u["stop/signal"] for u in updates)
    row["train/optimizer_steps"] = len(updates)
    return row


def throughput(response_tokens: float, clock: PhaseClock, updates: list[dict[str, Any]],
               rollout_rank_s: torch.Tensor | None = None) -> dict[str, float]:
    """The rollout's tokens per second (``response_tokens``: those it drew; over the rollout rank's sampling
    seconds where one drew them), the update's real tokens per second and useful FLOPs (every rank's)."""
    sampling_s = float(rollout_rank_s[0]) if rollout_rank_s is not None else clock.seconds["rollout"]
    return {
        "perf/rollout_tokens_per_s": response_tokens / max(sampling_s, 1e-9),
        "perf/update_tokens_per_s": sum(u["batch/real_tokens"] for u in updates) / max(clock.seconds["update"], 1e-9),
        "perf/update_useful_flops": sum(u["perf/useful_flops"] for u in updates),
    }


def rollout_rank_metrics(rollout_rank_s: torch.Tensor, transfer: Any) -> dict[str, float]:
    """With rollout ranks (this trainer's batch, and the last weight transfer as trainer 0 sent it): the rollout
    rank's busy and idle seconds for the draw -- sampling, scoring, waiting for weights, receiving them -- and the
    transfer's bytes, largest unit and seconds."""
    sample_s, reward_s, idle_s, weights_s = rollout_rank_s.tolist()
    return {"rollout_rank/sample_s": sample_s, "rollout_rank/reward_s": reward_s, "rollout_rank/idle_s": idle_s,
            "rollout_rank/weight_sync_s": weights_s, "weights/bytes": float(transfer.bytes),
            "weights/largest_unit_bytes": float(transfer.largest_unit_bytes), "weights/send_s": transfer.seconds}


def agent_metrics(totals: dict[str, float]) -> dict[str, float]:
    """rl.agent's runs over every rank: requests, segments (a rewritten history opens one), tokens sampled and
    inserted between them, refusals, cut answers, failures, and each run's mean seconds."""
    samples = max(totals["agent_samples"], 1.0)
    out = {f"agent/{k}": totals[f"agent/{k}"] for k in AGENT_COUNTS if k != "wall_s"}
    out["agent/segments_per_sample"] = totals["agent/segments"] / samples
    out["agent/wall_s_mean"] = totals["agent/wall_s"] / samples
    return out


def scoring_metrics(scored: ScoredBatch, source: Any, info: DistInfo, timeout_s: float) -> dict[str, float]:
    """Collective: what the episodes said of themselves (``env/...``) and what TRL-signature rewards logged with
    ``log_metric`` (under its name), each averaged over the step's entries on every rank (``source``: the job's
    prompt source, its environment and rewards)."""
    out: dict[str, float] = {}
    if source.environment is not None:
        out.update(env_metrics(scored.episode_metrics, info, timeout_s))
    if any(reward.trl for reward in source.rewards):
        out.update(env_metrics(scored.reward_metrics or [], info, timeout_s, prefix=""))
    return out


def env_metrics(per_episode: list[dict[str, float]], info: DistInfo, timeout_s: float,
                prefix: str = "env/") -> dict[str, float]:
    """``env/<name>``: each number an environment's ``metrics`` gave, its mean over the step's episodes
    that gave it, over every rank (the names agreed first: an episode may give some only sometimes). The same
    for TRL's ``log_metric`` calls (``prefix`` ""): each name's mean over the calls that gave it."""
    import torch.distributed as dist

    names = sorted(set().union(*per_episode)) if per_episode else []
    if dist.is_initialized() and info.world_size > 1:
        everyone: list = [None] * info.world_size
        dist.all_gather_object(everyone, names)
        names = sorted(set().union(*everyone))
    sums = [sum(m.get(name, 0.0) for m in per_episode) for name in names]
    counts = [sum(name in m for m in per_episode) for name in names]
    totals, _ = agree([*sums, *counts], [], "the environment metrics all-reduce", info.device, timeout_s)
    values = totals.tolist()
    return {f"{prefix}{name}": values[i] / max(values[len(names) + i], 1.0) for i, name in enumerate(names)}


def progress_line(metrics: dict[str, Any]) -> str:
    """The progress bar's words for a step: reward, the actor's loss and collectives, the critic's, the times."""
    actor = (f"loss {metrics['loss']:.4f} gn {metrics['train/grad_norm']:.2f} "
             f"AG {metrics['comm/all_gather_count']} RS {metrics['comm/reduce_scatter_count']} "
             f"AR {metrics['comm/all_reduce_count']} {metrics['sync/mode']}"
             if "loss" in metrics else "actor waits (critic.warmup_steps)")
    critic = (f" | vf {metrics['critic/vf_loss']:.4f} ev {metrics['critic/vf_explained_var']:.2f} "
              f"{metrics['critic/sync/mode']}" if "critic/vf_loss" in metrics else "")
    return (f"reward {metrics['reward/mean']:.3f} {actor}{critic} | rollout {metrics['time/rollout_s']:.1f}s "
            f"update {metrics['time/update_s'] + metrics['time/critic_update_s']:.1f}s")


def reward_part_sums(parts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each reward source's sum over the samples it scored (``reward/<name>``) and how many it scored
    (``scored_by/<name>``): a None (NaN, TRL's "not applicable") counts in neither."""
    out: dict[str, float] = {}
    for name, values in parts.items():
        out[f"reward/{name}"] = float(values.double().nansum())
        out[f"scored_by/{name}"] = float((~values.isnan()).sum())
    return out


def _all_none(parts: dict[str, torch.Tensor]) -> float:
    """How many samples no reward function scored (every one gave None)."""
    if not parts:
        return 0.0
    return float(torch.stack([values.isnan() for values in parts.values()]).all(dim=0).sum())
