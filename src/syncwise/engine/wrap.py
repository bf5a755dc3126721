"""Wrap a Hugging Face causal LM for data-parallel training: FSDP2, FSDP1, DDP, or a plain module.

FSDP units are one per decoder layer (the classes in ``_no_split_modules``) plus the root, which holds the
embeddings, final norm and LM head. The unit count is what the expected-collective formula needs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import SHARDED_STRATEGIES, EngineConfig, ModelConfig
from ..memory.accounting import sharded_dim
from ..models import decoder_layer_classes, decoder_layers
from ..models.loading import materialize, pending_of
from ..runtime.distributed import rank_and_world
from ..sync import fsdp_internals as fsdp

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WrappedModel:
    """A model ready to train, and what the engine needs to know about how it is wrapped."""

    module: nn.Module
    strategy: str
    num_units: int  # FSDP units with parameters (0 for DDP / plain)
    dp_size: int  # ranks over which gradients are averaged
    mesh: DeviceMesh | None
    units: list[nn.Module] = field(default_factory=list)  # FSDP units (root first); [model] otherwise

    @property
    def hsdp(self) -> bool:
        return self.mesh is not None and self.mesh.ndim == 2

    @property
    def sharded(self) -> bool:
        """FSDP (units, all-gathers and reduce-scatters) rather than DDP or a plain module."""
        return self.strategy in SHARDED_STRATEGIES

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over (1 when parameters are replicated)."""
        if not self.sharded or self.mesh is None:
            return 1
        return self.mesh.size(self.mesh.ndim - 1)


def wrap_model(
    model: nn.Module,
    engine_cfg: EngineConfig,
    model_cfg: ModelConfig,
    device: torch.device,
    mesh: DeviceMesh | None,
    role: str = "the model",
    layer_classes: tuple[type[nn.Module], ...] = (),
) -> WrappedModel:
    """Wrap ``model`` (fp32, on CPU, same weights on every rank; or built on the meta device by
    ``build_model(..., deferred=True)``: filled here, once sharded under FSDP2) according to
    ``engine_cfg.strategy``; ``role``: which model it is, in the line rank 0 says when it fills one;
    ``layer_classes``: its decoder layers' (``ModelFeatures.layer_classes``; found here where not given)."""
    rank, world_size = rank_and_world()
    say = role if rank == 0 else None
    strategy = engine_cfg.strategy
    if engine_cfg.cpu_offload and device.type == "cpu":
        # FSDP's offload moves parameters and optimizer state from an accelerator to host memory; on a
        # CPU run they already live there (and FSDP2's offload path asks for an accelerator).
        raise ValueError("engine.cpu_offload=true needs a CUDA device: on CPU, parameters are already in host memory")
    needs_layers = engine_cfg.activation_checkpointing or strategy in ("fsdp2", "fsdp1")
    if needs_layers and not layer_classes:
        layer_classes = tuple(decoder_layer_classes(model))  # a model that names none: its error here
    if engine_cfg.activation_checkpointing:
        checkpoint_decoder_layers(model, layer_classes)
    if strategy != "fsdp2":  # a model built on the meta device, filled whole before wrapping (FSDP2: once sharded)
        materialize(model, device if strategy != "fsdp1" else torch.device("cpu"), say=say)
    if strategy == "none":
        if world_size > 1:
            raise ValueError(
                f"engine.strategy='none' trains a single process, but the world size is {world_size}; "
                "use fsdp2, fsdp1 or ddp"
            )
        return WrappedModel(model.to(device), strategy, num_units=0, dp_size=1, mesh=None, units=[model])
    if not dist.is_initialized():
        raise ValueError(f"engine.strategy={strategy!r} needs a process group (run under the launcher)")
    if strategy == "fsdp2":
        module = _wrap_fsdp2(model, engine_cfg, model_cfg, device, mesh, layer_classes, say)
        units = [m for m in fsdp.fsdp2_units(module) if fsdp.has_params(m)]
    elif strategy == "fsdp1":
        module = _wrap_fsdp1(model, engine_cfg, model_cfg, device, mesh, layer_classes)
        units = list(FSDP1.fsdp_modules(module))
    elif strategy == "ddp":
        module = _wrap_ddp(model, engine_cfg, device)
        return WrappedModel(module, strategy, num_units=0, dp_size=world_size, mesh=mesh, units=[module])
    else:
        raise ValueError(f"engine.strategy: {strategy!r} is not one of fsdp2, fsdp1, ddp, none")
    return WrappedModel(module, strategy, num_units=len(units), dp_size=world_size, mesh=mesh, units=units)


