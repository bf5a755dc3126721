"""LoRA (model.lora.*, peft): on 2 gloo ranks in every strategy and sync mode, adapter gradients equal a
single-process full-batch reference, frozen weights never change, only units with adapters reduce-scatter,
held bytes are the adapters'; the KL reference is the base model; checkpoints hold the adapters only;
both exports load and give the trained model's log-probs. Plus the planner and the config."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from numerics import BF16_RTOL, FP32_RTOL, assert_close
from scenarios_lora import LORA_CASES, NUM_MICROBATCHES, RANK, lora_suite
from syncwise.config import ConfigError, load_config
from syncwise.memory.schedule import expected_collectives

UNITS = 3  # qwen2-test: root (embeddings, norm, LM head: frozen) + two decoder layers (with adapters)
TRAINABLE_UNITS = 2


@pytest.fixture(scope="module")
def w2():
    return run_distributed(lora_suite, 2)[0]


CASES = [*LORA_CASES, "fsdp2_deferred_after_reference"]


@pytest.mark.parametrize("case", CASES)
def test_adapter_gradients_equal_single_process_full_batch(w2, case):
    reference, grads = w2["full_batch"], w2[case]["grads"]
    assert set(grads) == set(reference) and len(reference) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    # bf16 compute against the fp32 reference: within ~1% (8-bit mantissa through two layers); the bf16
    # modes agree with each other to BF16_RTOL (below)
    rtol = 3e-2 if case.endswith("bf16") else FP32_RTOL
    for name in reference:
        assert_close(grads[name], reference[name], rtol, f"{case}: {name}")
    assert any(grads[n].abs().max() > 0 for n in grads if ".lora_A." in n)  # A gets a gradient too


def test_bf16_deferred_equals_bf16_per_microbatch(w2):
    deferred, reference = w2["fsdp2_deferred_bf16"]["grads"], w2["fsdp2_per_microbatch_bf16"]["grads"]
    for name in reference:
        assert_close(deferred[name], reference[name], BF16_RTOL, name)


@pytest.mark.parametrize("case", CASES)
def test_frozen_weights_bit_identical_and_adapters_trained(w2, case):
    r = w2[case]
    for name, before in r["frozen_before"].items():
        assert torch.equal(before, r["frozen_after"][name]), f"{case}: {name} changed"
    assert r["adapters_moved"] > 0
    assert all(".lora_" in name for name in r["trainable"])
    assert r["optimizer_params"] == len(r["trainable"])  # AdamW sees only the adapters


@pytest.mark.parametrize(
    ("case", "all_gathers", "reduce_scatters"),
    [
        ("fsdp2_per_microbatch", NUM_MICROBATCHES * (2 * UNITS - 1), NUM_MICROBATCHES * TRAINABLE_UNITS),
        ("fsdp2_deferred", NUM_MICROBATCHES * (2 * UNITS - 1), TRAINABLE_UNITS),
        ("fsdp2_deferred_unsharded", UNITS, TRAINABLE_UNITS),
        # partial(1) defers the layer that saves most per byte (the frozen root holds nothing to defer)
        ("fsdp2_partial_1", NUM_MICROBATCHES * (2 * UNITS - 1), 1 + (TRAINABLE_UNITS - 1) * NUM_MICROBATCHES),
        ("fsdp1_per_microbatch", NUM_MICROBATCHES * (2 * UNITS - 1), NUM_MICROBATCHES * TRAINABLE_UNITS),
        ("fsdp1_deferred", NUM_MICROBATCHES * (2 * UNITS - 1), TRAINABLE_UNITS),
    ],
)
def test_only_units_with_adapters_reduce_scatter(w2, case, all_gathers, reduce_scatters):
    for m in w2[case]["metrics"]:
        assert m["train/num_microbatches"] == NUM_MICROBATCHES
        assert (m["comm/all_gather_count"], m["comm/reduce_scatter_count"]) == (all_gathers, reduce_scatters)
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):  # the audit: no false alarm
            assert m[f"comm/{kind}_count"] == m[f"comm/expected_{kind}_count"]
    mode = case.split("_", 1)[1].replace("_1", "")
    if mode != "partial":
        expected = expected_collectives(mode, NUM_MICROBATCHES, UNITS, trainable_units=TRAINABLE_UNITS,
                                        unsharded_forward=True)
        assert expected["reduce_scatter"] == reduce_scatters


def test_ddp_all_reduces_adapters_once_when_deferred(w2):
    for m in w2["ddp_deferred"]["metrics"]:
        # the engine's normaliser and metrics (replicated gradients need no grad-norm all-reduce) and one
        # gradient bucket: the adapters'
        assert m["comm/all_reduce_count"] == 2 + 1


@pytest.mark.parametrize("case", ["fsdp2_deferred", "fsdp2_deferred_unsharded", "fsdp2_per_microbatch"])
def test_held_gradient_bytes_are_the_adapters(w2, case):
    r = w2[case]
    assert r["retained"] == r["predicted_retained"]
    adapters = sum(g.numel() for g in r["grads"].values()) * 4  # fp32 unsharded, when all are deferred
    if case != "fsdp2_per_microbatch":
        assert r["retained"] == adapters
    else:
        assert r["retained"] < adapters


def test_peft_model_keeps_packing(w2):
    assert w2["fsdp2_deferred"]["packing"] is True
    assert w2["fsdp2_deferred_padded"]["packing"] is False


def test_kl_reference_is_the_base_model_and_adapters_stay_trainable(w2):
    r = w2["reference"]
    assert_close(r["disabled"], r["base"], FP32_RTOL, "adapters off vs the base model")
    assert (r["adapted"] - r["base"]).abs().max() > 1e-3  # the random B makes the adapted model differ
    assert r["requires_grad_after"]


def test_checkpoint_holds_adapters_and_their_optimizer_state_only(w2):
    r = w2["checkpoint"]
    assert r["resume_max_diff"] == 0 and r["resumed_step"] == 2
    tensors = r["checkpoint_tensors"]
    assert all(".lora_" in k for k in tensors)
    # the adapters, AdamW's two moments of each (and its step counters); nothing of the frozen base model
    steps = [k for k in tensors if k.endswith(".step")]
    assert len(steps) == 28 and sum(tensors.values()) == 3 * r["adapter_numel"] + len(steps)
    # on disk (with DCP's per-tensor overhead): a fraction of what the whole model's fp32 state would take
    assert r["checkpoint_file_bytes"] < 3 * 4 * r["model_numel"] / 5


def test_exports_load_and_give_the_trained_log_probs(w2):
    r = w2["checkpoint"]
    assert "adapter" in r["export_files"] and "model.safetensors" in r["export_files"]  # a small model: one file
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["adapter_files"])
    engine = r["engine_log_probs"][:, : r["merged_log_probs"].shape[1]]
    mask = engine != 0
    assert_close(r["merged_log_probs"][mask], engine[mask], FP32_RTOL, "merged export")
    assert_close(r["adapter_log_probs"][mask], engine[mask], FP32_RTOL, "peft adapter export")


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------
def test_merged_state_dict_gives_the_adapted_model():
    from scenarios import engine_config, make_batch
    from scenarios_lora import LORA, lora_model
    from syncwise.models import build_model
    from syncwise.models.lora import LoraMerge

    cfg = engine_config("none", "deferred", *LORA)
    adapted = lora_model(cfg).eval()
    plain = build_model(load_config(None, ["model.preset=qwen2-test"]).model).eval()
    merge = LoraMerge(adapted)
    plain.load_state_dict(merge.merged(adapted.state_dict()))
    batch = make_batch(seed=3)
    with torch.no_grad():
        want = adapted(input_ids=batch["input_ids"]).logits
        got = plain(input_ids=batch["input_ids"]).logits
    assert_close(got, want, FP32_RTOL, "merged")
    assert set(merge.scalings.values()) == {8 / RANK} and not merge.unties


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.rank=-1", "model.lora.rank: must be >= 0"),
        ("model.lora.dropout=1.0", "model.lora.dropout: must be in [0, 1)"),
        ("model.lora.alpha=0", "model.lora.alpha: must be > 0"),
        ("model.lora.target_modules=','", "model.lora.target_modules: empty"),
    ],
)
def test_lora_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        load_config(None, ["model.lora.rank=8", override] if "rank" not in override else [override])


def test_missing_peft_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"model.lora.rank=8 needs peft.*pip install 'syncwise\[lora\]'"):
        load_config(None, ["model.lora.rank=8"])


def test_unknown_target_module_names_the_key():
    from syncwise.models import build_model

    cfg = load_config(None, ["model.preset=qwen2-test", "model.lora.rank=4", "model.lora.target_modules=qkv"])
    with pytest.raises(ValueError, match="model.lora.target_modules='qkv'"):
        build_model(cfg.model)


def test_plan_with_lora_defers_fully_where_without_it_partial():
    """The issue's example: qwen3-4b on 8 x 16 GiB, 4096 tokens, checkpointed."""
    from syncwise.memory.plan import PlanInput, make_plan

    def plan(rank: int):
        return make_plan(PlanInput("qwen3-4b", world_size=8, device_memory_gib=16, seq_len=4096,
                                   micro_batch_size=1, activation_checkpointing=True, lora_rank=rank))

    full, lora = plan(0), plan(16)
    assert full.auto_choice.startswith("partial(")
    # even the gathered parameters (every unit's but the root's, gathered in every mode) fit beside the
    # adapters' gradients, and the materialised logits beside them
    assert lora.auto_choice == "deferred_unsharded, logits materialised"
    assert "deferred_unsharded, logits materialised needs" in lora.auto_reason
    assert "train (LoRA / frozen)" in lora.auto_reason
    rows = {m.mode: m for m in lora.modes}
    # deferral holds the adapters' fp32 gradients: 4 bytes x trainable parameters in all, less their shards
    assert rows["deferred"].retained_grad_bytes == 4 * lora.trainable_params
    assert rows["deferred"].extra_bytes < 0.01 * {m.mode: m for m in full.modes}["deferred"].extra_bytes
    # keeping parameters unsharded still costs the whole (bf16) model
    assert rows["deferred_unsharded"].unsharded_param_bytes >= 2 * full.num_params
    hidden, q, kv, ffn = 2560, 32 * 128, 8 * 128, 9728  # r x (in + out) per projection, 36 layers
    per_layer = (hidden + q) + 2 * (hidden + kv) + (q + hidden) + 2 * (hidden + ffn) + (ffn + hidden)
    assert lora.trainable_params == 16 * 36 * per_layer == 33_030_144


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_the_default_jobs_lora_targets_are_its_presets_only(tmp_path, arch):
    """Issue 38 (3): `syncwise train`'s packaged config targets its random-weight preset's LM head too; on a
    user's model.path LoRA is all-linear -- every decoder projection (GPT-2's Conv1D too), never the (tied)
    head -- and PPO's LoRA critic builds on GPT-2; an explicit override still wins."""
    from syncwise.config import packaged_config
    from syncwise.models import build_model
    from user_models import save_model_dir

    path = save_model_dir(tmp_path, arch)
    preset = load_config(packaged_config("grpo.yaml"), ["model.lora.rank=4"], packaged=True)
    assert preset.model.lora.target_modules.endswith(",lm_head")
    config = load_config(packaged_config("grpo.yaml"), [f"model.path={path}", "model.lora.rank=4",
                                                        "rl.algorithm=ppo"], packaged=True)
    assert config.model.lora.target_modules == "all-linear"
    adapted = {name.rpartition(".lora_A")[0] for name, _ in build_model(config.model).named_parameters()
               if ".lora_A." in name}
    projections = {"gpt2": {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"},
                   "qwen2": {f"self_attn.{p}_proj" for p in "qkvo"} | {f"mlp.{p}_proj" for p in ("gate", "up", "down")}}
    assert {".".join(name.split(".")[-2:]) for name in adapted} == projections[arch]  # and nothing else
    critic = build_model(config.critic_config().model, value_head=True)
    assert any(".lora_A." in name for name, _ in critic.named_parameters())
    explicit = load_config(packaged_config("grpo.yaml"), [f"model.path={path}", "model.lora.rank=4",
                                                          "model.lora.target_modules=c_attn"], packaged=True)
    assert explicit.model.lora.target_modules == "c_attn"
