"""A model built where it will live: on the meta device, wrapped, then each rank's own part filled in place.

Building the whole model on every rank's CPU before FSDP shards it costs host memory that grows with the rank count
(8 ranks of a 7B model: 8 x 28 GB at start) and time (a 0.5B preset: 6-9 s per engine). Here the model is built with
its parameters on the meta device (no memory; buffers computed at construction, such as the rotary tables, are
real), wrapped as always (FSDP2 / HSDP shard it on the meta device), then materialised on the job's device
(``to_empty``) and filled, each rank writing only its own shards:

- from ``model.path``'s safetensors (one file or several with their index) through DCP's Hugging Face reader,
  which reads each rank's slices of each tensor from the files and casts them to the master dtype on the way (a
  bf16 checkpoint into fp32 weights) -- the same values ``from_pretrained`` gives, bit for bit;
- a preset's weights seeded per tensor by its name (normal with the config's ``initializer_range``, norms 1,
  biases 0), each drawn whole on the device one tensor at a time and sliced, so every rank and every world size
  sees the same initial weights;
- what was computed at build (LoRA adapters drawn from ``model.seed``, a critic's zero value head) copied back.

Tied weights stay one tensor (loaded once, from the checkpoint's name for it). Under FSDP1, DDP or a single process
the model is filled before wrapping, a whole copy per rank (what those strategies hold anyway) read tensor by
tensor: never two copies. :func:`preflight_weights` compares the checkpoint's tensors with the model's before any
rank starts (one line naming the tensor and the file).
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint_files import (
    FLOAT_DTYPES,
    SAFETENSORS_INDEX,
    CheckpointLayout,
    checkpoint_layout,
    tensor_groups,
)
from .names import unwrapped_name

ATTR = "_syncwise_pending"  # where a model built on the meta device keeps what it still needs


@dataclass
class Pending:
    """What a model built on the meta device needs once it is wrapped (``kept`` and ``buffers`` by state-dict key)."""

    source: str | None  # a model directory with safetensors, or None: seeded initialisation
    seed: int
    init_std: float
    layout: CheckpointLayout | None = None  # the source's files and which checkpoint key fills each model key
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # computed at build: LoRA adapters, a value head
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # as built: rotary tables, embedding scales
    report: dict[str, Any] = field(default_factory=dict)  # filled by materialize: what it read, seconds, host peak


def pending_of(model: nn.Module) -> Pending | None:
    return getattr(model, ATTR, None)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, every parameter a module registers is moved to the meta device as it is registered;
    buffers stay real (computed at construction from the config: rotary tables)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def placeholders(model: nn.Module) -> set[int]:
    """Every meta parameter replaced by a CPU tensor of its shape that holds no memory (one zero, expanded), tied
    ones alike: what peft needs to build LoRA adapters beside it on the CPU -- drawing from the generator exactly
    as it does beside a whole model. Returns their ids (:func:`defer` puts them back on the meta device)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in made:
                    view = torch.zeros((), dtype=param.dtype).expand(param.shape)
                    made[id(param)] = nn.Parameter(view, requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
    return {id(p) for p in made.values()}


def defer(model: nn.Module, source: str | None, seed: int, init_std: float, stand_ins: set[int] = frozenset(),
          layout: CheckpointLayout | None = None, note: str | None = None) -> nn.Module:
    """``model`` (its base weights on the meta device or ``stand_ins``; adapters or a value head possibly real)
    made all meta, with what it needs to be filled once wrapped: the real values it had kept, its buffers, where
    its weights come from (``layout``: which checkpoint key fills each model key; ``note``: a line said at load)."""
    pending = Pending(source, seed, init_std, layout, report={"started": time.perf_counter(), "note": note})
    pending.buffers = {unwrapped_name(k): v.detach().clone() for k, v in model.named_buffers() if not v.is_meta}
    buffers = {k for k, _ in model.named_buffers()}
    pending.kept = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()
                    if k not in buffers and not v.is_meta and id(v) not in stand_ins}
    moved: dict[int, nn.Parameter] = {}  # a tied parameter stays one
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not param.is_meta:
                if id(param) not in moved:
                    moved[id(param)] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                module._parameters[name] = moved[id(param)]
    setattr(model, ATTR, pending)
    return model


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str, say: str | None = None) -> None:
    """Allocate the (wrapped or not) meta model's tensors on ``device`` -- each rank its own shards under FSDP2 --
    and fill them: buffers and kept values copied back, the checkpoint's tensors read (each rank its slices),
    the rest initialised. ``say``: which model it is (``the policy``), for the one line of what it did (rank 0;
None: nothing said)."""
    pending = pending_of(model)
    if pending is None:
        return
    host = HostMemory().start()
    try:
        model.to_empty(device=device)
        _tie_again(model)
        for name, buffer in model.named_buffers():
            if unwrapped_name(name) in pending.buffers:
                buffer.copy_(pending.buffers[unwrapped_name(name)])
        layout = pending.layout
        requests: dict[str, torch.Tensor] = {}
        for names, tensor in tensor_groups(model):
            if names[0] in pending.kept:
                copy_full(tensor, pending.kept[names[0]].to(device))
            elif layout is not None:  # a tied weight: read once, under the name the checkpoint has for it
                requests[layout.key_for(names)] = tensor
            else:
                copy_full(tensor, seeded_value(names[0], tuple(tensor.shape), pending, device))
        if requests:
            read_checkpoint(requests, layout)
    finally:
        peak = host.stop()
    pending.report |= {"seconds": time.perf_counter() - pending.report.pop("started"), "tensors": len(requests),
                       "source": pending.source,
                       "host_bytes": peak - host.before if peak is not None else None}
    delattr(model, ATTR)
    if say:
        if pending.report.get("note"):
            print(f"syncwise: {pending.report['note']}", flush=True)
        print(f"syncwise: {say} {load_line(pending.report)}", flush=True)


