"""Issue 81: `syncwise dpo` on TRL's preference data. The first step's loss, rewards/* and logps/* equal TRL's
formulas computed here independently from the two models' log-probs (fp32), and its gradient the gradient of TRL's
loss on one process -- for sigmoid, ipo, hinge, robust and simpo, on 1 and 2 ranks, packed (with and without the
shared prompt) and padded; pairs tokenised as TRL does (explicit and implicit prompts, text and conversations);
bad files and rows one line before any rank; a job that learns, resumes and exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cli_harness import run_cli
from dist_harness import run_distributed
from job_output import failed
from numerics import assert_close
from scenarios_dpo import LAYOUTS, LOSSES, dpo_suite
from syncwise.metrics import read_jsonl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
BETA, SMOOTHING, GAMMA = 0.5, 0.2, 0.5


def preference_rows(count: int, seed: int) -> list[dict]:
    """Pairs from the arith_chat task, as `syncwise sft --write-example-data` writes them."""
    from syncwise.sft.tasks import arith_chat_rows, preference_pairs

    return preference_pairs(arith_chat_rows(count, seed))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Llama saved with save_pretrained (its ChatML tokenizer and template), a reference model distinct from it
    (its weights moved), and preference pairs."""
    from transformers import AutoModelForCausalLM

    from user_models import save_model_dir

    root = tmp_path_factory.mktemp("dpo")
    policy = save_model_dir(root, "llama")
    reference = AutoModelForCausalLM.from_pretrained(policy)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(5)
        for param in reference.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    reference.save_pretrained(root / "reference")
    rows = preference_rows(24, seed=3)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _sequences(tokenizer, row: dict) -> list[tuple[list[int], int]]:
    """TRL 1.16's tokenisation of a conversational pair, written out here: the prompt with the generation prompt,
    prompt + completion whole, the completion from where they part."""
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
    whole = [tokenizer.apply_chat_template(row["prompt"] + row[k], return_dict=True)["input_ids"]
             for k in ("chosen", "rejected")]
    start = min(next((i for i, (a, b) in enumerate(zip(prompt, w, strict=False)) if a != b), min(len(prompt), len(w)))
                for w in whole)
    return [(list(w), start) for w in whole]


def _logps(model, sequences: list[tuple[list[int], int]]) -> torch.Tensor:
    """Each sequence's summed log-prob of its completion tokens, one sequence at a time (no padding)."""
    out = []
    for ids, start in sequences:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        token = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
        out.append(token[start - 1:].sum())
    return torch.stack(out)


def trl_scores(loss: str, chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len) -> dict:
    """TRL 1.16's DPOTrainer._compute_loss (and CPOTrainer's simpo) for these log-probs: the loss (a mean over
    pairs) and the logged means."""
    if loss == "simpo":
        chosen, rejected = chosen / chosen_len, rejected / rejected_len
        logits = chosen - rejected - GAMMA / BETA
        losses = -F.logsigmoid(BETA * logits) * (1 - SMOOTHING) - F.logsigmoid(-BETA * logits) * SMOOTHING
        chosen_rewards, rejected_rewards = BETA * chosen, BETA * rejected
    else:
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = chosen_ratio - rejected_ratio
        if loss == "sigmoid":
            losses = -F.logsigmoid(BETA * delta)
        elif loss == "hinge":
            losses = torch.relu(1 - BETA * delta)
        elif loss == "ipo":
            losses = (chosen_ratio / chosen_len - rejected_ratio / rejected_len - 1 / (2 * BETA)) ** 2
        else:  # robust
            losses = (-(1 - SMOOTHING) * F.logsigmoid(BETA * delta)
                      + SMOOTHING * F.logsigmoid(-BETA * delta)) / (1 - 2 * SMOOTHING)
        chosen_rewards, rejected_rewards = BETA * chosen_ratio, BETA * rejected_ratio
    return {"loss": losses.mean(), "rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(), "logps/chosen": chosen.mean(),
            "logps/rejected": rejected.mean()}


