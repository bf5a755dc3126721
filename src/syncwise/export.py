"""A trained model as a Hugging Face model folder (``export_hf``), written a shard at a time.

``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it: safetensors shards with their index,
``config.json`` and ``generation_config.json`` (``generate()`` stops at the model's end token), the tokenizer beside
them; with LoRA the merged model and peft's adapter folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from .engine import Engine
from .models import lora as lora_adapters
from .runtime.distributed import rank_and_world


def export_hf(engine: Engine, tokenizer, out_dir: str | Path, base_path: str | None = None) -> Path | None:
    """Collective: write a Hugging Face model (safetensors + config) and tokenizer to ``out_dir`` on rank 0.
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it.

    Streamed: the weights are gathered one wrapping unit at a time (:meth:`Engine.full_weights_by_unit`) and
    rank 0 writes them in files of about :data:`SHARD_BYTES` (``model-0000k-of-0000n.safetensors`` with the index;
    a smaller model one ``model.safetensors``), so no rank ever holds the whole model beside its shards.

    With LoRA, ``out_dir`` holds the merged model (each adapted weight plus its peft layer's delta; untied
    where an adapter sits on a tied embedding) and ``out_dir/adapter`` the peft adapter folder
    (``PeftModel.from_pretrained(base, out_dir/"adapter")``); its base is ``base_path`` (``model.path``) or,
    for a model built from a preset, the base weights written to ``out_dir/base``."""
    rank, _ = rank_and_world()
    out = Path(out_dir)
    features = engine.features
    lora = features.lora_merge if features.lora else None
    merged = _ShardWriter(out, features.plain_hf_config, features.value_head) if rank == 0 else None
    base = (_ShardWriter(out / "base", features.hf_config, features.value_head)
            if rank == 0 and lora is not None and not base_path else None)
    adapters: dict[str, torch.Tensor] = {}
    for unit in engine.full_weights_by_unit(merge=False):  # every rank gathers; rank 0 writes
        if rank == 0:
            merged.add(lora.merged(unit) if lora is not None else unit)
            if base is not None:
                base.add(lora.merged(unit, deltas=False))
            if lora is not None:
                adapters |= {k: v.cpu() for k, v in unit.items() if _is_adapter_key(k)}
        unit = None  # before the next unit is gathered
    if rank == 0:
        merged.finish()
        if base is not None:
            base.finish()
        if lora is not None:
            _save_adapter(engine, adapters, out, str(Path(base_path).resolve()) if base_path
                          else str((out / "base").resolve()))
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        if not features.value_head:
            generation_config(base_path, tokenizer, features.plain_hf_config).save_pretrained(out)
    if dist.is_initialized():
        dist.barrier()
    return out if rank == 0 else None


SHARD_BYTES = 2 << 30  # units are gathered into files of about this size: a small model is one file, as save_pretrained


class _ShardWriter:
    """A Hugging Face model folder written a shard at a time: ``add`` a unit's tensors (the tied weight's second name
    left out, as ``save_pretrained`` does), held until :data:`SHARD_BYTES` are, then written as one safetensors
    file; ``finish`` the last, the index (a single file is ``model.safetensors``, no index) and ``config.json``."""

    def __init__(self, out: Path, hf_config, value_head: bool):
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING

        out.mkdir(parents=True, exist_ok=True)
        for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)  # an earlier export's shards, whose count may differ
        self.out, self.config, self.files = out, copy_config(hf_config), []
        mapping = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING if value_head else MODEL_FOR_CAUSAL_LM_MAPPING
        self.config.architectures = [mapping[type(hf_config)].__name__]
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.held: dict[str, torch.Tensor] = {}
        tied = getattr(hf_config, "tie_word_embeddings", False) and not value_head
        self.drop = {"lm_head.weight"} if tied else set()

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.held |= {k: v.detach().to("cpu").contiguous() for k, v in tensors.items() if k not in self.drop}
        if sum(t.numel() * t.element_size() for t in self.held.values()) >= SHARD_BYTES:
            self._write()

    def _write(self) -> None:
        from safetensors.torch import save_file

        if not self.held:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.held, str(self.out / name), metadata={"format": "pt"})
        self.files.append(name)
        self.weight_map |= dict.fromkeys(self.held, name)
        self.total += sum(t.numel() * t.element_size() for t in self.held.values())
        self.held = {}

    def finish(self) -> None:
        self._write()
        count = len(self.files)
        if count == 1:
            os.replace(self.out / self.files[0], self.out / "model.safetensors")
        else:
            final = {name: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i, name in enumerate(self.files)}
            for name, target in final.items():
                os.replace(self.out / name, self.out / target)
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: final[v] for k, v in sorted(self.weight_map.items())}}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        self.config.save_pretrained(self.out)


def generation_config(base_path: str | None, tokenizer, hf_config):
    """The export's ``generation_config.json``, so that ``generate()`` on it stops where the model's turns end: the
    model folder's own, else one from the tokenizer's end, padding and start tokens (the config's where it has
    none)."""
    from transformers import GenerationConfig

    if base_path and (Path(base_path) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(base_path)
    ends = {name: getattr(tokenizer, name, None) if tokenizer is not None else None
            for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return GenerationConfig(**{name: value if value is not None else getattr(hf_config, name, None)
                               for name, value in ends.items()})


def copy_config(hf_config):
    import copy

    return copy.deepcopy(hf_config)


def _is_adapter_key(key: str) -> bool:
    """A peft state-dict key of the adapter's own (what its folder holds): LoRA's matrices, a module it trains whole."""
    return ".lora_" in key or ".modules_to_save." in key or ".original_module." in key


def _save_adapter(engine: Engine, adapters: dict[str, torch.Tensor], out: Path, base_name: str) -> None:
    """``out/adapter``: peft's adapter folder (config + adapter weights) naming its base model, as
    ``PeftModel.save_pretrained`` writes it, from the adapter tensors alone: peft's keys with the adapter's name
    taken out (``...lora_A.default.weight`` -> ``...lora_A.weight``; a module trained whole under its own name).
    The base weights are frozen and stored beside it: no copy of an adapted LM head / embedding in the folder."""
    import copy

    from safetensors.torch import save_file

    live = lora_adapters.peft_model_of(engine.model)
    adapter_config = copy.deepcopy(live.peft_config[lora_adapters.ADAPTER])
    adapter_config.base_model_name_or_path = base_name
    folder = out / "adapter"
    folder.mkdir(parents=True, exist_ok=True)
    name = lora_adapters.ADAPTER
    weights = {}
    for key, value in adapters.items():
        if ".original_module." in key:
            continue
        key = key.replace(f".modules_to_save.{name}.", ".").replace(f".{name}.", ".").removesuffix(f".{name}")
        key = key if key.startswith(lora_adapters.PEFT_PREFIX) else lora_adapters.PEFT_PREFIX + key
        weights[key] = value.detach().cpu().contiguous()
    save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config.save_pretrained(str(folder))
