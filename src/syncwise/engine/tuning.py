"""What ``auto`` chooses beside the sync mode, and what it must know of a step to choose it.

``engine.fused_lm_head=auto``: the logits materialised (faster: the fused head makes each chunk's logits
again in backward) where they and their gradient fit the budget beside the chosen sync mode, else fused.
``engine.max_tokens_per_micro_batch=auto``: the token cap, a power of two; a larger one means fewer
micro-batches (fewer all-gathers and reduce-scatters per step) and more activation memory. Both are chosen
with the sync mode in one decision (:mod:`syncwise.memory.autosync`) from a :class:`StepShape` that
:meth:`Tuning.shape` builds on the first step, identically on every rank: the micro-batches each cap gives
(every rank's count, the largest), the activations of a setting's largest micro-batch (the activation model
``syncwise plan`` uses, :func:`syncwise.memory.activations.estimate_activations`), and a setting's predicted
seconds -- its collectives over the links and, for the fused head, the output layer's matmul once more per
token. By default those come from the model alone, at the device type's nominal links and matmul rate
(:func:`syncwise.memory.costs.nominal_machine`), so the same job splits alike run to run; with
``sync.auto_timing=true`` they are timed here (a short sweep of collectives, :mod:`syncwise.memory.calibrate`,
and the head's matmul) and the chosen cap and the next smaller ones are timed for a step each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..data.batching import Batch, split_lengths
from ..data.partition import capped_bins, capped_partition, token_cost, workloads
from ..memory.activations import estimate_activations, working_bytes
from ..memory.autosync import CAPS, LONGEST, StepShape, step_shape
from ..memory.calibrate import best_matmul_seconds, fit, sweep
from ..memory.costs import head_recompute_seconds, nominal_machine
from ..runtime.distributed import agree
from ..sync.counting import CollectiveCounts
from ..sync.modes import SyncChoice
from .wrap import DTYPE_BY_NAME

LINK_SIZES = (64 * 1024, 4 * 2**20)  # the sweep auto fits its links to: one latency-bound, one bandwidth-bound
HEAD_TIMING_TOKENS = 256


@dataclass(frozen=True)
class ActivationModel:
    """The activation peak of one micro-batch of this engine's model, with FSDP2's bytes in flight beside it
    (``in_loss``, ``in_layer``: :func:`syncwise.memory.plan.in_flight_bytes`)."""

    hf_config: object
    dtype: str  # the compute dtype's name
    checkpointing: bool
    logprob_chunk: int
    head_trains: bool
    value_head: bool
    in_loss: int
    in_layer: int
    packed_loop: bool = False  # packed rows' attention one sdpa call per sequence
    layer_scale: float = 1.0  # a decoder layer's measured activations over the formula's (1: not measured)
    # a whole micro-batch's measured peak over what the model gives it (the allocator's rounding and workspaces,
    # what the formula leaves out): every micro-batch's is taken as that much (1: not measured)
    scale: float = 1.0
    measured_ratio: float = 0.0  # that micro-batch's measured bytes over the model's (0: not measured)

    def __call__(self, tokens: int, fused: bool) -> int:
        act = estimate_activations(self.hf_config, tokens, 1, self.checkpointing, self.dtype, self.logprob_chunk,
                                   fused, self.head_trains, self.value_head, self.packed_loop, self.layer_scale)
        return int(working_bytes(act, self.in_loss, self.in_layer) * self.scale)

    def scale_for(self, sample: tuple[int, int] | None) -> float:
        """A decoder layer's measured (bytes, tokens) over what the formula gives for that many tokens (0
        without a sample)."""
        if sample is None or not sample[1]:
            return 0.0
        formula = estimate_activations(self.hf_config, sample[1], 1, False, self.dtype,
                                       packed_loop=self.packed_loop).per_layer_bytes
        return sample[0] / formula if formula else 0.0


@dataclass
class Tuning:
    """The dimensions beyond the sync mode that auto chooses for one engine."""

    heads: tuple[bool | None, ...]  # (False, True) under fused_lm_head=auto, else (None,): the config's
    auto_cap: bool
    fixed_fused: bool  # the head's path where it is not auto's
    packing: bool
    linear_coef: float  # engine.workload_linear_coef: how the engine balances a capped split
    activations: ActivationModel | None
    traffic: Callable[[SyncChoice, int], CollectiveCounts] | None  # a step's collectives; None unsharded
    shard: int  # ranks in a shard group
    replicas: int  # HSDP replicas
    head_shape: tuple[int, int] | None  # the output layer's weight (vocabulary, hidden), None without one
    compute_dtype: torch.dtype
    device: torch.device
    timeout_s: float
    timing: bool = False  # sync.auto_timing: links, head and caps timed here, not the nominal figures

    def first(self) -> tuple[bool | None, int | None]:
        """The first step's head and cap: the fused head, each rank's longest sequence as the cap."""
        return (True if self.heads != (None,) else None), (LONGEST if self.auto_cap else None)

    @property
    def calibrates(self) -> bool:
        """The first step measures a decoder layer's activations (not under activation checkpointing, where a
        layer keeps only its input and recomputes the rest: the formula's exact part)."""
        return self.activations is not None and not self.activations.checkpointing

    def activation_bytes(self, tokens: int, fused: bool | None) -> int:
        if self.activations is None:
            return 0
        return self.activations(max(tokens, 1), self.fixed_fused if fused is None else fused)

    def shape(self, batch: Batch, num_microbatches: int, largest_tokens: int,
              layer_sample: tuple[int, int] | None = None, microbatch_sample: tuple[int, int] | None = None,
              fused: bool | None = None) -> StepShape:
        """Collective (every rank, the same step): the step ``batch`` on this rank, split into
        ``num_microbatches`` whose largest (over ranks) computes ``largest_tokens`` positions. ``layer_sample``:
        what one decoder layer saved on this rank's largest micro-batch (bytes, tokens); the activation model
        is scaled to the largest ratio over the ranks, from here on."""
        caps = CAPS if self.auto_cap else ()
        lengths = split_lengths(batch, self.packing)  # rows kept together count as one
        longest = int(lengths.max()) if lengths.numel() else 0
        own = [float(x) for cap in caps for x in self._split_at(lengths, max(cap, longest))]
        nominal = nominal_machine(self.device.type)
        head_s = 0.0
        if True in self.heads and self.head_shape is not None:
            head_s = (self._head_seconds_per_token() if self.timing
                      else head_recompute_seconds(1, *self.head_shape, nominal.matmul_flops))
        timed_links = self.timing and self.traffic is not None and self.shard > 1
        samples = sweep(self.device, LINK_SIZES, repeats=3) if timed_links else []
        scale = self.activations.scale_for(layer_sample) if self.calibrates else 0.0
        own += [scale, float(lengths.sum()), float(longest), head_s, *(sample.seconds for sample in samples)]
        _, per_rank = agree([], own, "auto's step shape (after the first step)", self.device, self.timeout_s)
        most = per_rank.max(dim=0).values.tolist()  # every rank's figures alike: the slowest's timings
        if most[-4 - len(samples)] > 0:  # measured on every rank alike: the largest ratio
            self.activations = replace(self.activations, layer_scale=most[-4 - len(samples)])
        self._scale_to(microbatch_sample, fused)
        timed = len(samples)
        rank_tokens, longest, head_s = int(most[-3 - timed]), int(most[-2 - timed]), most[-1 - timed]
        agreed = [replace(sample, seconds=most[len(most) - timed + i]) for i, sample in enumerate(samples)]
        links = fit(agreed, self.shard) if agreed else (nominal.links if self.traffic and self.shard > 1 else None)
        eligible = [cap for cap in caps if cap >= longest]
        if eligible and not self.timing and nominal.largest_cap:  # and the smallest that holds the longest
            eligible = [cap for cap in eligible if cap <= max(nominal.largest_cap, min(eligible))]
        splits = {cap: (int(most[2 * i]), int(most[2 * i + 1])) for i, cap in enumerate(caps) if cap in eligible}

        def comm_seconds(choice: SyncChoice, n: int) -> float:
            traffic = self.traffic(choice, n)
            return links.step_time(traffic.counts, traffic.bytes, self.shard, self.replicas)

        if self.timing:
            basis = "timings here" + (f" (links {links.latency_s * 1e6:.0f} us, {links.bandwidth / 1e9:.3g} GB/s "
                                      "fitted)" if agreed else "")
        else:
            basis = nominal.describe(self.device.type)
        return step_shape(splits, (num_microbatches, largest_tokens), self.heads, self.activation_bytes,
                          comm_seconds if links is not None else None, head_s * rank_tokens, basis, self.timing)

    def _scale_to(self, sample: tuple[int, int] | None, fused: bool | None) -> None:
        """Collective: where the measured step's largest micro-batch really took more than the activation model
        gives it -- its peak over what was in use when it began, as the CUDA allocator or the CPU tracker counts
        it; ``fused``: the measured step's head -- the model is scaled up by that ratio (the largest over the
        ranks), so no prediction stays below what was measured: what the formula leaves out (the allocator's
        rounding and workspaces, a kernel's copies) grows with the micro-batch. Where it took less, the model
        stays as it is: its error differs from setting to setting (on the suite's models, from 12% over to 4%
        under between the first step's micro-batch and the chosen one), and scaling it down by the first
        step's ratio predicted chosen settings up to 3.4% below their peaks."""
        if self.activations is None:
            return
        ratio = 0.0
        if sample is not None and sample[0] > 0:
            modelled = self.activation_bytes(sample[0], fused)
            ratio = sample[1] / modelled if modelled else 0.0
        agreed = float(agree([], [ratio], "auto's activation scale", self.device, self.timeout_s)[1].max())
        if agreed > 0:
            self.activations = replace(self.activations, scale=max(agreed, 1.0), measured_ratio=agreed)

    def _split_at(self, lengths: torch.Tensor, cap: int) -> tuple[int, int]:
        """This rank's micro-batches under ``cap`` and the positions of the largest, split as the engine
        splits (:func:`~syncwise.data.batching.split_batch`)."""
        if not lengths.numel():
            return 0, 0
        sizes = lengths.tolist()
        count = len(capped_bins(sizes, cap, self.packing))
        parts = capped_partition(sizes, workloads(lengths, self.linear_coef), count, cap, self.packing)
        return count, max(token_cost([sizes[i] for i in part], self.packing) for part in parts)

    def _head_seconds_per_token(self) -> float:
        """The output layer's matmul for one token, timed here (the best of three): what the fused head
        spends again per token in backward."""
        if self.head_shape is None:
            return 0.0
        vocab, hidden = self.head_shape
        weight = torch.randn(vocab, hidden, dtype=self.compute_dtype, device=self.device)
        states = torch.randn(HEAD_TIMING_TOKENS, hidden, dtype=self.compute_dtype, device=self.device)
        return best_matmul_seconds(states, weight.T, repeats=3) / HEAD_TIMING_TOKENS


