"""`syncwise sft` on a user's model directory and data (issue 29), as a user runs it on 2 local gloo ranks:
gradients (packed = padded = a single-process full-batch reference), evaluation, checkpoints that resume
mid-epoch bit-identically, an export that transformers loads and chats with, and bad rows stopped before any
rank trains."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cli_harness import run_cli
from dist_harness import run_distributed
from job_output import failed
from numerics import FP32_RTOL, assert_close
from scenarios_sft import sft_suite
from syncwise.metrics import read_jsonl
from syncwise.models.checkpoint_files import read_safetensors
from syncwise.sft.tasks import write_example_data

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(sft_suite, 2)


def test_sft_gradients_packed_and_padded_equal_the_full_batch_reference(ranks):
    assert sorted(ranks[0]["mine"] + ranks[1]["mine"]) == sorted(ranks[0]["samples"])
    reference = ranks[0]["reference"]
    for layout in ("packed", "padded"):
        grads = ranks[0][layout]
        assert set(grads) == set(reference)
        for name in reference:
            assert_close(grads[name], reference[name], FP32_RTOL, f"{layout}: {name}")


def _sft(out, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "syncwise", "sft", f"sft.out_dir={out}", *overrides],
                          env=ENV, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The arith_chat task written as a user's files (64 training rows, 16 held out), and runs on it."""
    root = tmp_path_factory.mktemp("sft")
    data = write_example_data(root / "data", train_rows=64, eval_rows=16, seed=2)
    common = [f"model.path={data / 'model'}", f"sft.dataset={data / 'train.jsonl'}",
              f"sft.eval_dataset={data / 'eval.jsonl'}", "sft.batch_size=8", "sft.eval_every=3",
              "sft.checkpoint_every=3", "optim.lr=3e-3"]  # the split auto's: chosen from the model, alike each run
    runs = {"full": _sft(root / "full", *common, "sft.steps=11")}
    runs["first"] = _sft(root / "split", *common, "sft.steps=5")  # stops mid-epoch (8 steps per epoch)
    runs["resumed"] = _sft(root / "split", *common, "sft.steps=11", "sft.resume=auto")
    for name, proc in runs.items():
        assert proc.returncode == 0, (name, proc.stdout[-2000:], failed(proc.stderr, 3000))
    return {"root": root, "data": data, **runs}


def test_sft_on_user_files_logs_train_and_eval_and_says_what_it_read(user):
    out = user["full"].stdout
    assert "train.jsonl: 64 rows, messages -- chat messages, loss on the assistant turns (assistant tokens from " \
           "the template's generation markers)" in out
    assert "eval.jsonl: 16 rows" in out and "11 steps of 8 sequences (1.38 epochs)" in out
    rows = read_jsonl(user["root"] / "full" / "metrics.jsonl")
    assert [r["train/step"] for r in rows] == list(range(1, 12))
    assert [r["train/step"] for r in rows if "eval/loss" in r] == [3, 6, 9, 11]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert evals[-1] < evals[0] and rows[-1]["loss"] < rows[0]["loss"]
    assert all(0 <= r["eval/token_accuracy"] <= 1 for r in rows if "eval/loss" in r)
    assert rows[-1]["data/epoch"] == pytest.approx(88 / 64) and rows[0]["data/truncated_fraction"] == 0.0
    assert (user["root"] / "full" / "curves.png").stat().st_size > 10_000


