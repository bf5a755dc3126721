"""Issue 60's scenarios on real gloo ranks: models built on the meta device and filled once wrapped, each rank
reading only its own shards, against ``from_pretrained``'s tensors (test_loading.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from syncwise.config import load_config
from syncwise.engine import Engine
from syncwise.losses import sft_loss
from syncwise.models import build_model
from syncwise.models.loading import pending_of

ARCHS = ("llama", "gpt2", "qwen2", "gemma2")
LAYOUTS = ("bf16 file", "sharded fp32")
STRATEGIES = ("fsdp2", "fsdp1", "ddp")


def write_dirs(root: Path) -> dict[tuple[str, str], Path]:
    """Each architecture saved with ``save_pretrained`` twice: one bf16 ``model.safetensors``, and fp32 in shards
    of 20 kB with their index."""
    from transformers import AutoModelForCausalLM

    from user_models import save_model_dir

    dirs = {}
    for arch in ARCHS:
        path = save_model_dir(root / "bf16", arch, hidden=32, layers=2, heads=4, inter=64)
        model = AutoModelForCausalLM.from_pretrained(path)
        model.to(torch.bfloat16).save_pretrained(path)
        dirs[(arch, "bf16 file")] = path
        sharded = root / "sharded" / arch
        model.float().save_pretrained(sharded, max_shard_size="20KB")
        dirs[(arch, "sharded fp32")] = sharded
    return dirs


def _batch(seed: int, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, vocab, (4, 12), generator=gen),
            "attention_mask": torch.ones(4, 12, dtype=torch.long)}


def loaded(info, dirs: dict[tuple[str, str], Path]) -> dict:
    """Every architecture, layout and strategy: the engine's full weights (gathered) on rank 0; whether the model
    was built on the meta device."""
    out = {}
    for (arch, layout), path in dirs.items():
        for strategy in STRATEGIES:
            cfg = load_config(None, [f"model.path={path}", f"engine.strategy={strategy}", "sync.mode=per_microbatch"])
            model = build_model(cfg.model, deferred=True)
            deferred = pending_of(model) is not None
            engine = Engine(cfg, model, info)
            full = engine.full_model_state()
            if info.rank == 0:
                out[(arch, layout, strategy)] = {"deferred": deferred, "weights": {k: v.cpu() for k, v in full.items()}}
    return out


def lora_and_critic(info, path: Path) -> dict:
    """A LoRA model and a critic (value head) from the same directory, built on the meta device: the base weights
    as read, the adapters and the head as the whole build gives them."""
    out = {}
    for label, extra, value_head in (("lora", ["model.lora.rank=4"], False), ("critic", [], True),
                                     ("lora critic", ["model.lora.rank=4"], True)):
        cfg = load_config(None, [f"model.path={path}", "engine.strategy=fsdp2", "sync.mode=per_microbatch", *extra])
        whole = build_model(cfg.model, value_head=value_head)
        engine = Engine(cfg, build_model(cfg.model, value_head=value_head, deferred=True), info)
        full = engine.full_model_state(merge=False)
        if info.rank == 0:
            out[label] = {"got": {k: v.cpu() for k, v in full.items()},
                          "want": {k: v.detach().clone() for k, v in whole.state_dict().items()}}
    return out


def trains_alike(info, path: Path) -> dict:
    """The same job loaded both ways (whole on every rank, and on the meta device): three steps' losses."""
    losses = {}
    for deferred in (False, True):
        cfg = load_config(None, [f"model.path={path}", "engine.strategy=fsdp2", "sync.mode=deferred"])
        engine = Engine(cfg, build_model(cfg.model, deferred=deferred), info)
        losses[deferred] = [engine.train_batch(_batch(50 + s + info.rank, 64), sft_loss)["loss"] for s in range(3)]
    return losses


def seeded_preset(info) -> dict:
    """A preset built on the meta device (the size threshold set to 0): its weights, gathered, at this world size."""
    import syncwise.models as models

    models.DEFERRED_FROM_PARAMS = 0
    cfg = load_config(None, ["model.preset=qwen2-test", "engine.strategy=fsdp2", "sync.mode=per_microbatch"])
    engine = Engine(cfg, info=info)
    full = engine.full_model_state()
    return {k: v.cpu() for k, v in full.items()}


REVIEW_CASES = ("stray file", "single beside shards", "tied config, own head", "gpt2 as the hub stores it",
                "llama with inv_freq buffers")


