"""The training engine: micro-batched forward/backward whose gradients sync once per optimizer step.

One optimizer step (:meth:`Engine.train_batch`), and the module each part lives in::

    plan the batch: validate, agree with every rank (one all-reduce), split      planning.py
    for each micro-batch: forward + backward under its mode's switches           step.py
    grad norm (one all-reduce), clip, skip if non-finite, step                   optim.py
    metrics, memory peak and budget agreed (one all-reduce)                      here
    collectives counted vs the mode's schedule                                   audit.py
    memory metered; auto chooses / steps down                                    governor.py

``Engine`` itself only holds the pieces together.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..config import SHARDED_STRATEGIES, Config
from ..data import attention
from ..data.batching import Batch, BatchError
from ..losses import LossFn
from ..memory.accounting import resident_bytes, sharded_model_of
from ..memory.activations import shared_read_cost
from ..memory.autosync import LONGEST, Setting
from ..memory.meter import PeakMeter
from ..memory.schedule import unit_traffic
from ..memory.units import configured_choice, unit_names
from ..models import build_model
from ..models.moe import summarise as summarise_routes
from ..runtime.distributed import CollectiveTimeout, DistInfo, build_mesh, init_distributed
from ..runtime.errors import clean_up_after
from ..sync import fsdp_internals as fsdp
from ..sync.counting import CollectiveCounter
from ..sync.modes import SyncChoice, SyncMode, as_choice, check_mode, supported_modes
from ..sync.switches import switches_of
from .audit import StepAudit, SyncNoOpError
from .features import ModelFeatures, model_features
from .governor import MemoryGovernor
from .optim import build_optimizer, build_scheduler, clip_and_step, global_grad_norm
from .planning import BatchPlan, plan_batch
from .reduce import reduce_step
from .sequence_parallel import gather_batch, own_share, sequence_group
from .state import load_model_and_optim_state, load_resume_state, model_and_optim_state, resume_state
from .step import ForwardBackwardResult, accumulate, forward_only
from .tuning import build_tuning
from .weights import full_weights_by_unit
from .wrap import DTYPE_BY_NAME, WrappedModel, wrap_model

__all__ = ["CollectiveTimeout", "Engine", "ForwardBackwardResult", "SyncNoOpError", "build_optimizer",
           "build_scheduler"]


class Engine:
    """FSDP2 / FSDP1 / DDP / single-process training of a causal LM with deferred gradient sync.

    Build it inside an initialised process group (``syncwise.runtime.distributed.init_distributed`` or the local
    launcher). ``model`` defaults to the one ``config.model`` describes; pass your own (fp32, on CPU,
    identical on every rank) to wrap it instead. ``trainable=False`` builds a forward-only engine (a frozen
    reference model: no optimizer); ``total_steps`` sets the length of ``optim.schedule=cosine``;
    ``features``: what the model supports (:func:`~syncwise.engine.features.model_features`, the default).
    """

    def __init__(
        self, config: Config, model: nn.Module | None = None, info: DistInfo | None = None, *,
        trainable: bool = True, total_steps: int | None = None, features: ModelFeatures | None = None,
    ):
        self.config = config.validate()
        self.info = info or init_distributed(config.dist.backend, config.dist.timeout_s)
        self.sync_mode = SyncMode(config.sync.mode)  # as configured; may be AUTO
        raw = model if model is not None else build_model(config.model, deferred=True)
        if not trainable:
            raw.requires_grad_(False)
        # The model described once (what it supports, its layers, its FLOPs): nothing below asks it again.
        self.features = features or model_features(raw, config, self.info.device, self.info.is_main)
        # what rows reading a shared start keep beyond their tokens, for the memory the plan counts
        self._read_cost = shared_read_cost(self.features.hf_config) if self.features.share_prefixes else (0.0, 0.0)
        sharded = config.engine.strategy in SHARDED_STRATEGIES
        mesh = build_mesh(self.info, config.engine.hsdp_replicas) if sharded else None
        hsdp = mesh is not None and mesh.ndim == 2
        check_mode(self.sync_mode, config.engine.strategy, hsdp)
        self.flops = self.features.flops
        # sequence parallelism: this rank's group, which trains its ranks' batches together (1/N of each row here)
        self.sequence = sequence_group(self.info, config.dist.sequence_parallel, self.features)
        role = ("the critic (value model)" if self.features.value_head else "the trained model") if trainable \
            else "a frozen model (the reference)"
        self.wrapped: WrappedModel = wrap_model(raw, config.engine, config.model, self.info.device, mesh, role,
                                                self.features.layer_classes)
        self.model = self.wrapped.module
        self.trainable = trainable
        self.optimizer = build_optimizer(self.model.parameters(), config.optim) if trainable else None
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps) if trainable else None
        self.step = 0
        self.skipped_steps = 0
        # a mixture of experts: its router's load-balancing loss x this in every training micro-batch (the job's)
        self.router_aux_coef = 0.0
        self.memory_model = sharded_model_of(
            self.wrapped.units, self.wrapped.shard_size, config.model.param_dtype, config.model.reduce_dtype,
            flat_units=self.wrapped.strategy == "fsdp1",
        )
        self.audit = StepAudit(
            unit_traffic(self.memory_model, hsdp), config.engine.reshard_after_forward, config.sync.unsharded_forward,
            hsdp, sharded=self.wrapped.shard_size > 1, strict=config.sync.strict,
        ) if self.wrapped.sharded else None
        self.supported_modes = supported_modes(self.wrapped.strategy, hsdp)
        configured = (configured_choice(self.sync_mode, unit_names(self.model, self.wrapped.units),
                                        config.sync.deferred_units, self.memory_model)
                      if self.sync_mode is not SyncMode.AUTO else None)
        tuning = build_tuning(  # the LM head's path and the token cap, where auto chooses them too
            config, self.features, self.memory_model, self.audit.traffic if self.audit is not None else None,
            DTYPE_BY_NAME[config.model.param_dtype] if sharded else next(raw.parameters()).dtype,
            self.info.device, trainable, PeakMeter.supported(self.model, self.info.device), self.info.is_main)
        self.governor = MemoryGovernor(self.model, self.optimizer, self.info.device, self.memory_model, config.sync,
                                       self.supported_modes, configured, tuning, self.features.layer_classes)
        # What the next step runs: a concrete mode (and, for partial, its units), the LM head's path, the cap.
        self.active_mode: SyncChoice = configured or SyncChoice(SyncMode.PER_MICROBATCH)
        self.fused_head, self.token_cap = self.features.fused_head, None  # None: the config's split
        if self.governor.setting is not None:
            self._use(self.governor.setting)
        self._peak_meter = None  # set by train_batch while a step is metered
        # Per-sample outputs of the last train_batch (what its loss returned, e.g. ``log_probs`` taken with the
        # weights before that step), in batch order: an on-policy trainer needs no extra forward for them.
        self.step_outputs: dict[str, torch.Tensor] = {}
        self.checkpoint_frozen = False  # LoRA: the frozen base changed since it was built (checkpoints hold it)

    # ----------------------------------------------------------------------------------------------
    # passes over a batch
    # ----------------------------------------------------------------------------------------------
    def _plan(self, batch: Batch, require_tokens: bool, loss_fn: LossFn | None = None,
              token_cap: int | None = None, rejected: BatchError | None = None) -> BatchPlan:
        batch = {k: v.to(self.info.device) for k, v in batch.items()} if _is_batch(batch) else batch
        token_cap = token_cap or self.token_cap
        hf = self.features.hf_config
        return plan_batch(
            batch, self.config.engine, dp_size=self.wrapped.dp_size, device=self.info.device,
            timeout_s=self.config.dist.timeout_s, require_tokens=require_tokens, packing=self.features.packing,
            share_prefixes=self.features.share_prefixes, read_cost=self._read_cost,
            varlen_attention=str(getattr(hf, "_attn_implementation", "")).startswith(("flash", attention.NAME)),
            vocab_size=getattr(hf, "vocab_size", None), max_positions=getattr(hf, "max_position_embeddings", None),
            loss_fn=loss_fn, split=(0, token_cap) if token_cap else None, stretch_cap=bool(token_cap),
            replicas=self.sequence.size if self.sequence is not None else 1, rejected=rejected,
        )

    def _group_batch(self, batch: Batch) -> tuple[Batch, slice | None, BatchError | None]:
        """Sequence parallelism: the group's batch, where this rank's rows are in it (None: this rank's own), and
        why the group's batches do not join (raised by the plan on every rank, not here: the others would wait)."""
        if self.sequence is None or not _is_batch(batch):
            return batch, None, None
        try:
            return *gather_batch(batch, self.sequence, self.config.dist.timeout_s), None
        except BatchError as exc:
            return batch, None, exc

    def _own(self, result: ForwardBackwardResult, rows: slice | None) -> ForwardBackwardResult:
        return own_share(result, rows, self.sequence) if rows is not None else result

    def _use(self, setting: Setting) -> None:
        """Run the next steps in ``setting`` (auto's choice): its sync mode, and its head and cap if auto's."""
        self.active_mode = setting.choice
        if setting.fused_head is not None:
            self.fused_head = setting.fused_head
        if setting.cap is not None:
            self.token_cap = setting.cap

    def forward_backward_batch(
        self, batch: Batch, loss_fn: LossFn | None = None, forward_only: bool = False
    ) -> ForwardBackwardResult:
        """Run every micro-batch of ``batch`` forward and backward (``forward_only``: see
        :meth:`forward_batch`).

        Gradients accumulate into ``.grad``; each micro-batch runs with the FSDP switches of the active
        sync mode (``deferred``: only the last micro-batch communicates). Returns summed loss metrics and
        per-sample outputs in the original order. If an exception escapes, switches are restored, every
        gradient of the step is dropped and FSDP2's iteration state is reset.
        """
        if forward_only:
            return self.forward_batch(batch, loss_fn)
        if loss_fn is None:
            raise ValueError("forward_backward_batch: a loss_fn is needed unless forward_only=True")
        if not self.trainable:
            raise ValueError("this engine was built with trainable=False: forward_only passes only")
        batch, rows, rejected = self._group_batch(batch)
        plan = self._plan(batch, require_tokens=True, loss_fn=loss_fn, rejected=rejected)
        switches = switches_of(self.active_mode, self.wrapped.units, self.config.sync.unsharded_forward)
        try:
            return self._own(accumulate(
                self.model, plan, loss_fn, switches, device=self.info.device,
                timeout_s=self.config.dist.timeout_s, chunk_tokens=self.config.engine.logprob_chunk_size,
                meter=self._peak_meter, fused_head=self.fused_head, router_aux_coef=self.router_aux_coef,
                sequence=self.sequence,
            ), rows)
        except BaseException as error:
            clean_up_after(error, "the step's clean-up (gradients dropped, FSDP's iteration state reset)",
                           lambda: (self.optimizer.zero_grad(set_to_none=True), fsdp.reset_after_error(self.model)))
            raise

    def forward_batch(
        self, batch: Batch, loss_fn: LossFn | None = None, temperature: float = 1.0, token_cap: int | None = None
    ) -> ForwardBackwardResult:
        """Forward-only pass (log-probs, evaluation): ``log_probs`` [B, T-1] of softmax(logits /
        ``temperature``) always in the outputs (not for a value model: ``features.value_head``), plus what
        ``loss_fn`` returns. Never touches gradients or sync state, also when it fails. ``token_cap``: the
        micro-batches' cap for this pass where another engine chose it (a frozen reference decides none of its own
        and would split by the config's fixed size: many more micro-batches, each gathering every unit again)."""
        batch, rows, rejected = self._group_batch(batch)
        plan = self._plan(batch, require_tokens=False, loss_fn=loss_fn, token_cap=token_cap, rejected=rejected)
        return self._own(forward_only(
            self.model, plan, loss_fn, device=self.info.device, timeout_s=self.config.dist.timeout_s,
            chunk_tokens=self.config.engine.logprob_chunk_size, temperature=temperature,
            fused_head=self.fused_head, with_log_probs=not self.features.value_head, sequence=self.sequence,
        ), rows)

    # ----------------------------------------------------------------------------------------------
    # optimizer
    # ----------------------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients (one all-reduce over the shard group for FSDP)."""
        mesh = self.wrapped.mesh
        group = mesh.get_group("shard") if self.wrapped.sharded and mesh is not None else None
        return global_grad_norm(self.model, group, self.wrapped.sharded, self.info.device, self.config.dist.timeout_s)

    def optimizer_step(self) -> float:
        """Clip to ``optim.grad_clip``, step, and zero the gradients. Returns the pre-clip grad norm.
        A non-finite norm skips the update (gradients are zeroed, ``skipped_steps`` counts it)."""
        norm = float(self.grad_norm())
        if clip_and_step(self.model, self.optimizer, self.scheduler, norm, self.config.optim.grad_clip):
            self.step += 1
        else:
            self.skipped_steps += 1
        return norm

    def train_batch(self, batch: Batch, loss_fn: LossFn) -> dict[str, Any]:
        """One optimizer step on ``batch``; returns metrics reduced over ranks (same dict on every rank).

        ``comm/*`` count every collective of the step (forward, backward, normaliser, grad norm and the
        metrics reduction); ``comm/expected_*`` give the mode's schedule. A mismatch -- the sync switches
        silently did nothing -- warns once, or raises :class:`SyncNoOpError` with ``sync.strict``. Under
        ``sync.mode=auto`` the step also measures memory and may change the mode of the steps that follow
        (``sync/decision`` says why).
        """
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        skipped_before, mode, fused = self.skipped_steps, self.active_mode, self.fused_head
        cap = self.token_cap or self.config.engine.fixed_split[1]
        meter = self.governor.meter_for_step(self.step)
        with CollectiveCounter() as counter:
            self._peak_meter = meter
            try:
                with meter if meter is not None else nullcontext():
                    result = self.forward_backward_batch(batch, loss_fn)
                    if meter is not None:  # what the setting changes ends here; the optimizer's peak follows
                        meter.mark_backward_end()
                    grad_norm = self.optimizer_step()
            finally:
                self._peak_meter = None
            self.step_outputs = result.outputs
            peak, measured = self.governor.local_peak(result, meter, mode)  # (files its maxima in result.metrics)
            metrics, agreed = reduce_step(result.metrics, peak, self.governor.own_budget, result.workloads,
                                          self.info.device, self.config.dist.timeout_s)
        peak, budget, stop = agreed["peak"], agreed["budget"], agreed["stop"]
        memory, next_setting = self.governor.after_step(result, metrics, peak, budget, measured, mode,
                                                        self.info.is_main, batch, time.perf_counter() - started)
        if next_setting is not None:
            self._use(next_setting)
        metrics.update({
            "train/step": self.step,
            "train/grad_norm": grad_norm,
            "train/skipped": self.skipped_steps - skipped_before,
            "train/num_microbatches": result.num_microbatches,
            "batch/workload_imbalance": result.workload_imbalance,
            "batch/cross_rank_imbalance": agreed["cross_rank_imbalance"],
            "batch/padding_fraction": 1.0 - (metrics["batch/real_tokens"] - metrics["batch/shared_tokens"])
            / max(metrics["batch/computed_tokens"], 1.0),
            "train/step_time_s": time.perf_counter() - started,
            "perf/useful_flops": self.flops.step(metrics["batch/real_tokens"], metrics["batch/real_token_pairs"]),
            "train/lr": self.scheduler.get_last_lr()[0],
            "sync/mode": mode.label,
            "engine/fused_lm_head": float(fused),
            # the longest-sequence cap (auto's first step) as it stretched: the largest micro-batch over the ranks
            "engine/max_tokens_per_micro_batch": memory["batch/largest_microbatch_tokens"] if cap == LONGEST else cap,
            "stop/signal": stop,
            **memory,
            **counter.totals.as_metrics(),
        })
        if self.audit is not None:
            metrics.update(self.audit.check(counter.totals.counts, mode, result.num_microbatches))
        summarise_routes(metrics)  # a mixture of experts: its experts' load, replayed routes' agreement
        return metrics

    def expected_collectives(
        self, num_microbatches: int, mode: SyncMode | SyncChoice | None = None
    ) -> dict[str, int] | None:
        """The collective counts one ``train_batch`` in ``mode`` (default: the active one) should produce
        (FSDP strategies), else None."""
        choice = as_choice(mode) if mode is not None else self.active_mode
        return self.audit.expected(choice, num_microbatches) if self.audit is not None else None

    def resident_bytes(self) -> int:
        """This rank's bytes of the model and its optimizer state, held between steps (what another engine
        beside this one must budget around)."""
        return resident_bytes(self.model, self.optimizer)

    # ----------------------------------------------------------------------------------------------
    # evaluation and state
    # ----------------------------------------------------------------------------------------------
    def eval_batch(self, batch: Batch, loss_fn: LossFn | None = None) -> ForwardBackwardResult:
        """Forward-only pass with its loss metrics reduced over ranks. Never touches gradients or sync state."""
        result = self.forward_batch(batch, loss_fn)
        result.metrics = reduce_step(result.metrics, None, 0, (), self.info.device, self.config.dist.timeout_s)[0]
        summarise_routes(result.metrics)
        return result

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state (sharded DTensors under FSDP2), for ``torch.distributed.checkpoint``.
        With LoRA, the adapters and their optimizer state only (and the base, with ``checkpoint_frozen``)."""
        return model_and_optim_state(self.model, self.optimizer, self.features.lora, self.checkpoint_frozen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_model_and_optim_state(self.model, self.optimizer, state, self.features.lora, self.checkpoint_frozen)

    def full_model_state(self, cpu_offload: bool = False, merge: bool = True) -> dict[str, torch.Tensor]:
        """Collective: the whole model's unsharded weights, keyed as the plain Hugging Face model's (LoRA
        adapters merged into their weights as peft merges them: ``features.lora_merge``), for the rollout copy and
        the export (a model to load them into: ``features.plain_hf_config``).
        ``cpu_offload``: gathered to rank 0's host memory only. ``merge=False``: LoRA's keys as peft's."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
        if not self.features.lora or not merge or not full:  # offloaded: only rank 0 receives the weights
            return full
        return self.features.lora_merge.merged(full)

    def full_weights_by_unit(self, merge: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """Collective (every rank must consume it all): the model's unsharded weights one wrapping unit at a
        time, keyed as the plain Hugging Face model's (LoRA merged; ``merge=False``: peft's keys) -- for
        refreshing the rollout copy and writing the export with one unit's extra memory instead of the whole
        model's (see :mod:`syncwise.engine.weights`)."""
        return full_weights_by_unit(self.wrapped, self.features.lora_merge if merge else None)

    def engine_state(self) -> dict[str, Any]:
        """Everything else a resumed run needs to continue exactly (JSON-serialisable; :func:`.state.resume_state`)."""
        return resume_state(self)

    def load_engine_state(self, state: dict[str, Any]) -> None:
        load_resume_state(self, state)


def _is_batch(batch: Any) -> bool:
    return isinstance(batch, dict) and all(isinstance(v, torch.Tensor) for v in batch.values())