def load_line(report: dict[str, Any]) -> str:
    what = (f"{report['tensors']} tensors of {report['source']} read into this rank's shards" if report["source"]
            else "initialised on the device, seeded per tensor")
    peak = (f"; at most {report['host_bytes'] / 2**30:.2f} GiB of host memory above the process's own (rank 0)"
            if report.get("host_bytes") is not None else "")
    return f"built on the meta device, {what} in {report['seconds']:.1f} s{peak}"


def read_checkpoint(requests: dict[str, torch.Tensor], layout: CheckpointLayout) -> None:
    """Fill ``requests`` (checkpoint key -> this rank's tensor, a DTensor shard or a whole tensor) from the
    layout's safetensors files: DCP's Hugging Face reader reads each rank's slices and casts them to the tensor's
    dtype (collective where a process group exists) -- from exactly the files ``from_pretrained`` reads (the
    reader itself takes every ``*.safetensors`` of the folder: a stray ``model.old.safetensors`` would win)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class NamedFilesReader(HuggingFaceStorageReader):
        def read_metadata(self):  # the reader's metadata comes from the files its fs lists
            listed = self.fs.ls
            self.fs.ls = lambda _folder: [str(file) for file in layout.files]
            try:
                return super().read_metadata()
            finally:
                self.fs.ls = listed

    dcp.load(requests, storage_reader=NamedFilesReader(str(layout.folder)))


def copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor ``full`` into ``target``: itself, or this rank's part of it (a DTensor shard)."""
    if hasattr(target, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = target.to_local()
        shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
        if local.numel():
            local.copy_(full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))])
        return
    target.copy_(full)


