"""`syncwise train rl.algorithm=ppo` as a user runs it (issue 31): the critic trains beside the actor on 2
ranks; both are checkpointed and a resumed run ends bit-identical to an uninterrupted one; the critic's
export loads as a token-classification model; its warm-up holds the actor; LoRA for the critic; GPT-2 and
Llama model directories; mistakes stopped before any rank starts, in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli_harness import run_cli
from job_output import failed
from syncwise.metrics import read_jsonl
from syncwise.models.checkpoint_files import read_safetensors

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
PPO = ["rl.algorithm=ppo", "train.progress=false", "rl.prompts_per_rank=4", "rl.samples_per_prompt=4",
       "optim.warmup_steps=0"]
CRITIC_METRICS = {"critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/values_mean",
                  "critic/returns_mean", "critic/advantages_mean", "time/values_s", "time/critic_update_s",
                  "critic/train/grad_norm", "critic/sync/mode"}


def _train(out: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "syncwise", "train", f"train.out_dir={out}", *PPO, *overrides],
                          env=ENV, capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + failed(proc.stderr, 4000)
    return proc


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """4 PPO steps uninterrupted; the same job stopped after 2 and resumed; both export the critic too."""
    root = tmp_path_factory.mktemp("ppo")
    common = ["train.steps=4", "critic.export=true", "rl.mini_batches=2", "critic.optim.lr=3e-3"]
    full = _train(root / "full", *common, "train.checkpoint_every=0")
    _train(root / "split", "train.steps=2", "critic.export=true", "rl.mini_batches=2", "critic.optim.lr=3e-3")
    resumed = _train(root / "split", *common, "train.resume=auto")
    return {"root": root, "full": full, "resumed": resumed}


def test_ppo_logs_the_critic_beside_the_actor(runs):
    assert "syncwise train: PPO on task target" in runs["full"].stdout
    assert "; critic: preset llama-grpo with a zero-initialised value head, lr 0.003" in runs["full"].stdout
    assert "syncwise: critic: auto sync (" in runs["full"].stdout  # its decision, named as the critic's
    rows = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    assert len(rows) == 4
    for row in rows:
        assert set(row) >= CRITIC_METRICS, CRITIC_METRICS - set(row)
        assert row["train/optimizer_steps"] == 2 and row["critic/train/num_microbatches"] >= 1
        assert abs(row["critic/advantages_mean"]) < 1e-5  # whitened over both ranks' response tokens
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):  # the critic's collectives as its formula
            assert row[f"critic/comm/{kind}_count"] == row[f"critic/comm/expected_{kind}_count"]
    assert rows[0]["critic/values_mean"] == 0.0  # the zero-initialised head
    assert rows[-1]["critic/values_mean"] != 0.0


def test_ppo_resume_is_bit_identical_for_actor_and_critic(runs):
    assert "resumed from" in runs["resumed"].stdout
    for sub in ("export", "export/critic"):
        full, resumed = _weights(runs["root"] / "full" / sub), _weights(runs["root"] / "split" / sub)
        assert full.keys() == resumed.keys()
        for name in full:
            assert torch.equal(full[name], resumed[name]), (sub, name)
    full_rows = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    split_rows = read_jsonl(runs["root"] / "split" / "metrics.jsonl")[-2:]
    for a, b in zip(full_rows[-2:], split_rows, strict=True):
        assert a["critic/vf_loss"] == b["critic/vf_loss"] and a["loss"] == b["loss"]


def test_critic_export_loads_as_a_token_classification_model(runs):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    export = runs["root"] / "full" / "export"
    critic = AutoModelForTokenClassification.from_pretrained(export / "critic", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(export / "critic", local_files_only=True)
    ids = tokenizer("target 3 :", return_tensors="pt")
    assert critic(**ids).logits.shape == (1, 3, 1) and critic.config.num_labels == 1
    actor = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert actor(**ids).logits.shape == (1, 3, len(tokenizer))


def test_critic_warmup_holds_the_actor(tmp_path):
    """critic.warmup_steps=6: the first six steps train the critic only (the actor takes no optimizer step,
    and six such steps in a row are not mistaken for skipped ones); the seventh trains both."""
    _train(tmp_path, "train.steps=7", "critic.warmup_steps=6", "train.checkpoint_every=2")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [("actor/pg_loss" in r) for r in rows] == [False] * 6 + [True]  # 6 critic-only steps in a row are fine
    assert all("critic/vf_loss" in r for r in rows) and rows[0]["train/optimizer_steps"] == 0
    trainer = json.loads((tmp_path / "checkpoints" / "step_000006" / "trainer.json").read_text())
    assert trainer["engine"]["step"] == 0 and trainer["engines"]["critic"]["step"] == 6


@pytest.mark.parametrize("lora", [False, True])
def test_critic_decoder_starts_from_the_warm_started_policy(tmp_path, lora):
    """After rl.warm_start_steps (the actor's alone), the critic's decoder holds the actor's weights: with the
    critic's rate at 0 and the actor waiting one step, both exports show the same decoder tensors (a LoRA
    critic's merged export too: its adapters' B starts at zero)."""
    proc = _train(tmp_path, "rl.task=repeat", "rl.warm_start_steps=2", "train.steps=1", "critic.warmup_steps=1",
                  "critic.optim.lr=0", "critic.export=true", *(["critic.model.lora.rank=4"] if lora else []))
    assert "the critic's decoder starts from it (20 tensors)" in proc.stdout  # embeddings, 2 x 9 layer tensors, norm
    actor, critic = _weights(tmp_path / "export"), _weights(tmp_path / "export" / "critic")
    shared = [name for name in critic if name in actor]
    assert len(shared) == 20
    for name in shared:
        assert torch.equal(actor[name], critic[name]), name
    assert not critic["score.weight"].any()  # the value head is left as it was: zero


def test_kl_in_reward_takes_the_reference_and_the_old_log_probs_first(tmp_path):
    """rl.kl_in_reward: a frozen reference and an old-log-prob pass before the update (the rewards need them
    on-policy too); the penalty is logged under verl's names, 0 on the first step (the policy is the
    reference) and not once the policy has moved."""
    _train(tmp_path, "train.steps=3", "rl.kl_in_reward=0.1", "train.export=false")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(r["time/ref_log_prob_s"] > 0 and r["time/old_log_prob_s"] > 0 for r in rows)
    assert [r["actor/reward_kl_penalty_coeff"] for r in rows] == [0.1] * 3
    # k1 on sampled tokens: its mean is the KL in expectation, of either sign in a batch
    assert abs(rows[0]["actor/reward_kl_penalty"]) < 1e-6 and abs(rows[-1]["actor/reward_kl_penalty"]) > 1e-6


def test_lora_critic_trains_adapters_and_its_head(tmp_path):
    _train(tmp_path, "train.steps=2", "critic.model.lora.rank=4", "critic.export=true")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["critic/values_mean"] != 0.0  # the head (peft's modules_to_save) trains
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "export" / "critic", local_files_only=True)
    assert not any("lora" in name for name, _ in critic.named_parameters())  # merged: a plain model
    assert float(critic.score.weight.detach().abs().max()) > 0
    assert (tmp_path / "export" / "critic" / "adapter" / "adapter_config.json").is_file()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """GPT-2 (Conv1D, learned positions, dropout 0.1 in its config; tied) and a Llama (untied) as
    save_pretrained writes them, with the built-in tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from syncwise.rl.env.tasks import builtin_tokenizer

    root = tmp_path_factory.mktemp("models")
    tokenizer = builtin_tokenizer()
    torch.manual_seed(0)
    ends = {"bos_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id}
    models = {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                           **ends)),
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              tie_word_embeddings=False, **ends)),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_ppo_on_user_model_directories(model_dirs, tmp_path, name):
    """The critic is built from the user's directory (its decoder, a new zero head), dropout off for both."""
    proc = _train(tmp_path, f"model.path={model_dirs / name}", "train.steps=2", "critic.export=true")
    assert "Some weights" not in proc.stderr  # the new head and the unused LM head are meant, not warned about
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert max(r["rollout/log_prob_diff"] for r in rows) <= 1e-6  # dropout off: trainer sees the sampler's net
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "export" / "critic", local_files_only=True)
    original = load_file(str(model_dirs / name / "model.safetensors"))
    decoder = "transformer.h.0.attn.c_attn.weight" if name == "gpt2" else "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(critic.state_dict()[decoder], original[decoder])  # the critic's decoder trained


