"""Issue 80 (1, 2) and 81: a TRL script with one import changed. ``GRPOTrainer`` / ``SFTTrainer`` / ``DPOTrainer``
with their configs from ``syncwise``: TRL's fields mapped to syncwise's keys; a reward function, a dataset made in
memory, a model and tokenizer object and a ``TrainerCallback`` defined in the script reach every rank; ``python
script.py`` runs 2 local ranks and ``torchrun --nproc-per-node 2`` the same job alike; ``save_model`` writes a
folder ``from_pretrained`` loads; a mistake is one line before any rank, a rank's error a ``JobFailed``."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from job_output import failed
from syncwise.config import ConfigError
from syncwise.config.trl_args import fields_set, trl_overrides
from syncwise.metrics import read_jsonl
from tool_model_jobs import completions_table

GRPO_SCRIPT = '''
import sys

from datasets import Dataset

from syncwise import GRPOConfig, GRPOTrainer

dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say a word with {i} letters."}]}
                             for i in range(16)])


def reward_len(completions, **kwargs):
    """TRL's quickstart reward: completions near 20 characters."""
    return [-abs(20 - len(c[0]["content"])) / 20 for c in completions]


args = GRPOConfig(output_dir=sys.argv[1], learning_rate=1e-5, num_generations=4, max_completion_length=16,
                  max_steps=2, per_device_train_batch_size=8, logging_steps=1, report_to="none",
                  **{"train.progress": False})
trainer = GRPOTrainer(model="qwen2", reward_funcs=[reward_len], args=args, train_dataset=dataset)
out = trainer.train()
print("TRAINED", out.global_step, flush=True)
trainer.save_model(sys.argv[1] + "_model")
'''

SFT_DPO_SCRIPT = '''
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from syncwise import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                      {"role": "assistant", "content": f"{i + 1}"}]} for i in range(32)]


class Seen(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        print("CALLBACK", state.global_step, args.output_dir, f"{logs['loss']:.6f}", flush=True)


trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained("qwen2"),
                     args=SFTConfig(output_dir="sft_run", learning_rate=1e-3, max_steps=3,
                                    per_device_train_batch_size=4, max_length=256, report_to="none"),
                     train_dataset=Dataset.from_list(rows),
                     processing_class=AutoTokenizer.from_pretrained("qwen2"), callbacks=[Seen()])
out = trainer.train()
print("TRAINED", out.global_step, f"{out.training_loss:.6f}", flush=True)
trainer.save_model("sft_model")

# then DPO from the SFT model, in the same script: the ranks of this second job run the script up to here
pairs = [{"prompt": [{"role": "user", "content": f"Is {i} even?"}],
          "chosen": [{"role": "assistant", "content": "yes" if i % 2 == 0 else "no"}],
          "rejected": [{"role": "assistant", "content": "no" if i % 2 == 0 else "yes"}]} for i in range(16)]
trainer = DPOTrainer(model="sft_model", args=DPOConfig(output_dir="dpo_run", beta=0.1, max_steps=1, report_to="none",
                                                       per_device_train_batch_size=2),
                     train_dataset=pairs, eval_dataset=pairs[:4])
trainer.train()
print("EVALUATED", sorted(trainer.evaluate()), flush=True)
'''

FAILING_SCRIPT = '''
from syncwise import GRPOConfig, GRPOTrainer


def strict_reward(completions, **kwargs):
    raise KeyError("target_digit")


GRPOTrainer(model="qwen2", reward_funcs=strict_reward,
            args=GRPOConfig(output_dir="failing_run", max_steps=1, num_generations=2, max_completion_length=4,
                            per_device_train_batch_size=2),
            train_dataset=[{"prompt": "Count:"}] * 4).train()
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from user_models import save_model_dir

    root = tmp_path_factory.mktemp("trainers_api")
    save_model_dir(root, "qwen2")
    for name, text in (("grpo.py", GRPO_SCRIPT), ("sft_dpo.py", SFT_DPO_SCRIPT), ("failing.py", FAILING_SCRIPT)):
        (root / name).write_text(text)
    return root


def _run(folder: Path, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, *command], cwd=folder, capture_output=True, text=True, env=env,
                          timeout=600)