@pytest.fixture(scope="module")
def reference_of(folder):
    """The independent first step of each loss: TRL's scores, and its loss's gradient on one process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "llama")
    policy = AutoModelForCausalLM.from_pretrained(folder / "llama", dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(folder / "reference", dtype=torch.float32)
    rows = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    cache: dict = {}

    def compute(loss: str, pairs: list[int]) -> tuple[dict, dict]:
        key = (loss, tuple(pairs))
        if key not in cache:
            sequences = [s for p in pairs for s in _sequences(tokenizer, rows[p])]
            lengths = torch.tensor([float(len(ids) - start) for ids, start in sequences], dtype=torch.float64)
            with torch.no_grad():
                ref = _logps(ref_model, sequences).double()
            policy.zero_grad()
            logps = _logps(policy, sequences)
            scores = trl_scores(loss, logps[0::2], logps[1::2], ref[0::2], ref[1::2], lengths[0::2], lengths[1::2])
            scores["loss"].backward()
            cache[key] = ({k: float(v.detach()) for k, v in scores.items()},
                          {n: p.grad.detach().clone() for n, p in policy.named_parameters()})
        return cache[key]

    return compute


@pytest.fixture(scope="module", params=[1, 2], ids=["1 rank", "2 ranks"])
def ranks(request, folder):
    return run_distributed(dpo_suite, request.param, str(folder))


@pytest.mark.parametrize("loss", LOSSES)
def test_the_first_step_equals_trl_s_formulas_and_its_gradient_trl_s_loss(ranks, reference_of, loss):
    for layout in LAYOUTS:
        got = ranks[0][loss, layout]
        expected, grads = reference_of(loss, got["pairs"])
        assert all(r[loss, layout]["scores"] == got["scores"] for r in ranks), "the ranks agree on the scores"
        assert got["one_pass"] == (layout != "split"), layout  # split pairs: the coefficients' scoring pass
        # fp32 at 1e-5 of the magnitude the values are differences of (the summed log-probs, ~100): a margin of
        # 0.01 is the difference of two such sums' differences, its own relative error far larger
        scale = max(abs(expected["logps/chosen"]), abs(expected["logps/rejected"]), 1.0)
        for name, value in expected.items():
            assert got["scores"][name] == pytest.approx(value, rel=1e-5, abs=1e-5 * scale), (loss, layout, name)
        for name, grad in grads.items():
            assert_close(got["grads"][name], grad, 1e-4, f"{loss} {layout}: {name}")


def test_pairs_are_tokenised_as_trl_tokenises_them(folder):
    """Explicit and implicit prompts, conversations and text: the trained tokens are everything after the prompt
    (a conversation's template text after it, a text completion with the end token TRL appends)."""
    from transformers import AutoTokenizer

    from syncwise.data.preference import extract_prompt, tokenize_pair

    tokenizer = AutoTokenizer.from_pretrained(folder / "llama")
    row = json.loads((folder / "pairs.jsonl").read_text().splitlines()[0])
    prompt, chosen, rejected = tokenize_pair(row, tokenizer)
    assert prompt == tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                   return_dict=True)["input_ids"]
    assert tokenizer.decode(chosen) == row["chosen"][0]["content"] + "<|im_end|>\n"
    assert tokenizer.decode(rejected) == row["rejected"][0]["content"] + "<|im_end|>\n"
    implicit = {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}
    assert tokenize_pair(implicit, tokenizer) == (prompt, chosen, rejected)
    # text: TRL's extract_prompt leaves the space before the split to the completions, and appends the end token
    text = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    assert extract_prompt(text) == {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    prompt, chosen, rejected = tokenize_pair(text, tokenizer)
    assert tokenizer.decode(prompt + chosen) == "The sky is blue." + tokenizer.eos_token
    assert chosen[-1] == rejected[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize(("rows", "said"), [
    ([{"prompt": "q", "answer": "a"}], "dpo.dataset: {path} has no 'chosen' / 'rejected' column (its columns: prompt, "
                                       "answer); preference pairs need 'chosen' and 'rejected'"),
    ([{"prompt": "Say", "chosen": " yes", "rejected": " no"}, {"prompt": "Say", "chosen": " a", "rejected": " a"}],
     "dpo.dataset: {path} line 2: 'chosen' and 'rejected' are the same: the pair prefers nothing (dpo.on_bad_row=skip "
     "leaves such rows out)"),
    ([{"prompt": [{"role": "user", "content": "hi"}], "chosen": [],
       "rejected": [{"role": "assistant", "content": "x"}]}],
     "dpo.dataset: {path} line 1: no trained token in chosen (nothing after the prompt)"),
    ([{"prompt": "Say", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "no"}],
     "dpo.dataset: {path} line 1: 'prompt', 'chosen' and 'rejected' mix text and message lists"),
])
def test_a_file_or_row_that_cannot_be_trained_on_is_one_line_before_any_rank(folder, tmp_path, rows, said):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli(["dpo", f"model.path={folder / 'llama'}", f"dpo.dataset={path}", f"dpo.out_dir={tmp_path / 'o'}"])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("syncwise: error: " + said.format(path=path)), proc.stderr


def test_bad_rows_skipped_are_counted_and_simpo_refuses_a_reference(folder, tmp_path):
    from transformers import AutoTokenizer

    from syncwise.data.preference import load_preference_data

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "Say", "chosen": " yes", "rejected": " no"}, {"prompt": "Say", "chosen": " a", "rejected": " a"},
        {"prompt": "Say " * 40, "chosen": " yes", "rejected": " no"}]))
    data = load_preference_data(str(path), AutoTokenizer.from_pretrained(folder / "llama"), 20, "keep_start", "skip")
    assert (len(data), data.skipped, data.dropped) == (1, 1, 1)
    assert "1 pairs, text, prompt / chosen / rejected, 1 bad row(s) skipped, 1 too long dropped" in data.describe()
    proc = run_cli(["dpo", f"model.path={folder / 'llama'}", f"dpo.dataset={path}", "dpo.loss_type=simpo",
                    f"dpo.ref_model.path={folder / 'reference'}"])
    assert proc.returncode == 2 and "dpo.ref_model.path / dpo.precompute_ref_log_probs: simpo uses no reference" \
        in proc.stderr


