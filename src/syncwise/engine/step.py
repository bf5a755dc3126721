"""The micro-batch loop: forward and backward of every micro-batch under its sync switches, and the
forward-only pass beside it (log-probs, evaluation), which never touches gradients or sync state."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ..data.batching import MicroBatch, restore_order
from ..data.packing import unpack
from ..data.ulysses import SequenceGroup, ShardedLogits, gather_positions, shard_row, sharded_forward
from ..losses import (
    LogitsFromHidden,
    LossFn,
    LossOutput,
    Normalizer,
    is_maximum,
    logprob_chunking,
    takes_fused_head,
    target_mask,
    token_log_probs,
)
from ..memory.accounting import grad_bytes, unsharded_param_bytes
from ..memory.meter import PeakMeter
from ..models import hf_config_of
from ..models.head import hidden_states_out
from ..models.moe import ROUTES, route_replay
from ..runtime.distributed import collective_timeout
from ..runtime.errors import clean_up_after
from ..sync import fsdp_internals as fsdp
from ..sync.switches import SwitchesFor, apply_switches
from .planning import BatchPlan


def positions_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position within its sequence (as ``generate`` numbers them): left padding does not shift
    a row, so learned absolute positions (GPT-2) see each sequence as they would alone."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


SwitchesOf = Callable[[int, int], SwitchesFor]  # (micro-batch index, count) -> switches per unit


@dataclass
class ForwardBackwardResult:
    """What one pass over a batch produced on this rank."""

    metrics: dict[str, float]  # loss-function metrics summed over micro-batches (this rank's share)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # per sample, original order
    num_microbatches: int = 0
    retained_grad_bytes: int = 0  # most gradient bytes held after any micro-batch's backward
    unsharded_param_bytes: int = 0  # most all-gathered parameter bytes held after any backward
    workload_imbalance: float = 1.0  # max / min estimated compute over this rank's non-empty micro-batches
    workloads: list[float] = field(default_factory=list)  # estimated compute of each micro-batch, in order
    largest_tokens: int = 0  # positions of this rank's largest micro-batch


def forward_microbatch(
    model: nn.Module, mb: MicroBatch, loss_fn: LossFn | None, norm: Normalizer, device: torch.device,
    with_log_probs: bool, temperature: float = 1.0, fused_head: bool = False, router_aux_coef: float = 0.0,
    sequence: SequenceGroup | None = None,
) -> LossOutput:
    """One micro-batch forward and its loss. A packed micro-batch gives the model restarting
    ``position_ids`` and no attention mask (see :mod:`syncwise.data.packing`). An empty micro-batch (this rank
    has fewer samples than the agreed count) runs a one-token dummy forward whose zero loss still runs
    every FSDP unit, so the collectives match the other ranks. Rows of a packed micro-batch that share a
    prefix read it from their leader (:mod:`syncwise.data.prefixes`). With ``fused_head`` (a model whose output
    layer is installed, :mod:`syncwise.models.head`) and a loss that takes it, the loss gets
    :class:`LogitsFromHidden` as ``outputs.logits``: the logits are made a chunk at a time. With ``sequence``
    (sequence parallelism; every micro-batch packed) this rank computes its share of the row's positions and the
    loss gets the whole row's log-probs (:mod:`syncwise.data.ulysses`)."""
    data = mb.data
    fused = fused_head and takes_fused_head(loss_fn)
    if data is None:
        ids = torch.zeros((1, 2), dtype=torch.long, device=device)
        route_replay(model, None, torch.zeros_like(ids))  # its token counts in no expert's load
        model_out = _forward(model, fused, input_ids=ids, use_cache=False)
        # through the log-prob path, so that every parameter the real micro-batches use gets a gradient
        return LossOutput(loss=token_log_probs(model_out.logits, ids).sum() * 0.0)
    start = None  # sequence parallel: where this rank's positions start in the packed row
    if sequence is not None:
        inputs, start = shard_row(data, mb.packing.attention_inputs(), sequence, per_token=(ROUTES,))
        routes = inputs.pop(ROUTES, None)
        local = inputs["input_ids"].shape[1]  # the padding after the row's last token counts in no expert's load
        real = (torch.arange(start, start + local, device=device) < data["input_ids"].shape[1])[None]
    elif mb.packing is not None:
        inputs = {"input_ids": data["input_ids"], "position_ids": data["position_ids"], **mb.packing.attention_inputs()}
        routes, real = data.get(ROUTES), None
    else:
        inputs = {"input_ids": data["input_ids"], "attention_mask": data.get("attention_mask")}
        if inputs["attention_mask"] is not None and hf_config_of(model) is not None:  # takes position_ids
            inputs["position_ids"] = positions_of(inputs["attention_mask"])
        routes, real = data.get(ROUTES), data.get("attention_mask")
    # a mixture of experts: routed as its sampler did where the batch says, its experts' load counted
    replay = route_replay(model, routes, real)
    if router_aux_coef:  # a mixture of experts: transformers computes its routers' load-balancing loss
        inputs["output_router_logits"] = True
    with sharded_forward(sequence) if sequence is not None else nullcontext():
        model_out = _forward(model, fused, use_cache=False, **inputs)
    if sequence is not None:  # the whole row's log-probs (or values) from every rank's positions
        model_out.logits = whole_row_logits(model_out.logits, sequence, start, data["input_ids"].shape[1])
    result = loss_fn(model_out, data, norm) if loss_fn is not None else LossOutput(torch.zeros((), device=device))
    if replay is not None:
        result.metrics.update(replay.metrics())
    if router_aux_coef:
        # the micro-batch's load-balancing loss, weighted by its share of the step's loss tokens: summed over the
        # micro-batches and ranks, the token-weighted mean (the batch's own where one micro-batch holds it)
        aux = model_out.aux_loss * (target_mask(data).sum() / norm.tokens)
        if sequence is not None:  # each rank's routers saw 1/N of the row: the mean of the group's shards
            aux = aux / sequence.size
        result.loss = result.loss + router_aux_coef * aux * norm.dp_size
        result.metrics["moe/aux_loss"] = aux.detach()
    if with_log_probs:
        result.outputs.setdefault("log_probs", token_log_probs(model_out.logits, data["input_ids"], temperature))
    return result