def seeded_value(key: str, shape: tuple[int, ...], pending: Pending, device: torch.device | str) -> torch.Tensor:
    """A preset's initial value of tensor ``key``: drawn whole on ``device`` from a generator seeded by the model's
    seed and the tensor's name -- the same on every rank and at every world size. Norms' weights 1, biases 0,
    the rest normal with the config's ``initializer_range`` (what transformers' ``_init_weights`` does)."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    if len(shape) == 1 and "norm" in key:
        return torch.ones(shape, device=device)
    seed = (pending.seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(shape, device=device).normal_(0.0, pending.init_std, generator=generator)


def _tie_again(model: nn.Module) -> None:
    """A model whose config ties its embeddings must still hold one tensor for both (``to_empty`` of an unwrapped
    module may allocate two; FSDP2 keeps one): tied again through transformers."""
    base = getattr(model, "module", model)
    tie = getattr(base, "tie_weights", None)
    if tie is not None and not _is_fsdp2(base):
        tie()


def _is_fsdp2(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# ------------------------------------------------------------------------------------------------
# The checkpoint's tensors, and the checks before any rank starts
# ------------------------------------------------------------------------------------------------
def preflight_weights(model: nn.Module, path: str | Path, unused_ok: tuple[str, ...] = ()) -> None:
    """Compare a (meta) model's tensors with the checkpoint's, as ``from_pretrained`` pairs them
    (:func:`checkpoint_layout`): a ValueError in one line naming the tensor and the file for a tensor the model
    needs and the checkpoint lacks, one with another shape or a dtype that is no float, or one the checkpoint has
    that the model has no place for (``unused_ok``: key prefixes a model may leave unused, e.g. a critic's
    ``lm_head``)."""
    pending = pending_of(model)
    layout = pending.layout if pending is not None and pending.layout is not None else None
    if layout is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        layout = checkpoint_layout(base, path)
        if layout is None:  # loaded whole by from_pretrained, which checks it
            return
    kept = pending.kept if pending is not None else {}
    where = Path(path) if layout.files == [Path(path) / "model.safetensors"] else Path(path) / SAFETENSORS_INDEX
    for names, tensor in tensor_groups(model):
        if names[0] in kept or ".lora_" in names[0]:
            continue
        key = layout.key_for(names)
        if key not in layout.tensors:
            raise ValueError(f"model.path: {where} has no tensor {key} (the model needs it: {tuple(tensor.shape)})")
        file, shape, dtype = layout.tensors[key]
        if shape != tuple(tensor.shape):
            raise ValueError(f"model.path: {file}: tensor {key} has shape {shape}, the model's is "
                             f"{tuple(tensor.shape)} (a config that does not match the weights?)")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"model.path: {file}: tensor {key} is {dtype}, which does not cast to the float "
                             f"weights the model trains (a quantised checkpoint?)")
    unused = [k for k in layout.unexpected if not k.startswith(unused_ok)]
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise ValueError(f"model.path: {layout.tensors[unused[0]][0]}: tensor {unused[0]} has no place in the "
                         f"model{more} (a config that does not match the weights?)")


# ------------------------------------------------------------------------------------------------
# The host's memory at load
# ------------------------------------------------------------------------------------------------
class HostMemory:
    """This process's peak anonymous resident memory over a span (``start`` .. ``stop``), sampled on a thread every
    ``every_s``. Anonymous (``RssAnon``): what the process allocated -- not the file pages it maps, which the
    resident-size high-water mark counts although a safetensors file read through mmap is page cache, shared by
    every rank and dropped under pressure. Linux; elsewhere ``peak`` stays None."""

    def __init__(self, every_s: float = 0.002):
        self.every_s = every_s
        self.before: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HostMemory:
        self.before = self.peak = anonymous_resident_bytes()
        if self.before is not None:
            self._thread = threading.Thread(target=self._sample, name="syncwise-host-memory", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> int | None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.peak = max(self.peak, anonymous_resident_bytes() or 0)
        return self.peak

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, anonymous_resident_bytes() or 0)


def anonymous_resident_bytes() -> int | None:
    """This process's anonymous resident memory now (bytes; None where /proc has none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