def test_trl_fields_map_to_syncwise_keys():
    keys = trl_overrides("train", {"learning_rate": 1e-6, "num_generations": 4, "per_device_train_batch_size": 8,
                                   "gradient_accumulation_steps": 2, "max_completion_length": 64, "epsilon": 0.3,
                                   "loss_type": "dr_grpo", "scale_rewards": "none", "report_to": ["wandb"],
                                   "beta": 0.04, "engine.micro_batch_size": 2}, world_size=2)
    assert keys == {"optim.lr": 1e-6, "rl.samples_per_prompt": 4, "rl.max_new_tokens": 64, "rl.loss.clip_low": 0.3,
                    "rl.loss.clip_high": 0.3, "rl.loss.agg": "seq-mean-token-sum-norm", "rl.advantage": "drgrpo",
                    "train.logger": ["jsonl", "wandb"], "rl.loss.kl_coef": 0.04, "engine.micro_batch_size": 2,
                    "rl.loss.norm_constant": 64, "rl.prompts_per_rank": 4}  # 8 x 2 completions over 4 a prompt
    assert trl_overrides("sft", {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}, 2) == {
        "sft.batch_size": 16}  # sequences a step over all ranks
    assert trl_overrides("dpo", {"beta": 0.2, "loss_type": ["sigmoid", "bco_pair"], "output_dir": "d"}, 2) == {
        "dpo.beta": 0.2, "dpo.loss_type": ["sigmoid", "bco_pair"], "dpo.out_dir": "d"}
    with pytest.raises(ConfigError, match=r"^push_to_hub, use_liger_kernel: no counterpart in syncwise's train"):
        trl_overrides("train", {"use_liger_kernel": True, "push_to_hub": True, "seed": 3}, 2)
    with pytest.raises(ConfigError, match="6 completions a rank: not a multiple of num_generations=4"):
        trl_overrides("train", {"per_device_train_batch_size": 6, "num_generations": 4}, 2)
    with pytest.raises(ConfigError, match="loss_type='cispo': syncwise has TRL's dapo, bnpo, grpo, dr_grpo"):
        trl_overrides("train", {"loss_type": "cispo"}, 2)

    @dataclasses.dataclass
    class TRLShaped:  # shaped as TRL 1.16's configs (read there too): __post_init__ derives fields from others and
        # refuses a CPU machine without use_cpu, so a default instance is made with the object's use_cpu
        output_dir: str | None = None
        learning_rate: float = 1e-6
        num_generations: int = 8
        bf16: bool = True
        use_cpu: bool = False
        logging_dir: str | None = None

        def __post_init__(self):
            if not self.use_cpu:
                raise ValueError("Your setup doesn't support bf16/gpu.")
            self.logging_dir = f"{self.output_dir}/runs"

    given = fields_set(TRLShaped(output_dir="o", num_generations=4, use_cpu=True))
    assert given == {"output_dir": "o", "num_generations": 4, "logging_dir": "o/runs"}
    assert trl_overrides("train", given, 2) == {"train.out_dir": "o", "rl.samples_per_prompt": 4}


