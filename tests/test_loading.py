"""Issue 60: every rank builds the model on the meta device and reads only its own shards of ``model.path``'s
safetensors (or draws a large preset's on the device), under FSDP2, FSDP1, DDP and HSDP; the loaded weights are
``from_pretrained``'s bit for bit, and a job loaded so trains exactly as one loaded whole. Mistakes in the weights
are one line before any rank starts."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from scenarios_loading import ARCHS, LAYOUTS, REVIEW_CASES, STRATEGIES, hsdp_suite, loading_suite


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(loading_suite, 2, str(tmp_path_factory.mktemp("loading")), timeout_s=900)


def _reference(path):
    from transformers import AutoModelForCausalLM

    return {k: v for k, v in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items()}


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert set(got) <= set(want), (what, sorted(set(got) - set(want)))
    for key, value in got.items():
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), (what, key)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_reads_its_shards_and_gets_from_pretrained_s_weights(ranks, tmp_path_factory, arch, layout,
                                                                       strategy):
    """Llama, GPT-2 (Conv1D, tied), a tied Qwen2 with biases, Gemma-2 (tied, soft-capping); a bf16 file cast to the
    fp32 master weights on the way, and fp32 in shards with their index."""
    result = ranks[0]["loaded"][(arch, layout, strategy)]
    assert result["deferred"]
    root = next(iter(tmp_path_factory.getbasetemp().glob("loading*")))
    path = root / ("bf16" if layout == "bf16 file" else "sharded") / arch
    want = _reference(path)
    _assert_equal(result["weights"], want, f"{arch}, {layout}, {strategy}")
    assert set(result["weights"]) | {"lm_head.weight"} >= set(want)  # a tied head is its embedding


@pytest.mark.parametrize("case", REVIEW_CASES)
def test_layouts_from_pretrained_loads_are_its_weights_bit_for_bit_through_the_export(ranks, case):
    """Issue 67: exactly the files from_pretrained reads (a stray file ignored), a head the file holds apart from a
    tied embedding kept apart, transformers' own key rules (the hub's GPT-2 prefix, ignored buffers) -- under FSDP2,
    and the job's export reloads with from_pretrained's logits."""
    from transformers import AutoModelForCausalLM

    result, path = ranks[0]["review"][case], ranks[0]["review_dirs"][case]
    want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = want.state_dict()
    _assert_equal(result["weights"], reference, case)
    assert set(result["weights"]) >= set(reference) - {"lm_head.weight"}
    exported = AutoModelForCausalLM.from_pretrained(result["export"], dtype=torch.float32).eval()
    ids = torch.randint(0, want.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, want(ids).logits), case
    tied = want.get_output_embeddings().weight is want.get_input_embeddings().weight
    assert exported.config.tie_word_embeddings == tied, case


def test_a_missing_shard_or_a_truncated_file_is_one_line_before_any_rank(tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    from cli_harness import run_cli
    from user_models import save_model_dir

    whole = save_model_dir(tmp_path / "whole", "llama", hidden=32, layers=2, heads=4, inter=64)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(whole).save_pretrained(sharded, max_shard_size="20KB")
    shutil.copy(whole / "tokenizer.json", sharded)
    gone = sorted(sharded.glob("model-*.safetensors"))[1]
    gone.unlink()
    truncated = tmp_path / "truncated"
    shutil.copytree(whole, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-1000])
    said = {sharded: f"model.path: {sharded / 'model.safetensors.index.json'} names {gone.name}, which is not there",
            truncated: f"model.path: {truncated / 'model.safetensors'} is no whole safetensors file"}
    for folder, start in said.items():
        proc = run_cli(["train", f"model.path={folder}"])
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"syncwise: error: {start}"), \
            proc.stderr


def test_lora_adapters_and_a_critic_s_head_are_the_whole_build_s(ranks):
    """The base read from the checkpoint; LoRA's A drawn from model.seed and B zero, a critic's head zero -- as
    the model built whole has them."""
    for label, r in ranks[0]["lora"].items():
        got, want = r["got"], r["want"]
        assert set(got) == set(want), (label, sorted(set(got) ^ set(want)))
        for key in got:
            assert torch.equal(got[key], want[key]), (label, key)
        assert any(".lora_A." in k for k in got) == ("lora" in label)


def test_a_job_loaded_on_the_meta_device_trains_as_one_loaded_whole(ranks):
    for rank in ranks:
        whole, deferred = rank["trains"][False], rank["trains"][True]
        assert deferred == pytest.approx(whole, rel=1e-6)


def test_a_large_preset_is_drawn_alike_at_every_world_size(ranks):
    """Seeded per tensor, drawn whole on the device and sliced: world size 2 gives what world size 1 gives."""
    import syncwise.models as models
    from syncwise.config import load_config
    from syncwise.models import build_model
    from syncwise.models.loading import materialize

    two = ranks[0]["preset"]
    models_threshold = models.DEFERRED_FROM_PARAMS
    try:
        models.DEFERRED_FROM_PARAMS = 0
        model = build_model(load_config(None, ["model.preset=qwen2-test"]).model, deferred=True)
        materialize(model, torch.device("cpu"))
    finally:
        models.DEFERRED_FROM_PARAMS = models_threshold
    one = model.state_dict()
    _assert_equal(two, one, "world size 2 vs 1")
    assert two["model.norm.weight"].eq(1).all() and two["model.layers.0.self_attn.q_proj.bias"].eq(0).all()
    std = float(two["model.layers.0.mlp.up_proj.weight"].std())
    assert 0.015 < std < 0.025  # normal with the config's initializer_range, 0.02


def test_hsdp_ranks_read_their_replica_s_shards(tmp_path):
    result = run_distributed(hsdp_suite, 4, str(tmp_path), timeout_s=900)[0]
    _assert_equal(result, _reference(tmp_path / "qwen2"), "HSDP 2 x 2")


def _bad_dirs(root):
    """A Qwen2 directory four ways wrong: a tensor taken out, one with another shape, one extra, one in int8."""
    from safetensors.torch import load_file, save_file

    from user_models import save_model_dir

    good = save_model_dir(root / "good", "qwen2", hidden=32, layers=2, heads=4, inter=64)
    weights = load_file(str(good / "model.safetensors"))
    variants = {
        "missing": {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
        "shape": {**weights, "model.layers.0.mlp.down_proj.weight": torch.zeros(32, 60)},
        "extra": {**weights, "model.layers.0.mlp.gate_proj.lora_bias": torch.zeros(4)},
        "int8": {**weights, "model.norm.weight": torch.ones(32, dtype=torch.int8)},
    }
    dirs = {}
    for name, tensors in variants.items():
        import shutil

        folder = root / name
        shutil.copytree(good, folder)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        dirs[name] = folder
    return dirs


def test_wrong_weights_are_one_line_naming_the_tensor_and_the_file_before_any_rank(tmp_path):
    from cli_harness import run_cli
    from syncwise.config import load_config
    from syncwise.jobs.preflight import PreflightError, check_model

    dirs = _bad_dirs(tmp_path)
    said = {
        "missing": f"model.path: {dirs['missing']} has no tensor model.layers.1.mlp.up_proj.weight (the model needs "
                   "it: (64, 32))",
        "shape": f"model.path: {dirs['shape'] / 'model.safetensors'}: tensor model.layers.0.mlp.down_proj.weight has "
                 "shape (32, 60), the model's is (32, 64)",
        "extra": f"model.path: {dirs['extra'] / 'model.safetensors'}: tensor model.layers.0.mlp.gate_proj.lora_bias "
                 "has no place in the model",
        "int8": f"model.path: {dirs['int8'] / 'model.safetensors'}: tensor model.norm.weight is I8, which does not "
                "cast to the float weights the model trains",
    }
    for name, folder in dirs.items():
        with pytest.raises(PreflightError) as info:
            check_model(load_config(None, [f"model.path={folder}"]))
        assert str(info.value).startswith(said[name]) and "\n" not in str(info.value), str(info.value)
    check_model(load_config(None, [f"model.path={tmp_path / 'good' / 'qwen2'}"]))
    proc = run_cli(["train", f"model.path={dirs['missing']}"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"syncwise: error: {said['missing']}"]


def test_a_hub_id_resolves_from_a_populated_cache_offline_and_a_missing_one_is_one_line(tmp_path):
    """Issue 80 (3): model.path=org/name, as TRL users name models, is the snapshot folder in the Hugging Face cache
    (HF_HUB_OFFLINE=1: nothing downloaded), resolved before any rank starts; an id with no cache is one line."""
    import os
    import shutil
    import subprocess
    import sys

    from user_models import save_model_dir

    saved = save_model_dir(tmp_path / "saved", "llama")
    cache = tmp_path / "hub"
    snapshot = cache / "models--syncwise-test--tiny-llama" / "snapshots" / ("a" * 40)
    shutil.copytree(saved, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}

    def sft(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "syncwise", "sft", *args, f"sft.out_dir={tmp_path / 'out'}"],
                              env=env, capture_output=True, text=True, timeout=300)

    proc = sft("model.path=syncwise-test/tiny-llama", f"sft.dataset={tmp_path / 'none.jsonl'}")
    assert f"model.path=syncwise-test/tiny-llama: the Hugging Face cache's {snapshot}" in proc.stdout, proc.stdout
    assert proc.returncode == 2 and f"sft.dataset: {tmp_path / 'none.jsonl'} does not exist" in proc.stderr  # past it
    missing = sft("model.path=syncwise-test/absent")
    assert missing.returncode == 2 and missing.stderr.strip() == (
        "syncwise: config error: model.path: syncwise-test/absent is no folder here, nor a model in the Hugging Face "
        "cache; HF_HUB_OFFLINE=1, so nothing is downloaded: download it first (`hf download syncwise-test/absent`) "
        "or unset HF_HUB_OFFLINE"), missing.stderr