def test_resume_mid_epoch_is_bit_identical(user):
    assert "resumed from" in user["resumed"].stdout and "at step 5" in user["resumed"].stdout
    full = read_jsonl(user["root"] / "full" / "metrics.jsonl")
    split = read_jsonl(user["root"] / "split" / "metrics.jsonl")
    assert [r["train/step"] for r in split] == [*range(1, 6), *range(6, 12)]
    for a, b in zip(full, split, strict=True):  # (the first run also evaluated at its own end, step 5)
        for key in ("loss", "train/grad_norm", "token_accuracy", "data/epoch", *(("eval/loss",) * ("eval/loss" in a))):
            assert a[key] == b[key], (a["train/step"], key)
    want, got = read_safetensors(user["root"] / "full" / "export"), read_safetensors(
        user["root"] / "split" / "export")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_export_chats_with_transformers(user):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = user["root"] / "full" / "export"
    assert (export / "chat_template.jinja").is_file()
    # issue 80 (4): a small model is one file, as save_pretrained writes it (it was a shard per wrapping unit)
    assert [p.name for p in export.glob("model*.safetensors*")] == ["model.safetensors"]
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    messages = [{"role": "user", "content": "Ava has 3 apples and buys 4 more. How many apples does Ava have?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    assert tokenizer.decode(prompt["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    start = load_file(user["data"] / "model" / "model.safetensors")
    trained = read_safetensors(export)
    assert any(not torch.equal(start[k], trained[k]) for k in start)


def test_the_export_keeps_the_model_folder_s_generation_config(user):
    """Issue 68 (9): generate() on the export stops where the model's turns end -- its folder's own
    generation_config.json, copied."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

    export = user["root"] / "full" / "export"
    own = GenerationConfig.from_pretrained(user["data"] / "model")
    assert GenerationConfig.from_pretrained(export).to_dict() == own.to_dict()
    assert own.eos_token_id is not None

    class EndAtThird(LogitsProcessor):  # the model "says" its end token as its third token
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - start == 2:
                scores[:, :] = -float("inf")
                scores[:, own.eos_token_id] = 0.0
            return scores

    model = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = torch.tensor([[5, 9, 12]])
    start = ids.shape[1]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False,
                             logits_processor=LogitsProcessorList([EndAtThird()]))
    assert out.shape[1] == start + 3 and int(out[0, -1]) == own.eos_token_id  # stopped there, not at 20


def test_grpo_from_an_sft_export_picks_up_its_tokenizer_and_template(user):
    from syncwise.config import load_config
    from syncwise.rl.env.tasks import load_tokenizer

    export = user["root"] / "full" / "export"
    tokenizer = load_tokenizer(load_config(None, [f"model.path={export}"]))
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


def test_a_bad_row_stops_the_job_before_any_rank_trains(user, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = (user["data"] / "train.jsonl").read_text().splitlines()[:3]
    bad.write_text("\n".join([lines[0], lines[1], '{"messages": [{"role": "user", "content": "hi"}]}', lines[2]]))
    proc = run_cli(["sft", f"sft.out_dir={tmp_path / 'run'}", f"model.path={user['data'] / 'model'}",
                    f"sft.dataset={bad}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"syncwise: error: sft.dataset: {bad} line 3: 'messages' has no assistant turn: nothing to train on "
        "(sft.on_bad_row=skip leaves such rows out)"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    skipped = _sft(tmp_path / "skip", f"model.path={user['data'] / 'model'}", f"sft.dataset={bad}",
                   "sft.on_bad_row=skip", "sft.batch_size=2", "sft.export=false")
    assert skipped.returncode == 0, failed(skipped.stderr, 2000)
    assert "3 rows" in skipped.stdout and "1 bad row(s) skipped" in skipped.stdout
    assert read_jsonl(tmp_path / "skip" / "metrics.jsonl")[0]["data/skipped"] == 1


def test_lora_sft_saves_adapters_only_and_exports_both(user, tmp_path):
    import torch.distributed.checkpoint as dcp
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    data = user["data"]
    proc = _sft(tmp_path / "lora", f"model.path={data / 'model'}", f"sft.dataset={data / 'train.jsonl'}",
                "sft.steps=3", "sft.batch_size=8", "model.lora.rank=4", "model.lora.target_modules=q_proj,v_proj",
                "optim.lr=1e-2")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    step = tmp_path / "lora" / "checkpoints" / "step_000003" / "dcp"
    metadata = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    tensors = [k for k, v in metadata.items() if hasattr(v, "size") and not k.endswith(".step")]
    assert tensors and all(".lora_" in k for k in tensors), tensors  # the adapters and their AdamW moments
    export = tmp_path / "lora" / "export"
    ids = torch.tensor([[1, 5, 9, 12, 40]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(export).eval()(input_ids=ids).logits
        adapter = AutoPeftModelForCausalLM.from_pretrained(export / "adapter").eval()(input_ids=ids).logits
    assert_close(merged, adapter, FP32_RTOL, "merged export vs adapter")


def test_a_max_length_past_the_model_s_positions_is_clamped_and_said(user, tmp_path):
    """Issue 68 (7): sft.max_length=1024 on a model of 96 positions failed after the workers started
    ('sample 0 has 1024 tokens, more than the model's max_position_embeddings'). Now held to the model's positions,
    said in the first lines, and the job trains."""
    from user_models import save_model_dir

    model = save_model_dir(tmp_path, "llama", hidden=32, layers=2, heads=4, inter=64, positions=96)
    proc = _sft(tmp_path / "run", f"model.path={model}", f"sft.dataset={user['data'] / 'train.jsonl'}",
                "sft.max_length=1024", "sft.steps=1", "sft.batch_size=4", "sft.export=false")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert ("syncwise sft: sft.max_length=1024 is past the model's 96 positions (max_position_embeddings): rows are "
            "held to 96 tokens (sft.truncation=right)") in proc.stdout.splitlines()


def test_the_export_s_generation_config_is_the_folder_s_else_the_tokenizer_s(tmp_path):
    """Issue 68 (9), as Qwen ships it: config.json's eos is <|endoftext|>, generation_config.json's the chat
    template's <|im_end|> too -- the export keeps the folder's (before, none: generate() went on past <|im_end|>);
    a preset's export takes the tokenizer's end, padding and start tokens."""
    from transformers import AutoConfig, GenerationConfig

    from syncwise.export import generation_config
    from syncwise.rl.env.tasks import builtin_tokenizer
    from user_models import save_model_dir

    folder = save_model_dir(tmp_path, "qwen2", hidden=32, layers=2, heads=4, inter=64)
    config = AutoConfig.from_pretrained(folder)
    GenerationConfig(eos_token_id=[config.eos_token_id, 7], pad_token_id=config.pad_token_id).save_pretrained(folder)
    assert generation_config(str(folder), None, config).eos_token_id == [config.eos_token_id, 7]
    tokenizer = builtin_tokenizer()
    made = generation_config(None, tokenizer, config)
    assert (made.eos_token_id, made.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)


def test_a_larger_export_is_written_in_shards_with_their_index(tmp_path, monkeypatch):
    """The export's files hold units until about SHARD_BYTES (2 GiB): past it, shards and the index, which
    from_pretrained loads to the same weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from syncwise import export

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    weights = {k: v for k, v in model.state_dict().items()}
    monkeypatch.setattr(export, "SHARD_BYTES", 40_000)  # a few units a file
    writer = export._ShardWriter(tmp_path, config, value_head=False)
    for i in range(config.num_hidden_layers):
        writer.add({k: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")})
    writer.add({k: v for k, v in weights.items() if not k.startswith("model.layers.")})
    writer.finish()
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 2 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
