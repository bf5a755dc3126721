"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, resumable, reshardable; HF export.

Layout under the checkpoint root::

    step_000020/dcp/...        model + optimizer, sharded (DCP reshards on load: any world size)
    step_000020/trainer.json   step, data position, LR schedule, auto-sync state (rank 0)
    step_000020/rank{r}.pt     that rank's RNG states (tensors only, loaded with weights_only=True)
    latest                     the name of the newest complete checkpoint, written last

A checkpoint is written and synced to disk under ``.tmp-step_...``, renamed only when every rank has
finished, then ``latest`` is replaced atomically (see :meth:`CheckpointManager.save`): a crash at any
point leaves ``latest`` naming a complete checkpoint.

Nothing is unpickled freely on load: DCP metadata through an allow-list, non-tensor items and RNG
files with ``weights_only=True``, the trainer state as JSON, exports as safetensors.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from .engine import Engine
from .runtime.distributed import rank_and_world

LATEST = "latest"

# Everything a DCP ``.metadata`` pickle may name. DCP itself unpickles that file with plain ``pickle``
# (and its non-tensor items with ``weights_only=False``): a crafted checkpoint could run code. syncwise
# reads both through allow-lists instead.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not allowed")


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled through an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items (optimizer hyper-parameters) with
    ``weights_only=True`` instead of unrestricted unpickling."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        checked = io.BytesIO()
        torch.save(obj, checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message names the file."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors (so they load with ``weights_only=True``)."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": torch.tensor(internal, dtype=torch.int64),
             "python_version": torch.tensor(version)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((int(state["python_version"]), tuple(int(x) for x in state["python"].tolist()), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def save(self, step: int, engine: Engine, trainer_state: dict[str, Any],
             others: dict[str, Engine] | None = None, rank_state: dict[str, Any] | None = None) -> Path:
        """Collective: every rank calls it. Returns the final directory. ``others``: more engines saved beside
        ``engine`` under their names (PPO's ``critic``: its model and optimizer in the same DCP checkpoint).
        ``rank_state``: what this rank alone holds (tensors, numbers, strings, lists and dicts of them: an
        off-policy job's rollouts drawn ahead), beside its RNG states (:meth:`rank_state`).

        Atomic at every point: the new checkpoint is written and synced to disk under ``.tmp-<name>``;
        then (rank 0) a previous checkpoint of the same name is renamed aside to ``.old-<name>``, the new
        one renamed in, ``latest`` replaced, and the old one removed, each rename synced. A crash
        anywhere leaves ``latest`` naming a complete checkpoint (``resolve`` finds one renamed aside).
        """
        rank, world = rank_and_world()
        name = f"step_{step:06d}"
        tmp, final, aside = self.root / f".tmp-{name}", self.root / name, self.root / f".old-{name}"
        if rank == 0:
            for stale in self.root.glob(".tmp-step_*"):  # interrupted writes: never named by latest
                shutil.rmtree(stale)
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(_state_of(engine, others), checkpoint_id=str(tmp / "dcp"))  # DCP syncs its files
        with open(tmp / f"rank{rank}.pt", "wb") as file:
            torch.save({**rng_state(), **({"rank_state": rank_state} if rank_state is not None else {})}, file)
            _sync(file)
        if rank == 0:
            state = {"trainer": trainer_state, "engine": engine.engine_state(), "world_size": world,
                     "engines": {name: other.engine_state() for name, other in (others or {}).items()}}
            with open(tmp / "trainer.json", "w") as file:
                file.write(json.dumps(state, indent=1))
                _sync(file)
        _barrier()
        if rank == 0:
            _sync_dir(tmp / "dcp")
            _sync_dir(tmp)
            self._reached("written")
            if final.exists():
                if aside.exists():  # left by an earlier crash; final is complete, so it is not needed
                    shutil.rmtree(aside)
                os.replace(final, aside)
                _sync_dir(self.root)
                self._reached("old_aside")
            os.replace(tmp, final)
            _sync_dir(self.root)
            self._reached("new_in")
            _write_atomic(self.root / LATEST, name)
            self._reached("latest")
            if aside.exists():
                shutil.rmtree(aside)
            self._reached("old_removed")
        _barrier()
        return final

    def _reached(self, point: str) -> None:
        """A named point of :meth:`save` (the crash tests stop the process at each)."""

    def resolve(self, resume: str) -> Path | None:
        """``none`` -> None; ``auto`` -> the checkpoint ``latest`` names (None if there is none yet); else
        the given directory, which must exist."""
        if resume == "none":
            return None
        if resume == "auto":
            pointer = self.root / LATEST
            if not pointer.is_file():
                return None
            path = self.root / pointer.read_text().strip()
            if path.is_dir():
                return path
            aside = path.with_name(f".old-{path.name}")
            if aside.is_dir():  # a re-save of the same step crashed between its two renames
                return aside
            raise CheckpointError(f"{pointer} names {path.name}, which does not exist")
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"train.resume: checkpoint directory not found: {resume}")
        return path

    @staticmethod
    def check_holds(path: Path, names, saved: dict[str, Any] | None = None) -> None:
        """Raise ``CheckpointError`` unless the checkpoint at ``path`` holds an engine under each of ``names``
        (PPO's ``critic``)."""
        if saved is None:
            try:
                saved = json.loads((path / "trainer.json").read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{path / 'trainer.json'}: unreadable ({exc})") from exc
        missing = sorted(set(names) - set(saved.get("engines", {})))
        if missing:
            raise CheckpointError(f"{path}: holds no {' or '.join(missing)} (written by a run without one); "
                                  f"start a new train.out_dir or resume without it")

    @staticmethod
    def rank_state(path: Path) -> dict[str, Any] | None:
        """What :meth:`save` kept for this rank alone, if anything; None where the checkpoint was written on
        another world size (its ranks' states are not this job's)."""
        rank, world = rank_and_world()
        rank_file = path / f"rank{rank}.pt"
        try:
            saved = json.loads((path / "trainer.json").read_text())
            state = torch.load(rank_file, weights_only=True) if rank_file.is_file() else {}
        except (OSError, json.JSONDecodeError, RuntimeError, pickle.UnpicklingError) as exc:
            raise CheckpointError(f"{rank_file}: unreadable ({exc})") from exc
        return state.get("rank_state") if saved["world_size"] == world else None

    def load(self, path: Path, engine: Engine, others: dict[str, Engine] | None = None) -> dict[str, Any]:
        """Collective. Restores model, optimizer and engine state (and ``others``' as :meth:`save` wrote them);
        RNG states when the world size matches. Returns the trainer state."""
        rank, world = rank_and_world()
        meta = path / "trainer.json"
        if not meta.is_file():
            raise CheckpointError(f"{meta}: missing (incomplete checkpoint)")
        try:
            saved = json.loads(meta.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{meta}: unreadable ({exc})") from exc
        self.check_holds(path, others or {}, saved)
        state = _state_of(engine, others)
        reader = SafeFileSystemReader(str(path / "dcp"))
        try:
            # read here first: torch 2.11's dcp.load swallows the reader's error and says only "metadata is None"
            reader.read_metadata()
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
        # DCP raises many kinds for truncated, missing or unsafe files; its CheckpointException (a
        # BaseException) carries the ranks' tracebacks, whose last line is the cause.
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"{path / 'dcp'}: cannot load model/optimizer state ({_cause(exc)})") from exc
        for name, other in (others or {}).items():
            other.load_state_dict(state.pop(name))
            other.load_engine_state(saved["engines"][name])
        engine.load_state_dict(state)
        engine.load_engine_state(saved["engine"])
        rank_file = path / f"rank{rank}.pt"
        if saved["world_size"] == world and rank_file.is_file():
            set_rng_state(torch.load(rank_file, weights_only=True))
        return saved["trainer"]


def _state_of(engine: Engine, others: dict[str, Engine] | None) -> dict[str, Any]:
    """What DCP saves and loads: ``engine``'s model and optimizer, each other engine's under its name."""
    return {**engine.state_dict(), **{name: other.state_dict() for name, other in (others or {}).items()}}


def _cause(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[-1] if isinstance(exc, CheckpointException) else lines[0]


def _sync(file) -> None:
    file.flush()
    os.fsync(file.fileno())


def _sync_dir(path: Path) -> None:
    """Make the entries of a directory (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        _sync(f)
    os.replace(tmp, path)
    _sync_dir(path.parent)


