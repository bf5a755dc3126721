"""A model folder's safetensors as ``from_pretrained`` reads them: exactly its files (:func:`safetensors_of`),
their tensors from the headers (:func:`checkpoint_tensors`, one line for a missing shard or a truncated file), and
which checkpoint key fills which model key by transformers' own rules (:func:`checkpoint_layout`,
:func:`untied_head`) -- what :mod:`syncwise.models.loading` reads each rank's shards by, and checks before any rank
starts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

SAFETENSORS_INDEX = "model.safetensors.index.json"


def checkpoint_key(key: str) -> str:
    """A model's state-dict key as a Hugging Face checkpoint names it (peft's prefix and ``base_layer`` dropped)."""
    from .lora import plain_key

    return plain_key(key)


def safetensors_of(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory that ``from_pretrained`` reads, and no others: its
    ``model.safetensors``, else those its index names (transformers looks in that order); another
    ``*.safetensors`` beside them (``model.old.safetensors``) is never read."""
    folder = Path(path)
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in files]
    return []


def checkpoint_tensors(path: str | Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Every tensor of the checkpoint: key -> (its file, shape, dtype name), from the files' headers alone. A
    file the index names that is not there, or one that is no whole safetensors file (truncated): a ValueError
    in one line naming it."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in safetensors_of(path):
        if not file.is_file():
            raise ValueError(f"model.path: {Path(path) / SAFETENSORS_INDEX} names {file.name}, which is not there "
                             "(a shard not downloaded or copied?)")
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open's handle is no mapping
                    piece = handle.get_slice(key)
                    found[key] = (file, tuple(piece.get_shape()), str(piece.get_dtype()))
        except (SafetensorError, OSError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"model.path: {file} is no whole safetensors file (truncated, or still being "
                             f"written?): {reason}") from exc
    return found


@dataclass
class CheckpointLayout:
    """Which of a model folder's tensors fill which of a model's, as ``from_pretrained`` decides: its files
    (``model.safetensors``, else the index's; no others), each checkpoint key renamed by transformers' own rules (the
    model class's conversion mapping, its base-model prefix added or dropped: the hub's ``gpt2`` stores ``wte.weight``
    for ``transformer.wte.weight``), and the keys it would ignore (GPT-2's ``attn.bias`` buffers, old
    ``rotary_emb.inv_freq``) left out."""

    folder: Path
    files: list[Path]
    tensors: dict[str, tuple[Path, tuple[int, ...], str]]  # checkpoint key -> (file, shape, dtype)
    source: dict[str, str]  # the plain model's state-dict key -> the checkpoint key that fills it
    unexpected: list[str]  # checkpoint keys with no place in the model (ignored ones excepted)

    def key_for(self, names: list[str]) -> str:
        """The checkpoint key to read for a tensor known by ``names`` (a tied embedding has two; peft's prefix and
        ``base_layer`` dropped)."""
        plain = [checkpoint_key(n) for n in names]
        return next((self.source[n] for n in plain if n in self.source), plain[0])


def checkpoint_layout(model: nn.Module, path: str | Path) -> CheckpointLayout | None:
    """The layout of ``path``'s safetensors for ``model`` (a transformers model, on the meta device or not), or
    None where the checkpoint is not plainly renamed tensors -- a key transformers converts (fused experts,
    quantised weights), or a transformers without its loading rules (before 5.0) -- which ``from_pretrained``
    then loads whole."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        from transformers.utils.loading_report import LoadStateDictInfo
    except ImportError:
        return None
    tensors = checkpoint_tensors(path)
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta = model.state_dict()
    prefix = model.base_model_prefix
    source: dict[str, str] = {}
    unexpected: set[str] = set()
    for key in tensors:  # as transformers' convert_and_load_state_dict_in_model names each key
        renamed, converter = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:
            renamed, converter = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if converter is not None:
            return None
        if renamed in meta:
            source[renamed] = key
        else:
            unexpected.add(key)
    info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=unexpected, mismatched_keys=set(),
                             conversion_errors={}, error_msgs=[], skipped_pp_keys=set())
    model._adjust_missing_and_unexpected_keys(info)  # the class's own ignored keys
    return CheckpointLayout(Path(path), safetensors_of(path), tensors, source, sorted(info.unexpected_keys))


def untied_head(model: nn.Module, layout: CheckpointLayout) -> str | None:
    """Where the config ties a head to its embedding but the checkpoint holds both, different: the line that says
    so (``from_pretrained`` then keeps them apart, and so must the job), else None."""
    from safetensors import safe_open

    tied = model.get_expanded_tied_weights_keys(all_submodels=True) if hasattr(
        model, "get_expanded_tied_weights_keys") else {}
    for target, origin in tied.items():
        if target not in layout.source or origin not in layout.source:
            continue
        values = []
        for key in (layout.source[target], layout.source[origin]):
            with safe_open(str(layout.tensors[key][0]), framework="pt") as handle:
                values.append(handle.get_tensor(key))
        if values[0].shape != values[1].shape or not torch.equal(values[0], values[1]):
            return (f"model.path: config.json ties {target} to {origin}, but the checkpoint holds both, different: "
                    f"kept apart, as from_pretrained does (the export says tie_word_embeddings=false)")
    return None


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's safetensors, one file or several (an export is written a unit a file)."""
    from safetensors.torch import load_file

    return {key: value for file in safetensors_of(path) for key, value in load_file(str(file)).items()}


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def tensor_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The model's weights (no buffers, no LoRA adapters' -- those come with the model), each tensor once with
    every state-dict key it has (a tied embedding has two)."""
    buffers = {name for name, _ in model.named_buffers()}
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if key not in buffers:
            groups.setdefault(id(tensor), ([], tensor))[0].append(key)
    return list(groups.values())