def test_a_trl_grpo_script_runs_with_one_import_changed_under_python_torchrun_and_in_a_notebook(folder):
    """The quickstart as a script: ``python grpo.py`` (the launcher starts 2 ranks that run the script again up to
    train(); the rest runs once), ``torchrun --nproc-per-node 2 grpo.py`` (every process a rank) and the code with
    no script file (a notebook: ranks forked from it) train alike; the script's reward function is in the
    completions table; save_model's folder loads."""
    import torch
    from transformers import AutoModelForCausalLM

    local = _run(folder, "grpo.py", "grpo_python")
    assert local.returncode == 0, failed(local.stderr, 3000)
    assert local.stdout.count("TRAINED 2") == 1  # the launcher's rest of the script, not the ranks'
    assert "rl.reward_fn=['<script>:trainer0/reward:reward_len']" in local.stdout
    torchrun = _run(folder, "-m", "torch.distributed.run", "--nproc-per-node", "2", "grpo.py", "grpo_torchrun")
    assert torchrun.returncode == 0, failed(torchrun.stderr, 3000)
    assert torchrun.stdout.count("TRAINED 2") == 2  # every process goes on with the script, as TRL's do
    # a notebook (here: the code on stdin, no script to run again): the ranks are forks of the process
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    notebook = subprocess.run([sys.executable, "-", "grpo_notebook"], input=GRPO_SCRIPT, cwd=folder,
                              capture_output=True, text=True, env=env, timeout=600)
    assert notebook.returncode == 0, failed(notebook.stderr, 3000)
    runs = ("grpo_python", "grpo_torchrun", "grpo_notebook")
    rows = {out: read_jsonl(folder / out / "metrics.jsonl") for out in runs}
    assert [r["train/step"] for r in rows["grpo_python"]] == [1, 2]
    for a, b, c in zip(*rows.values(), strict=True):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], rel=1e-6) == c["reward/mean"], (a, b, c)
        assert a["reward/reward_len"] == pytest.approx(a["reward/mean"], rel=1e-9)
    table = completions_table(folder, "grpo_python", 2)
    assert "reward/reward_len" in table.columns and len(table) == 2 * 8
    saved = AutoModelForCausalLM.from_pretrained(folder / "grpo_python_model")
    exported = AutoModelForCausalLM.from_pretrained(folder / "grpo_python" / "export")
    for (name, a), b in zip(saved.state_dict().items(), exported.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_an_sft_then_dpo_script_s_objects_reach_each_job(folder):
    """SFT with a model and tokenizer object (saved once by the launcher for the ranks) and a TrainerCallback
    (called on rank 0 with transformers' args/state/control, each step's logs), the training loss TrainOutput
    reports; then, in the same script, DPO from the SFT model on pairs made in memory (the second train(): its
    ranks run the script up to it, the first returning what its job wrote), evaluated on held-out pairs."""
    from transformers import AutoModelForCausalLM

    proc = _run(folder, "sft_dpo.py")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    calls = [line.split() for line in proc.stdout.splitlines() if line.startswith("CALLBACK")]
    rows = read_jsonl(folder / "sft_run" / "metrics.jsonl")
    assert [(int(c[1]), c[2], float(c[3])) for c in calls] == [
        (r["train/step"], "sft_run", pytest.approx(r["loss"], abs=1e-6)) for r in rows]
    assert len(calls) == 3  # once a step: rank 0 of the SFT job alone
    trained = [line.split() for line in proc.stdout.splitlines() if line.startswith("TRAINED")]
    assert len(trained) == 1 + 2  # the launcher; then the DPO job's ranks, passing the SFT job's train()
    assert int(trained[0][1]) == 3 and float(trained[0][2]) == pytest.approx(sum(r["loss"] for r in rows) / 3,
                                                                             rel=1e-5)
    assert (folder / "sft_run" / "given_model" / "config.json").exists()
    assert (folder / "sft_run" / "given_tokenizer" / "tokenizer_config.json").exists()
    assert type(AutoModelForCausalLM.from_pretrained(folder / "sft_model")).__name__ == "Qwen2ForCausalLM"
    assert "syncwise dpo: beside the defaults: dpo.batch_size=4" in proc.stdout
    assert "model.path=sft_model" in proc.stdout
    assert proc.stdout.count("EVALUATED ['eval/logps/chosen', 'eval/logps/rejected', 'eval/loss'") == 1
    assert read_jsonl(folder / "dpo_run" / "metrics.jsonl")[0]["train/step"] == 1


def test_a_script_s_mistake_is_one_line_before_any_rank_and_a_rank_s_error_a_job_failed(folder, monkeypatch):
    from syncwise import GRPOConfig, GRPOTrainer

    with pytest.raises(ConfigError, match=r"^num_train_epoch: no counterpart in syncwise's train job"):
        GRPOTrainer(model="qwen2", reward_funcs=len, args=GRPOConfig(num_train_epoch=1))

    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    monkeypatch.chdir(folder)
    trainer = GRPOTrainer(model="qwen2", reward_funcs=needs_answer, train_dataset=[{"prompt": "Count:"}] * 4,
                          args=GRPOConfig(output_dir="never_run", max_steps=1))
    with pytest.raises(ConfigError, match="rl.reward_fn: needs_answer reads the column.s. answer, which "):
        trainer.train()  # checked here, before any rank: nothing launched
    assert not (folder / "never_run" / "metrics.jsonl").exists()
    proc = _run(folder, "failing.py")
    assert proc.returncode == 1
    # the launcher's lines, then the script's traceback ending in train() with them as the JobFailed's message;
    # both ranks raise it, and whichever reports first is named
    assert re.search(r"syncwise\.jobs\.trainers\.JobFailed: syncwise: error: rl\.reward_fn: strict_reward raised "
                     r"KeyError: 'target_digit'\nsyncwise: raised on rank [01] of 2", proc.stderr), \
        failed(proc.stderr, 3000)