def checkpoint_decoder_layers(model: nn.Module, classes: tuple[type[nn.Module], ...] = ()) -> None:
    """Wrap each decoder layer in torch's activation-checkpoint wrapper (non-reentrant), in place, before any
    FSDP wrapping: its activations are recomputed in backward instead of kept. Parameter names keep their
    meaning: torch's state-dict utilities (DCP, the export) drop the wrapper's prefix."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    classes = classes or tuple(decoder_layer_classes(model))
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, classes),
    )


def expert_placement(ranks: int):
    """FSDP2's placement of each parameter over ``ranks``: its default (dim 0) but where :func:`sharded_dim` says
    otherwise (a mixture of experts' fused experts fewer than the ranks)."""
    from torch.distributed.tensor import Shard

    def place(param: nn.Parameter):
        dim = sharded_dim(tuple(param.shape), ranks)
        return Shard(dim) if dim else None

    return place


def _wrap_fsdp2(
    model: nn.Module, engine_cfg: EngineConfig, model_cfg: ModelConfig, device: torch.device,
    mesh: DeviceMesh | None, layer_classes: tuple[type[nn.Module], ...], say: str | None = None,
) -> nn.Module:
    fsdp.require_supported_torch()
    param_dtype = DTYPE_BY_NAME[model_cfg.param_dtype]
    reduce_dtype = DTYPE_BY_NAME[model_cfg.reduce_dtype]
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=engine_cfg.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    )
    if mesh is not None:
        kwargs["shard_placement_fn"] = expert_placement(mesh.size(mesh.ndim - 1))
    deferred = pending_of(model) is not None  # built on the meta device: materialised once sharded
    if engine_cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif not deferred:
        model.to(device)
    for layer in decoder_layers(model, layer_classes):
        fully_shard(layer, **kwargs)
    # The root's parameters are needed again at the start of backward (LM head): FSDP2's default for the
    # root keeps them unsharded after forward instead of gathering them twice, so only pass False.
    root_kwargs = dict(kwargs)
    if engine_cfg.reshard_after_forward:
        del root_kwargs["reshard_after_forward"]
    fully_shard(model, **root_kwargs)
    if deferred:  # each rank allocates and fills only its own shards
        materialize(model, torch.device("cpu") if engine_cfg.cpu_offload else device, say=say)
    fsdp.init_root(model)
    return model


def _wrap_fsdp1(
    model: nn.Module, engine_cfg: EngineConfig, model_cfg: ModelConfig, device: torch.device,
    mesh: DeviceMesh | None, layer_classes: tuple[type[nn.Module], ...],
) -> nn.Module:
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    hsdp = mesh is not None and mesh.ndim == 2
    if hsdp:
        strategy = ShardingStrategy.HYBRID_SHARD if engine_cfg.reshard_after_forward else (
            ShardingStrategy._HYBRID_SHARD_ZERO2
        )
    else:
        strategy = (
            ShardingStrategy.FULL_SHARD if engine_cfg.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        )
    frozen = {p.requires_grad for p in model.parameters()} == {True, False}
    if frozen and rank_and_world()[0] == 0:
        warnings.warn(
            "engine.strategy=fsdp1 with frozen parameters (LoRA): FSDP1 reduce-scatters and holds gradients for "
            "the whole flat parameter of each unit that trains, frozen weights included; fsdp2 holds only the "
            "trainable ones", RuntimeWarning, stacklevel=3,
        )
    mixed = None
    if model_cfg.param_dtype != "float32" or model_cfg.reduce_dtype != "float32":
        mixed = MixedPrecision(
            param_dtype=DTYPE_BY_NAME[model_cfg.param_dtype],
            reduce_dtype=DTYPE_BY_NAME[model_cfg.reduce_dtype],
            buffer_dtype=torch.float32,
        )
    with warnings.catch_warnings():  # torch's version of the warning above lists every parameter's name
        warnings.filterwarnings("ignore", message=".*has both parameters with requires_grad=True and False.*")
        return FSDP1(
            model,
            auto_wrap_policy=ModuleWrapPolicy(set(layer_classes)),
            sharding_strategy=strategy,
            device_mesh=mesh if hsdp else None,
            mixed_precision=mixed,
            cpu_offload=CPUOffload(offload_params=engine_cfg.cpu_offload),
            device_id=device,  # required on CPU, where FSDP1 cannot infer it
            use_orig_params=True,
        )


def _wrap_ddp(model: nn.Module, engine_cfg: EngineConfig, device: torch.device) -> nn.Module:
    model.to(device)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        # Buffers here are deterministic (rotary tables); broadcasting them each forward is wasted traffic.
        broadcast_buffers=False,
        find_unused_parameters=engine_cfg.find_unused_parameters,
    )
    # The Python all-reduce hook issues its collective through ``dist.all_reduce``, where syncwise counts
    # every strategy's collectives (DDP's built-in reducer would all-reduce in C++, out of sight).
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp.register_comm_hook(None, allreduce_hook)
    return ddp
