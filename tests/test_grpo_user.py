"""`syncwise train` on a user's model directory and prompts, as a user runs it (issue 30): chat prompts,
reward functions from the working folder, several with weights, stop strings; dropout off so the trainer
sees the network the sampler drew from; bad prompts stopped before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli_harness import run_cli
from job_output import failed
from syncwise.metrics import read_jsonl
from syncwise.sft.tasks import write_example_data

QUICK = ["train.progress=false", "rl.prompts_per_rank=2", "rl.samples_per_prompt=4", "train.export=false",
         "train.checkpoint_every=0", "optim.warmup_steps=0"]


def _train(cwd, *overrides: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"HF_HUB_OFFLINE": "1", **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "syncwise", "train", *QUICK, *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("chat"), train_rows=8, eval_rows=4, prompt_rows=16)


def test_chat_prompts_and_rewards_from_the_working_folder(chat, tmp_path):
    (tmp_path / "my_rewards.py").write_text("def score(prompt, response, row):\n    return float('####' in response)\n")
    proc = _train(tmp_path, f"model.path={chat / 'model'}", f"rl.dataset={chat / 'prompts.jsonl'}",
                  "rl.reward_fn=[my_rewards:score, syncwise.rewards:final_number]", "rl.reward_weights=[1, 0.5]",
                  "rl.max_new_tokens=8", "rl.stop=['####']", "rl.top_p=0.95", "train.steps=2",
                  f"train.out_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert "(16 prompts, through the chat template)" in proc.stdout and "responses up to 8 tokens" in proc.stdout
    for row in read_jsonl(tmp_path / "out" / "metrics.jsonl"):
        assert {"reward/score", "reward/final_number", "response/clipped_fraction"} <= set(row)
        assert row["reward/mean"] == pytest.approx(row["reward/score"] + 0.5 * row["reward/final_number"])


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """GPT-2 as save_pretrained writes it, with its default dropout (0.1) in the config."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from syncwise.rl.env.tasks import builtin_tokenizer

    path = tmp_path_factory.mktemp("gpt2")
    tokenizer = builtin_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    assert config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("dropout", ["auto", "keep"])
def test_dropout_is_off_for_grpo_unless_kept(gpt2, tmp_path, dropout):
    proc = _train(tmp_path, f"model.path={gpt2}", f"model.dropout={dropout}", "train.steps=2",
                  f"train.out_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    diffs = [r["rollout/log_prob_diff"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")]
    if dropout == "auto":  # off: the trainer's log-probs are the sampler's (fp32)
        assert max(diffs) <= 1e-6, diffs
    else:  # dropout noise in every training-side log-prob
        assert min(diffs) > 1e-3, diffs


def test_first_on_policy_ratio_is_exactly_one_with_lora_dropout(gpt2, tmp_path):
    proc = _train(tmp_path, f"model.path={gpt2}", "model.lora.rank=8", "model.lora.dropout=0.3",
                  "model.lora.target_modules=c_attn", "rl.old_log_prob_pass=true", "train.steps=1",
                  f"train.out_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    row = read_jsonl(tmp_path / "out" / "metrics.jsonl")[0]
    # dropout off in both passes: the same function (the old log-prob pass and the update sum in their own
    # orders: float32 rounding apart, where a dropout mask would move the ratio by tens of percent)
    assert row["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert row["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize(("rows", "overrides", "message"), [
    ([{"prompt": "target 3 :"}, {"prompt": " "}], [], "line 2 has an empty 'prompt'"),
    ([{"text": "x"}], [], "line 1 has no 'prompt'"),
    ([{"prompt": [{"role": "user", "content": "hi"}], "answer": "3"}], [],
     "line 1: the prompt needs the tokenizer's chat template, and the tokenizer has none"),
    ([{"prompt": "target 3 : " * 20, "answer": "3"}], ["rl.max_prompt_length=8", "rl.prompt_overflow=error"],
     "line 1: the prompt has 60 tokens, more than rl.max_prompt_length=8 (rl.prompt_overflow=truncate_left or drop)"),
])
def test_a_bad_prompt_is_one_line_and_exit_2(gpt2, tmp_path, rows, overrides, message):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli(["train", *QUICK, f"model.path={gpt2}", f"rl.dataset={data}",
                    "rl.reward_fn=syncwise.rewards:final_number", f"train.out_dir={tmp_path / 'out'}", *overrides],
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"syncwise: error: rl.dataset: {data} {message}"]
    assert not (tmp_path / "out").exists()


def test_a_prompt_and_response_past_the_model_s_positions_is_one_line_and_exit_2(gpt2, tmp_path):
    """GPT-2's 64 learned positions: a 60-token prompt and 8 new tokens failed at the first step's batch check
    (found by a script's trainer with the tools' template); now one line before any rank."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "target 3 : " * 20, "answer": "3"}) + "\n")
    proc = run_cli(["train", *QUICK, f"model.path={gpt2}", f"rl.dataset={data}", "rl.max_new_tokens=8",
                    "rl.reward_fn=syncwise.rewards:final_number", f"train.out_dir={tmp_path / 'out'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "syncwise: error: rl.max_new_tokens: the longest prompt (60 tokens; rl.max_prompt_length=512) and 8 new "
        "tokens need 68 positions; the model has 64 (max_position_embeddings): lower rl.max_prompt_length or "
        "rl.max_new_tokens"]
    assert not (tmp_path / "out").exists()


def test_a_prompt_the_chat_template_refuses_is_one_line_and_exit_2(tmp_path):
    """Issue 38 (10): a Gemma-style template's refusal (a system message) names the file and line, exit 2."""
    from syncwise.sft.tasks import arith_chat_rows, chat_tokenizer
    from user_models import GEMMA_TEMPLATE, save_model_dir

    tokenizer = chat_tokenizer(arith_chat_rows(50, seed=1))
    tokenizer.chat_template = GEMMA_TEMPLATE
    model = save_model_dir(tmp_path, "llama", tokenizer)
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "2 + 2?"}], "answer": "4"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
             "answer": "4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli(["train", *QUICK, f"model.path={model}", f"rl.dataset={data}",
                    "rl.reward_fn=syncwise.rewards:final_number", f"train.out_dir={tmp_path / 'out'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"syncwise: error: rl.dataset: {data} line 2: the prompt was refused by the chat template: System role not "
        "supported"]


@pytest.mark.parametrize("sampler", ["compact", "generate"])
def test_truncated_sampling_is_said_and_compared_on_the_same_distribution(gpt2, tmp_path, sampler):
    """Issue 38 (9): with rl.top_p the sampler's kept log-probs are of the untruncated distribution, as the
    trainer's: on-policy in fp32 rollout/log_prob_diff is rounding (it was ~0.3, the truncation itself) and
    rollout_is=token weights stay 1 (they were the kept mass, ~0.7); the kept mass is its own metric, and the
    run says once what truncation does."""
    proc = _train(tmp_path, f"model.path={gpt2}", "rl.top_p=0.7", "rl.loss.rollout_is=token", "train.steps=2",
                  f"rl.rollout_engine={sampler}", f"train.out_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert proc.stderr.count("syncwise: warning: rl.top_k / rl.top_p / rl.min_p truncate the sampler's") == 1
    for row in read_jsonl(tmp_path / "out" / "metrics.jsonl"):
        assert row["rollout/log_prob_diff"] < 1e-4, row["rollout/log_prob_diff"]
        assert row["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert 0.3 < row["rollout/kept_mass"] < 0.999