def whole_row_logits(local, sequence: SequenceGroup, start: int, length: int):
    """What the loss reads as the row's logits: :class:`ShardedLogits` (log-probs made on this rank's positions,
    gathered), or a value model's values [1, T, 1] gathered whole (one number per position: no vocabulary)."""
    if isinstance(local, torch.Tensor) and local.shape[-1] == 1:
        return gather_positions(local, sequence)[:, :length]
    return ShardedLogits(local, sequence, start, length)


def _forward(model: nn.Module, fused: bool, **inputs):
    """The model's forward; with ``fused``, its ``logits`` are the hidden states and the output layer's
    weight they still need (:class:`LogitsFromHidden`)."""
    if not fused:
        return model(**inputs)
    with hidden_states_out() as call:
        model_out = model(**inputs)
    model_out.logits = LogitsFromHidden(model_out.logits, call.weight, call.bias)
    return model_out


class _Collector:
    """Sums metrics and gathers per-sample outputs over the non-empty micro-batches."""

    def __init__(self) -> None:
        self.totals: dict[str, torch.Tensor] = {}
        self.chunks: dict[str, list[torch.Tensor]] = {}

    def add(self, mb: MicroBatch, result: LossOutput) -> None:
        if mb.data is None:
            return
        for key, value in result.metrics.items():
            value, before = value.detach().float(), self.totals.get(key)
            if before is None:
                self.totals[key] = value
            else:
                self.totals[key] = torch.maximum(before, value) if is_maximum(key) else before + value
        for key, value in result.outputs.items():
            value = value.detach()
            self.chunks.setdefault(key, []).append(unpack(value, mb.packing) if mb.packing is not None else value)

    def result(self, plan: BatchPlan, **extra) -> ForwardBackwardResult:
        return ForwardBackwardResult(
            metrics={k: float(v) for k, v in self.totals.items()}
            | {"batch/real_tokens": float(plan.real_tokens), "batch/computed_tokens": float(plan.computed_tokens),
               "batch/shared_tokens": float(plan.shared_tokens),
               "batch/real_token_pairs": float(plan.real_token_pairs)},
            workloads=plan.workloads,
            outputs={
                k: restore_order(parts, plan.micro_batches, plan.seq_len) for k, parts in self.chunks.items()
            },
            num_microbatches=len(plan.micro_batches),
            workload_imbalance=_imbalance(plan.workloads),
            largest_tokens=plan.largest_tokens,
            **extra,
        )


