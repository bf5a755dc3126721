"""The training engine: micro-batched forward/backward whose gradients sync once per optimizer step.

Data flow of :meth:`Engine.train_batch` (one optimizer step on this rank's share of the batch)::

    zero grads -> split into micro-batches -> global normaliser (one all-reduce)
    -> for each micro-batch: with apply_policy(model, microbatch_policy(mode, i, n)): forward, loss, backward
    -> optimizer_step: grad norm (one all-reduce), clip, skip if non-finite, step
    -> metrics and the memory peak (one all-reduce), every collective counted and checked against the
       mode's formula
"""

from __future__ import annotations

import math
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .autosync import AutoSync
from .batching import (
    Batch,
    BatchError,
    MicroBatch,
    microbatches_needed,
    restore_order,
    sequence_lengths,
    split_batch,
    workloads,
)
from .comm import CollectiveCounter, expected_collectives
from .config import Config, OptimConfig
from .distributed import DistInfo, build_mesh, init_distributed, rank_and_world
from .losses import LossFn, LossOutput, Normalizer, target_mask, token_log_probs
from .memory import (
    PeakMeter,
    grad_bytes,
    local_tensor,
    resolve_budget,
    sharded_model_of,
    unsharded_param_bytes,
)
from .models import build_model
from .sync import (
    SyncMode,
    apply_policy,
    check_mode,
    discard_unsynced_grads,
    fsdp2_units,
    microbatch_policy,
    supported_modes,
)
from .wrap import WrappedModel, wrap_model


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within ``dist.timeout_s``: another rank is missing or stuck."""


@contextmanager
def _collective(name: str, timeout_s: float):
    """Turn a timed-out collective into an error that names this rank and the operation."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:
        text = str(exc)
        if isinstance(exc, dist.DistBackendError) or "timed out" in text.lower() or "timeout" in text.lower():
            rank, _ = rank_and_world()
            first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
            raise CollectiveTimeout(
                f"rank {rank}: {name} did not complete within dist.timeout_s={timeout_s:g}s; another rank is "
                f"missing, stuck or failed ({first})"
            ) from exc
        raise


class SyncNoOpError(RuntimeError):
    """The collectives counted in a step differ from what the sync mode should issue (``sync.strict``)."""


@dataclass
class ForwardBackwardResult:
    """What one pass over a batch produced on this rank."""

    metrics: dict[str, float]  # loss-function metrics summed over micro-batches (this rank's share)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # per sample, original order
    num_microbatches: int = 0
    retained_grad_bytes: int = 0  # most gradient bytes held after any micro-batch's backward
    unsharded_param_bytes: int = 0  # most all-gathered parameter bytes held after any backward
    workload_imbalance: float = 1.0  # max / min estimated compute over this rank's non-empty micro-batches


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.name: {cfg.name!r} is not one of adamw, sgd")