@pytest.mark.parametrize(("overrides", "message"), [
    (["critic.sync.memory_budget=1000000"], "critic: does not fit beside the actor in any sync mode"),
    (["critic.model.path=/nonexistent"], "critic.model.path: /nonexistent is not a directory"),
    (["critic.optim.lrr=1"], "unknown key 'critic.optim.lrr' (did you mean 'critic.optim.lr'?)"),
    (["rl.skip_uniform_groups=true"], "rl.skip_uniform_groups: a GRPO option"),
    (["critic.sync.mode=sometimes"], "critic.sync.mode: 'sometimes' is not one of"),
])
def test_ppo_mistakes_are_one_line_before_any_rank_starts(tmp_path, overrides, message):
    proc = run_cli(["train", f"train.out_dir={tmp_path}", *PPO, *overrides])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "PPO on" not in proc.stdout  # no rank started


def test_resuming_a_grpo_checkpoint_as_ppo_names_the_missing_critic(tmp_path):
    subprocess.run([sys.executable, "-m", "syncwise", "train", f"train.out_dir={tmp_path}", "train.steps=1",
                    *PPO[1:]], env=ENV, capture_output=True, text=True, timeout=900, check=True)
    proc = _train(tmp_path, "train.steps=2", "train.resume=auto", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "holds no critic" in proc.stderr and "Traceback" not in proc.stderr
