"""LoRA scenarios run on every rank of a real process group (W=2): every strategy and sync mode, the KL
reference with adapters off, adapter-only checkpoints and the two exports."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from scenarios import engine_config, full_batch_reference, full_grads, full_params, make_batch
from syncwise.checkpoint import CheckpointManager
from syncwise.engine import Engine
from syncwise.export import export_hf
from syncwise.losses import sft_loss
from syncwise.models import build_model
from syncwise.models.lora import adapters_disabled

RANK = 4
LORA = (f"model.lora.rank={RANK}", "model.lora.alpha=8", "optim.name=adamw", "optim.lr=0.01",
        "optim.weight_decay=0.1")
NUM_MICROBATCHES = 3  # 6 samples per rank, micro_batch_size 2

# name -> (strategy, sync mode, extra overrides)
LORA_CASES = {
    "fsdp2_per_microbatch": ("fsdp2", "per_microbatch", ()),
    "fsdp2_deferred": ("fsdp2", "deferred", ()),
    "fsdp2_deferred_unsharded": ("fsdp2", "deferred_unsharded", ()),
    "fsdp2_partial_1": ("fsdp2", "partial", ("sync.deferred_units=1",)),
    "fsdp2_deferred_padded": ("fsdp2", "deferred", ("engine.packing=false",)),
    "fsdp2_deferred_checkpointed": ("fsdp2", "deferred", ("engine.activation_checkpointing=true",)),
    "fsdp2_deferred_bf16": ("fsdp2", "deferred", ("model.param_dtype=bfloat16", "model.reduce_dtype=float32")),
    "fsdp2_per_microbatch_bf16": ("fsdp2", "per_microbatch", ("model.param_dtype=bfloat16",
                                                              "model.reduce_dtype=float32")),
    "fsdp1_per_microbatch": ("fsdp1", "per_microbatch", ()),
    "fsdp1_deferred": ("fsdp1", "deferred", ()),
    "ddp_deferred": ("ddp", "deferred", ()),
}


def lora_model(cfg):
    """The LoRA model of ``cfg`` with every B drawn at random (peft starts B at zero, where A's gradient is
    zero too): the same on every rank and in the reference."""
    model = build_model(cfg.model)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


BATCH_SEED = 500


def _batch(rank: int) -> dict[str, torch.Tensor]:
    return make_batch(seed=BATCH_SEED + rank)


def lora_case(info, strategy: str, mode: str, *extra: str, reference_pass: bool = False) -> dict:
    cfg = engine_config(strategy, mode, *LORA, *extra)
    engine = Engine(cfg, lora_model(cfg), info)
    before = full_params(engine)
    batch = _batch(info.rank)
    if reference_pass:  # the KL reference's pass first: adapters off, then back on
        with adapters_disabled(engine.model):
            engine.forward_batch(batch)
    result = engine.forward_backward_batch(batch, sft_loss)
    grads = full_grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = [engine.train_batch(make_batch(seed=600 + 10 * step + info.rank), sft_loss) for step in range(2)]
    after = full_params(engine)
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    return {
        "grads": {k: v for k, v in grads.items() if ".lora_" in k},
        "frozen_before": {k: v for k, v in before.items() if ".lora_" not in k},
        "frozen_after": {k: v for k, v in after.items() if ".lora_" not in k},
        "adapters_moved": max((after[k] - before[k]).abs().max().item() for k in after if ".lora_" in k),
        "metrics": metrics,
        "trainable": sorted(trainable),
        "packing": engine.features.packing,
        "retained": result.retained_grad_bytes,
        "predicted_retained": engine.memory_model.retained_grad_bytes(engine.active_mode, NUM_MICROBATCHES),
        "num_units": engine.wrapped.num_units,
        "optimizer_params": sum(len(g["params"]) for g in engine.optimizer.param_groups),
    }


def reference_log_probs(info) -> dict:
    """The KL reference with adapters off equals the base model without adapters."""
    cfg = engine_config("fsdp2", "deferred", *LORA)
    engine = Engine(cfg, lora_model(cfg), info)
    batch = _batch(info.rank)
    with adapters_disabled(engine.model):
        disabled = engine.forward_batch(batch).outputs["log_probs"]
    adapted = engine.forward_batch(batch).outputs["log_probs"]
    base_cfg = engine_config("fsdp2", "deferred", "model.lora.rank=0")
    base = Engine(base_cfg, build_model(base_cfg.model), info, trainable=False).forward_batch(batch)
    mask = batch["attention_mask"][:, 1:].bool()
    return {
        "disabled": disabled[mask], "base": base.outputs["log_probs"][mask], "adapted": adapted[mask],
        "requires_grad_after": all(p.requires_grad for n, p in engine.model.named_parameters() if ".lora_" in n),
    }


def checkpoint_and_export(info) -> dict:
    """Train, checkpoint, resume into a fresh engine; export the merged model and the adapter folder."""
    cfg = engine_config("fsdp2", "deferred", *LORA)
    engine = Engine(cfg, lora_model(cfg), info)
    for step in range(2):
        engine.train_batch(make_batch(seed=700 + 10 * step + info.rank), sft_loss)
    trained = full_params(engine)
    batch = _batch(info.rank)
    log_probs = engine.forward_batch(batch).outputs["log_probs"]
    out: dict = {"adapter_numel": sum(p.numel() for n, p in trained.items() if ".lora_" in n),
                 "model_numel": sum(p.numel() for p in trained.values())}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_list = [tmp]
        torch.distributed.broadcast_object_list(tmp_list, src=0)  # one folder for every rank
        root = Path(tmp_list[0])
        saved = CheckpointManager(root / "checkpoints").save(2, engine, {"step": 2})
        resumed = Engine(cfg, lora_model(cfg), info)
        CheckpointManager(root / "checkpoints").load(saved, resumed)
        restored = full_params(resumed)
        out["resume_max_diff"] = max((restored[k] - trained[k]).abs().max().item() for k in trained)
        out["resumed_step"] = resumed.step
        export_hf(engine, None, root / "export")
        if info.rank == 0:
            import torch.distributed.checkpoint as dcp

            metadata = dcp.FileSystemReader(str(saved / "dcp")).read_metadata().state_dict_metadata
            out["checkpoint_tensors"] = {k: v.size.numel() for k, v in metadata.items() if hasattr(v, "size")}
            out["checkpoint_file_bytes"] = sum(f.stat().st_size for f in (saved / "dcp").iterdir())
            out.update(_load_exports(root / "export", batch))
            out["engine_log_probs"] = log_probs
        torch.distributed.barrier()
    return out


def _load_exports(export: Path, batch: dict[str, torch.Tensor]) -> dict:
    """Both exports loaded as a user would, and their log-probs on ``batch``."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    def log_probs(model) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        return logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)

    merged = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    adapter = AutoPeftModelForCausalLM.from_pretrained(export / "adapter", local_files_only=True).eval()
    with torch.no_grad():
        return {"merged_log_probs": log_probs(merged), "adapter_log_probs": log_probs(adapter),
                "export_files": sorted(p.name for p in export.iterdir()),
                "adapter_files": sorted(p.name for p in (export / "adapter").iterdir())}


def lora_suite(info) -> dict:
    out: dict = {}
    for name, (strategy, mode, extra) in LORA_CASES.items():
        out[name] = lora_case(info, strategy, mode, *extra)
    out["fsdp2_deferred_after_reference"] = lora_case(info, "fsdp2", "deferred", reference_pass=True)
    out["reference"] = reference_log_probs(info)
    out["checkpoint"] = checkpoint_and_export(info)
    if info.rank == 0:
        # adapter gradients of the same batches, one plain process
        out["full_batch"] = full_batch_reference(info.world_size, *LORA, build=lora_model, seed=BATCH_SEED)
    return out