class Engine:
    """FSDP2 / FSDP1 / DDP / single-process training of a causal LM with deferred gradient sync.

    Build it inside an initialised process group (``syncwise.distributed.init_distributed`` or the local
    launcher). ``model`` defaults to the one ``config.model`` describes; pass your own (fp32, on CPU,
    identical on every rank) to wrap it instead.
    """

    def __init__(
        self,
        config: Config,
        model: nn.Module | None = None,
        info: DistInfo | None = None,
        *,
        trainable: bool = True,
        total_steps: int | None = None,
    ):
        """``trainable=False`` builds a forward-only engine (a frozen reference model: no optimizer).
        ``total_steps`` sets the length of ``optim.schedule=cosine``."""
        self.config = config.validate()
        self.info = info or init_distributed(config.dist.backend, config.dist.timeout_s)
        self.sync_mode = SyncMode(config.sync.mode)  # as configured; may be AUTO
        raw = model if model is not None else build_model(config.model)
        # The unwrapped model's Hugging Face config (exports, rollouts); None for a plain nn.Module.
        self.hf_config = getattr(raw, "config", None)
        mesh = None
        if config.engine.strategy in ("fsdp2", "fsdp1"):
            mesh = build_mesh(self.info, config.engine.hsdp_replicas)
        hsdp = mesh is not None and mesh.ndim == 2
        check_mode(self.sync_mode, config.engine.strategy, hsdp)
        self.wrapped: WrappedModel = wrap_model(raw, config.engine, config.model, self.info.device, mesh)
        self.model = self.wrapped.module
        self.trainable = trainable
        self.optimizer = build_optimizer(self.model.parameters(), config.optim) if trainable else None
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps) if trainable else None
        if not trainable:
            self.model.requires_grad_(False)
        self.step = 0
        self.skipped_steps = 0
        self.memory_model = sharded_model_of(
            self.wrapped.units, self.wrapped.shard_size, config.model.param_dtype, config.model.reduce_dtype
        )
        self.auto: AutoSync | None = None
        self.active_mode = self.sync_mode  # the concrete mode the next step runs
        self.peak_measurable = PeakMeter.supported(self.model, self.info.device)
        if self.sync_mode is SyncMode.AUTO:
            if not self.peak_measurable:
                raise ValueError(
                    "sync.mode=auto decides from a measured memory peak, which is not available for "
                    "engine.strategy=fsdp1 on CPU; choose sync.mode=deferred or per_microbatch"
                )
            budget = resolve_budget(
                config.sync.memory_budget, self.info.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            )
            self.auto = AutoSync(self.memory_model, supported_modes(self.wrapped.strategy, hsdp), budget)
            self.active_mode = SyncMode.PER_MICROBATCH  # the safe mode measures the first step
        self._warned_mismatch = False
        self._peak_meter: PeakMeter | None = None
        self._base_peak: int | None = None  # measured peak minus the mode's held extra (per_microbatch's)

    # ----------------------------------------------------------------------------------------------
    # forward / backward
    # ----------------------------------------------------------------------------------------------
    def forward_backward_batch(
        self, batch: Batch, loss_fn: LossFn | None = None, forward_only: bool = False
    ) -> ForwardBackwardResult:
        """Run every micro-batch of ``batch`` forward (and backward unless ``forward_only``).

        Gradients accumulate into ``.grad``; each micro-batch runs with the FSDP switches of the active
        sync mode (``deferred``: only the last micro-batch communicates). Forward-only passes (log-probs,
        evaluation) run under ``no_grad`` and never touch the sync state. Returns summed loss metrics and
        per-sample outputs in the original order: always ``log_probs`` [B, T-1] when ``forward_only``,
        plus whatever the loss function returns.
        """
        if not forward_only and loss_fn is None:
            raise ValueError("forward_backward_batch: a loss_fn is needed unless forward_only=True")
        if not forward_only and not self.trainable:
            raise ValueError("this engine was built with trainable=False: forward_only passes only")
        batch = {k: v.to(self.info.device) for k, v in batch.items()} if _is_batch(batch) else batch
        micro_batches, norm = self._prepare(batch, require_tokens=not forward_only)
        target_width = batch["input_ids"].shape[1] - 1
        self.model.train(not forward_only)
        totals: dict[str, torch.Tensor] = {}
        chunks: dict[str, list[torch.Tensor]] = {}
        n = len(micro_batches)
        retained = unsharded = 0
        mode = self.active_mode
        unsharded_forward = self.config.sync.unsharded_forward
        try:
            for i, mb in enumerate(micro_batches):
                if self._peak_meter is not None:
                    self._peak_meter.before_microbatch()
                if forward_only:
                    with torch.no_grad():
                        result = self._forward(mb.data, loss_fn, norm, with_log_probs=True)
                else:
                    with (
                        _collective(f"micro-batch {i + 1}/{n} forward/backward (FSDP all-gather / reduce-scatter)",
                                    self.config.dist.timeout_s),
                        apply_policy(self.model, microbatch_policy(mode, i, n, unsharded_forward)),
                    ):
                        result = self._forward(mb.data, loss_fn, norm, with_log_probs=False)
                        result.loss.backward()
                    retained = max(retained, grad_bytes(self.model))
                    unsharded = max(unsharded, unsharded_param_bytes(self.model))
                if mb.data is None:
                    continue
                for key, value in result.metrics.items():
                    totals[key] = totals.get(key, 0.0) + value.detach().float()
                for key, value in result.outputs.items():
                    chunks.setdefault(key, []).append(value.detach())
        except BaseException:
            self._recover_from_error()
            raise
        outputs = {key: restore_order(parts, micro_batches, target_width) for key, parts in chunks.items()}
        return ForwardBackwardResult(
            metrics={k: float(v) for k, v in totals.items()},
            outputs=outputs,
            num_microbatches=n,
            retained_grad_bytes=retained,
            unsharded_param_bytes=unsharded,
            workload_imbalance=_workload_imbalance(micro_batches, self.config.engine.workload_linear_coef),
        )

    def _forward(
        self, data: Batch | None, loss_fn: LossFn | None, norm: Normalizer, with_log_probs: bool
    ) -> LossOutput:
        if data is None:
            # An empty micro-batch (this rank has fewer samples than the agreed count): a one-token dummy
            # forward whose zero loss still runs every FSDP unit, so the collectives match the other ranks.
            dummy = torch.zeros((1, 2), dtype=torch.long, device=self.info.device)
            logits = self.model(input_ids=dummy).logits
            return LossOutput(loss=logits.float().sum() * 0.0)
        model_out = self.model(input_ids=data["input_ids"], attention_mask=data.get("attention_mask"))
        if loss_fn is not None:
            result = loss_fn(model_out, data, norm)
        else:
            result = LossOutput(loss=torch.zeros((), device=self.info.device))
        if with_log_probs:
            result.outputs.setdefault("log_probs", token_log_probs(model_out.logits, data["input_ids"]))
        return result

    def _prepare(self, batch: Batch, require_tokens: bool) -> tuple[list[MicroBatch], Normalizer]:
        """Validate the batch, agree with the other ranks in one all-reduce, then split it.

        The all-reduce carries the loss-token and sequence counts (the global normaliser), an error flag
        (a rank with bad input makes every rank raise instead of leaving the others waiting) and, in one
        slot per rank, each rank's micro-batch count and longest loss span. Every rank then runs the
        largest count, so deferred collectives line up even when ranks hold different amounts of data.
        """
        cfg = self.config.engine
        error: BatchError | None = None
        sums, own = [0.0, 0.0, 0.0], [0.0, 0.0]  # [tokens, sequences, bad ranks], [micro-batches, longest span]
        try:
            needed = microbatches_needed(batch, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
            per_sequence = target_mask(batch).sum(dim=1)
            sums[:2] = [float(per_sequence.sum()), float((per_sequence > 0).sum())]
            own = [float(needed), float(per_sequence.max())]
        except BatchError as exc:
            error = exc
            sums[2] = 1.0
        totals, per_rank = self._all_reduce_with_rank_slots(
            sums, own, "the all-reduce of batch statistics (start of the step)"
        )
        if error is not None:
            raise error
        if totals[2] > 0:
            raise BatchError(f"batch: invalid on {int(totals[2])} other rank(s); see the error raised there")
        if require_tokens and totals[0] == 0:
            raise BatchError(
                "batch: loss_mask (or attention_mask) leaves no target token on any rank: nothing to train on"
            )
        num_microbatches = int(per_rank[:, 0].max())
        micro_batches = split_batch(
            batch, num_microbatches, balance=cfg.max_tokens_per_micro_batch > 0,
            linear_coef=cfg.workload_linear_coef,
        )
        norm = Normalizer(
            tokens=float(totals[0]), sequences=float(totals[1]), dp_size=self.wrapped.dp_size,
            max_target_len=float(per_rank[:, 1].max()),
        )
        return micro_batches, norm

    def _recover_from_error(self) -> None:
        """After an exception mid-step: drop partial gradients (also FSDP2's unsynced ones) and FSDP2's
        per-iteration state, so the next step starts clean."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        for unit in fsdp2_units(self.model):
            if unit._get_fsdp_state()._is_root and hasattr(unit, "reset_iter_state"):
                unit.reset_iter_state()
        discard_unsynced_grads(self.model)

    # ----------------------------------------------------------------------------------------------
    # optimizer
    # ----------------------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients, correct for sharded (FSDP1/FSDP2) and replicated ones.

        Each rank sums the squares of its local gradient shards; one all-reduce over the shard group adds
        them up (HSDP replicas hold the same shards, so they are not added again).
        """
        grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        device = self.info.device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        if self.wrapped.strategy in ("fsdp2", "fsdp1"):
            mesh = self.wrapped.mesh
            group = mesh.get_group("shard") if mesh is not None else None
            with _collective("the gradient-norm all-reduce", self.config.dist.timeout_s):
                dist.all_reduce(sq, group=group)
        return sq.sqrt()

    def optimizer_step(self) -> float:
        """Clip to ``optim.grad_clip``, step, and zero the gradients. Returns the pre-clip grad norm.

        A non-finite norm skips the update (gradients are zeroed, ``skipped_steps`` counts it).
        """
        norm = self.grad_norm()
        norm_value = float(norm)
        if not math.isfinite(norm_value):
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            return norm_value
        clip = self.config.optim.grad_clip
        if clip > 0 and norm_value > clip:
            grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, clip / (norm_value + 1e-6))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm_value

    def train_batch(self, batch: Batch, loss_fn: LossFn) -> dict[str, Any]:
        """One optimizer step on ``batch``; returns metrics reduced over ranks (same dict on every rank).

        ``comm/*`` count every collective of the step (forward, backward, normaliser, grad norm and the
        metrics reduction); ``comm/expected_*`` give the formula's count for the mode. A mismatch -- the
        sync switches silently did nothing -- warns once, or raises :class:`SyncNoOpError` with
        ``sync.strict``. Under ``sync.mode=auto`` the step also measures memory and may change the mode
        of the steps that follow (``sync/decision`` says why).
        """
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        skipped_before = self.skipped_steps
        mode = self.active_mode
        meter = self._meter_for_step()
        with CollectiveCounter() as counter:
            self._peak_meter = meter
            try:
                with meter if meter is not None else nullcontext():
                    result = self.forward_backward_batch(batch, loss_fn)
                    grad_norm = self.optimizer_step()
            finally:
                self._peak_meter = None
            local_peak, measured = self._local_peak(result, meter)
            metrics, peak = self._reduce_step(result.metrics, local_peak)
            memory = self._memory_metrics(result, peak, measured, mode)
        elapsed = time.perf_counter() - start
        metrics.update(
            {
                "train/step": self.step,
                "train/grad_norm": grad_norm,
                "train/skipped": self.skipped_steps - skipped_before,
                "train/num_microbatches": result.num_microbatches,
                "batch/workload_imbalance": result.workload_imbalance,
                "train/step_time_s": elapsed,
                "train/lr": self.scheduler.get_last_lr()[0],
                "sync/mode": mode.value,
                **memory,
            }
        )
        metrics.update(counter.totals.as_metrics())
        expected = self.expected_collectives(result.num_microbatches, mode)
        if expected is not None:
            metrics.update({f"comm/expected_{kind}_count": count for kind, count in expected.items()})
            self._check_collectives(counter.totals.counts, expected, mode)
        if self.auto is not None:
            metrics["sync/decision"] = self._auto_after_step(memory, mode, result.num_microbatches)
            metrics["sync/next_mode"] = self.active_mode.value
        return metrics

    def _meter_for_step(self) -> PeakMeter | None:
        """A peak meter when a true peak is due: every step on CUDA (the allocator's counter is free); on
        CPU the first step and then every ``sync.peak_every`` steps (the tracker sees every op: slow)."""
        if not self.peak_measurable:
            return None
        every = self.config.sync.peak_every
        due = self._base_peak is None or (every > 0 and self.step % every == 0)
        if self.info.device.type == "cuda" or due:
            return PeakMeter(self.model, self.optimizer, self.info.device)
        return None

    def _local_peak(self, result: ForwardBackwardResult, meter: PeakMeter | None) -> tuple[int | None, int]:
        """This rank's memory peak for the step and whether it was measured (1) or estimated (0): on CPU
        between measured steps, the last measured base plus the sync bytes measured from the tensors.
        (None for FSDP1 on CPU, where the tracker cannot follow its flat-parameter views.)"""
        if not self.peak_measurable:
            return None, 0
        if meter is not None:
            return meter.peak, 1
        baseline = self.memory_model.retained_grad_bytes(SyncMode.PER_MICROBATCH, result.num_microbatches)
        held_extra = max(0, result.retained_grad_bytes - baseline) + result.unsharded_param_bytes
        return self._base_peak + held_extra, 0

    def _memory_metrics(
        self, result: ForwardBackwardResult, peak: int | None, measured: int, mode: SyncMode
    ) -> dict[str, Any]:
        memory: dict[str, Any] = {
            "memory/retained_grad_bytes": result.retained_grad_bytes,
            "memory/unsharded_param_bytes": result.unsharded_param_bytes,
        }
        if peak is None:
            return memory
        if measured:
            self._base_peak = peak - self.memory_model.extra_bytes(mode, result.num_microbatches)
        memory.update({"memory/peak_bytes": peak, "memory/peak_measured": measured})
        if self.auto is not None:
            memory["memory/budget_bytes"] = self.auto.budget
        return memory

    def _auto_after_step(self, memory: dict[str, Any], mode: SyncMode, num_microbatches: int) -> str:
        peak = memory["memory/peak_bytes"]
        decisions = len(self.auto.decisions)
        if not self.auto.decided:
            self.active_mode = self.auto.decide(peak, mode, num_microbatches)
        else:
            self.active_mode = self.auto.observe(peak, num_microbatches)
        if len(self.auto.decisions) > decisions and self.info.is_main:
            print(f"syncwise: {self.auto.decisions[-1]}", flush=True)
        return self.auto.decisions[-1] if len(self.auto.decisions) > decisions else ""

    def _check_collectives(self, counted: dict[str, int], expected: dict[str, int], mode: SyncMode) -> None:
        if counted == expected:
            return
        message = (
            f"sync.mode={mode.value}: counted collectives {counted} differ from the expected {expected}; "
            "the sync switches may be doing nothing (see docs/perf_tuning.md)"
        )
        if self.config.sync.strict:
            raise SyncNoOpError(message)
        if not self._warned_mismatch:
            self._warned_mismatch = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _reduce_step(self, local: dict[str, float], peak: int | None) -> tuple[dict[str, float], int | None]:
        """One all-reduce for a step's loss metrics (summed) and each rank's memory peak, whose max every
        rank then takes: the same agreed peak everywhere, so ``auto`` decides alike. Keys are sorted so
        every rank packs alike."""
        keys = sorted(local)
        totals, per_rank = self._all_reduce_with_rank_slots(
            [local[k] for k in keys], [float(peak or 0)], "the metrics all-reduce (end of the step)"
        )
        metrics = dict(zip(keys, totals.tolist(), strict=True))
        return metrics, (int(per_rank.max()) if peak is not None else None)

    def _all_reduce_with_rank_slots(
        self, sums: list[float], own: list[float], what: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In one all-reduce, sum ``sums`` over ranks and share every rank's ``own`` values (each rank
        writes them into its own slot, zeros elsewhere). Returns (the sums, own values as [world, k])."""
        rank, world = rank_and_world()
        values = torch.zeros(len(sums) + world * len(own), dtype=torch.float64)
        values[: len(sums)] = torch.tensor(sums, dtype=torch.float64)
        start = len(sums) + rank * len(own)
        values[start : start + len(own)] = torch.tensor(own, dtype=torch.float64)
        if dist.is_initialized():
            values = values.to(self.info.device)
            with _collective(what, self.config.dist.timeout_s):
                dist.all_reduce(values)
            values = values.cpu()
        return values[: len(sums)], values[len(sums) :].view(world, len(own))

    def expected_collectives(self, num_microbatches: int, mode: SyncMode | None = None) -> dict[str, int] | None:
        """The collective counts one ``train_batch`` in ``mode`` (default: the active one) should produce
        (FSDP strategies), else None."""
        if self.wrapped.strategy not in ("fsdp2", "fsdp1"):
            return None
        return expected_collectives(
            (mode or self.active_mode).value,
            num_microbatches,
            self.wrapped.num_units,
            reshard_after_forward=self.config.engine.reshard_after_forward,
            unsharded_forward=self.config.sync.unsharded_forward,
            hsdp=self.wrapped.hsdp,
            sharded=self.wrapped.shard_size > 1,
            engine_all_reduces=3,  # loss normaliser, grad norm, metrics with the memory peak
        )

    # ----------------------------------------------------------------------------------------------
    # evaluation and state
    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_batch(self, batch: Batch, loss_fn: LossFn | None = None) -> ForwardBackwardResult:
        """Forward-only pass (log-probs, validation loss). Never touches gradients or sync state."""
        result = self.forward_backward_batch(batch, loss_fn, forward_only=True)
        result.metrics = self._reduce_step(result.metrics, None)[0]
        return result

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state (sharded DTensors under FSDP2), for ``torch.distributed.checkpoint``."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    def engine_state(self) -> dict[str, Any]:
        """Everything else a resumed run needs to continue exactly (JSON-serialisable): the step count,
        the LR schedule's position, and auto's decision and measured base, so the resumed run does not
        re-measure in another mode."""
        state: dict[str, Any] = {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "active_mode": self.active_mode.value,
            "base_peak": self._base_peak,
        }
        if self.auto is not None:
            state["auto"] = {
                "base_peak": self.auto.base_peak, "ceiling": self.auto.ceiling, "mode": self.auto.mode.value,
                "decisions": self.auto.decisions,
            }
        return state

    def load_engine_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.active_mode = SyncMode(state["active_mode"])
        self._base_peak = state.get("base_peak")
        if self.auto is not None and state.get("auto"):
            auto = state["auto"]
            self.auto.base_peak, self.auto.ceiling = auto["base_peak"], int(auto["ceiling"])
            self.auto.mode, self.auto.decisions = SyncMode(auto["mode"]), list(auto["decisions"])


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int | None
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over ``warmup_steps``, then constant or cosine decay to 10% at ``total_steps``."""
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "cosine" and total_steps:
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _workload_imbalance(micro_batches: list[MicroBatch], linear_coef: float) -> float:
    loads = [sum(workloads(sequence_lengths(mb.data), linear_coef)) for mb in micro_batches if mb.data is not None]
    return max(loads) / min(loads) if loads and min(loads) > 0 else 1.0


def _is_batch(batch: Any) -> bool:
    return isinstance(batch, dict) and all(isinstance(v, torch.Tensor) for v in batch.values())