def review_dirs(root: Path) -> dict[str, Path]:
    """Issue 67's layouts, each a folder ``from_pretrained`` loads: a stray ``model.old.safetensors`` (other values,
    same names) beside ``model.safetensors``; a single-file save left beside a sharded one (transformers reads the
    single file); a config that ties the head and a file holding its own, different head; GPT-2 as the hub's
    ``gpt2`` stores it (no ``transformer.`` prefix, ``attn.bias`` buffers in the file); a Llama file with old
    ``rotary_emb.inv_freq`` buffers."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from user_models import save_model_dir

    def rewrite(folder: Path, tensors: dict, name: str = "model.safetensors") -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})

    sizes = dict(hidden=32, layers=2, heads=4, inter=64)
    gen = torch.Generator().manual_seed(67)
    dirs = {}
    path = save_model_dir(root / "stray", "llama", **sizes)
    weights = load_file(str(path / "model.safetensors"))
    rewrite(path, {k: torch.randn(v.shape, generator=gen) for k, v in weights.items()}, "model.old.safetensors")
    dirs["stray file"] = path
    path = save_model_dir(root / "beside", "llama", **sizes)
    stale = {k: torch.randn(v.shape, generator=gen) for k, v in load_file(str(path / "model.safetensors")).items()}
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(path, max_shard_size="20KB")
    rewrite(path, stale)  # the single file, beside the shards and their index
    dirs["single beside shards"] = path
    path = save_model_dir(root / "own_head", "qwen2", **sizes)
    weights = load_file(str(path / "model.safetensors"))
    rewrite(path, {**weights, "lm_head.weight": torch.randn(weights["model.embed_tokens.weight"].shape, generator=gen)})
    dirs["tied config, own head"] = path
    path = save_model_dir(root / "hub", "gpt2", **sizes)
    weights = load_file(str(path / "model.safetensors"))
    hub = {k.removeprefix("transformer."): v for k, v in weights.items() if k != "lm_head.weight"}
    positions = weights["transformer.wpe.weight"].shape[0]
    hub |= {f"h.{i}.attn.bias": torch.tril(torch.ones(positions, positions)).view(1, 1, positions, positions)
            for i in range(2)}
    rewrite(path, hub)
    dirs["gpt2 as the hub stores it"] = path
    path = save_model_dir(root / "inv_freq", "llama", **sizes)
    weights = load_file(str(path / "model.safetensors"))
    rewrite(path, {**weights, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(4, generator=gen)
                                 for i in range(2)}})
    dirs["llama with inv_freq buffers"] = path
    return dirs


def review_layouts(info, dirs: dict[str, Path], root: Path) -> dict:
    """Each of issue 67's layouts built on the meta device under FSDP2 (DCP reading each rank's slices), then
    exported: the engine's weights and the export's folder, on rank 0."""
    from syncwise.export import export_hf

    out = {}
    for case, path in dirs.items():
        cfg = load_config(None, [f"model.path={path}", "engine.strategy=fsdp2", "sync.mode=per_microbatch"])
        engine = Engine(cfg, build_model(cfg.model, deferred=True), info)
        full = engine.full_model_state()
        export = export_hf(engine, None, root / "export" / case.replace(" ", "_").replace(",", ""))
        if info.rank == 0:
            out[case] = {"weights": {k: v.cpu() for k, v in full.items()}, "export": str(export)}
    return out


def loading_suite(info, root: str) -> dict:
    root = Path(root)
    if info.rank == 0:
        write_dirs(root)
        review_dirs(root / "review")
    torch.distributed.barrier()
    dirs = {(arch, layout): root / ("bf16" if layout == "bf16 file" else "sharded") / arch
            for arch in ARCHS for layout in LAYOUTS}
    review = dict(zip(REVIEW_CASES, (root / "review" / name / arch for name, arch in (
        ("stray", "llama"), ("beside", "llama"), ("own_head", "qwen2"), ("hub", "gpt2"), ("inv_freq", "llama")
    )), strict=True))
    return {"loaded": loaded(info, dirs), "lora": lora_and_critic(info, dirs[("qwen2", "bf16 file")]),
            "trains": trains_alike(info, dirs[("llama", "sharded fp32")]), "preset": seeded_preset(info),
            "review": review_layouts(info, review, root), "review_dirs": {k: str(v) for k, v in review.items()}}


def hsdp_suite(info, root: str) -> dict:
    """4 ranks, 2 replicas of 2 shards: each rank reads its shard of its replica."""
    root = Path(root)
    if info.rank == 0:
        from user_models import save_model_dir

        save_model_dir(root, "qwen2", hidden=32, layers=2, heads=4, inter=64)
    torch.distributed.barrier()
    cfg = load_config(None, [f"model.path={root / 'qwen2'}", "engine.strategy=fsdp2", "engine.hsdp_replicas=2",
                             "sync.mode=per_microbatch"])
    engine = Engine(cfg, info=info)
    full = engine.full_model_state()
    return {k: v.cpu() for k, v in full.items()}