def _dpo(out: Path, *overrides: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "syncwise", "dpo", f"dpo.out_dir={out}", "dpo.progress=false",
                           *overrides], env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-2000:], failed(proc.stderr, 3000))
    return [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def test_a_job_learns_the_preference_resumes_exactly_and_exports(folder, tmp_path):
    """2 ranks: the held-out pairs' loss falls, their margin and accuracy rise over the steps; a job stopped
    after 2 steps and resumed gives the uninterrupted job's steps; the export loads with from_pretrained."""
    from transformers import AutoModelForCausalLM

    common = [f"model.path={folder / 'llama'}", f"dpo.dataset={folder / 'pairs.jsonl'}",
              f"dpo.eval_dataset={folder / 'pairs.jsonl'}", "dpo.batch_size=8", "dpo.beta=0.5", "optim.lr=3e-3",
              "dpo.checkpoint_every=2", "dpo.eval_every=2"]
    full = _dpo(tmp_path / "full", *common, "dpo.steps=4")
    import math

    assert full[0]["rewards/accuracies"] == 0.0 and full[0]["loss"] == pytest.approx(math.log(2))  # policy = ref
    # judged on the 24 held-out pairs (a step's 8 pairs swing: 0.75, 0.375, 0.875 here)
    evals = [r for r in full if "eval/rewards/margins" in r]
    assert len(evals) == 2 and evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert evals[-1]["eval/rewards/margins"] > evals[0]["eval/rewards/margins"] + 0.1
    assert evals[-1]["eval/rewards/accuracies"] > 0.8
    _dpo(tmp_path / "split", *common, "dpo.steps=2")
    resumed = _dpo(tmp_path / "split", *common, "dpo.steps=4", "dpo.resume=auto")
    assert [r["train/step"] for r in resumed] == list(range(1, 5))  # the first run's rows kept up to its checkpoint
    for a, b in zip(full[2:], resumed[2:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], rel=1e-3, abs=1e-5)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "export")
    assert model.config.architectures == ["LlamaForCausalLM"]


def test_a_precomputed_reference_and_lora_s_base_score_and_train_as_the_reference_model_does(ranks):
    """dpo.precompute_ref_log_probs scores the pairs once and holds no reference: the same scores and gradient as
    the frozen reference model's. With LoRA the reference is the base with its adapters off (the policy itself at
    the start: loss ln 2, margins 0), precomputed or not, and only the adapters get a gradient."""
    import math

    got, held = ranks[0]["precomputed"], ranks[0]["sigmoid", "shared"]
    assert not got["holds_reference"] and got["pairs"] == held["pairs"]
    assert got["scores"] == pytest.approx(held["scores"], rel=1e-9, abs=1e-12)
    for name, grad in held["grads"].items():
        assert_close(got["grads"][name], grad, 1e-6, f"precomputed: {name}")
    lora, precomputed = ranks[0]["lora"], ranks[0]["lora precomputed"]
    assert lora["scores"]["loss"] == pytest.approx(math.log(2), rel=1e-6) and lora["scores"]["rewards/margins"] == 0
    assert lora["scores"] == pytest.approx(precomputed["scores"], rel=1e-9, abs=1e-12)
    trained = {n for n, g in lora["grads"].items() if g.abs().sum() > 0}
    assert trained and all("lora_" in n for n in trained), trained
    for name, grad in lora["grads"].items():
        assert_close(precomputed["grads"][name], grad, 1e-6, f"lora precomputed: {name}")