def accumulate(
    model: nn.Module, plan: BatchPlan, loss_fn: LossFn, switches_of: SwitchesOf, *, device: torch.device,
    timeout_s: float, chunk_tokens: int, meter: PeakMeter | None = None, fused_head: bool = False,
    router_aux_coef: float = 0.0, sequence: SequenceGroup | None = None,
) -> ForwardBackwardResult:
    """Forward and backward of every micro-batch, each under the switches its mode gives it; gradients
    accumulate into ``.grad`` (or FSDP's unsynced buffers until the syncing micro-batch). Log-probs are
    computed ``chunk_tokens`` at a time."""
    model.train()
    collected, retained, gathered = _Collector(), 0, 0
    n = len(plan.micro_batches)
    for i, mb in enumerate(plan.micro_batches):
        if meter is not None:  # the positions this rank computes (sequence parallel: its share of the row)
            positions = (mb.positions or mb.data["input_ids"].numel()) if mb.data is not None else 0
            meter.before_microbatch(-(-positions // sequence.size) if sequence is not None else positions)
        what = f"micro-batch {i + 1}/{n} forward/backward (FSDP all-gather / reduce-scatter)"
        # sequence parallel: heads exchanged in backward's recomputation too (activation checkpointing)
        with collective_timeout(what, timeout_s), apply_switches(model, switches_of(i, n)), logprob_chunking(
            chunk_tokens
        ), sharded_forward(sequence) if sequence is not None else nullcontext():
            result = forward_microbatch(model, mb, loss_fn, plan.normalizer, device, with_log_probs=False,
                                        fused_head=fused_head, router_aux_coef=router_aux_coef, sequence=sequence)
            result.loss.backward()
        retained = max(retained, grad_bytes(model))
        gathered = max(gathered, unsharded_param_bytes(model))
        collected.add(mb, result)
    return collected.result(plan, retained_grad_bytes=retained, unsharded_param_bytes=gathered)


@torch.no_grad()
def forward_only(
    model: nn.Module, plan: BatchPlan, loss_fn: LossFn | None, *, device: torch.device, timeout_s: float,
    chunk_tokens: int, temperature: float = 1.0, fused_head: bool = False, with_log_probs: bool = True,
    sequence: SequenceGroup | None = None,
) -> ForwardBackwardResult:
    """Forward of every micro-batch under ``no_grad``, with ``log_probs`` [B, T-1] of softmax(logits /
    ``temperature``) in the outputs (``with_log_probs``: a value model has none). Gradients and sync switches
    are never touched; every gathered parameter is freed at the end."""
    model.eval()
    collected = _Collector()
    n = len(plan.micro_batches)
    try:
        for i, mb in enumerate(plan.micro_batches):
            what = f"micro-batch {i + 1}/{n} forward (FSDP all-gather)"
            with collective_timeout(what, timeout_s), logprob_chunking(chunk_tokens):
                result = forward_microbatch(
                    model, mb, loss_fn, plan.normalizer, device, with_log_probs=with_log_probs, temperature=temperature,
                    fused_head=fused_head, sequence=sequence,
                )
            collected.add(mb, result)
    except BaseException as error:
        clean_up_after(error, "the forward pass's clean-up (FSDP's trackers reset)",
                       lambda: fsdp.reset_after_forward_error(model))
        raise
    fsdp.reshard_all(model)
    return collected.result(plan)


def _imbalance(loads: list[float]) -> float:
    busy = [w for w in loads if w > 0]
    return max(busy) / min(busy) if busy else 1.0