def build_tuning(config, features, estimator, traffic, compute_dtype: torch.dtype, device: torch.device,
                 trainable: bool, measurable: bool, say: bool) -> Tuning | None:
    """What auto chooses beside the sync mode for this engine (None: nothing). ``estimator``: the engine's
    :class:`~syncwise.memory.accounting.ShardedModel`; ``traffic``: a step's collectives for a sync choice and
    a micro-batch count (None unsharded); ``measurable``: whether a peak can be measured here (auto chooses
    from a measured peak)."""
    from ..memory.plan import in_flight_bytes

    eng = config.engine
    heads = (False, True) if eng.fused_lm_head == "auto" and features.fused_head and trainable else (None,)
    auto_cap = eng.auto_cap and trainable and features.hf_config is not None
    if heads == (None,) and not auto_cap:
        return None
    if not measurable:
        if say:
            fallback = "the fused head" + (", 2 sequences per micro-batch" if auto_cap else "")
            print("syncwise: engine.fused_lm_head / max_tokens_per_micro_batch=auto choose from a measured peak, "
                  f"which FSDP1 on CPU cannot give: {fallback}", flush=True)
        return None
    activations = None
    if features.hf_config is not None:
        dtype_name = next(name for name, dtype in DTYPE_BY_NAME.items() if dtype == compute_dtype)
        in_loss, in_layer = in_flight_bytes(estimator)
        activations = ActivationModel(features.hf_config, dtype_name, eng.activation_checkpointing,
                                      eng.logprob_chunk_size, not features.lora, features.value_head, in_loss, in_layer,
                                      features.attention_kernel == "loop")
    hf = features.hf_config
    head = (int(hf.vocab_size), int(hf.hidden_size)) if heads != (None,) else None
    return Tuning(heads, auto_cap, bool(features.fused_head), features.packing, eng.workload_linear_coef,
                  activations, traffic, estimator.shard_size, eng.hsdp_replicas, head, compute_dtype, device,
                  config.dist.timeout_s, config.sync.auto_timing)
