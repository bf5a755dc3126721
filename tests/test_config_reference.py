"""Every key from one source (issue 69, 4): each config field carries its doc in the config dataclasses (the
comments beside and above it); `syncwise config [train|sft]` prints the resolved config as YAML with each key's doc
and default; `--help` names the sections and points there."""

from __future__ import annotations

import subprocess
import sys

import yaml

from syncwise.config import config_to_dict, load_job_config
from syncwise.config.reference import keys


def test_every_key_has_a_doc():
    undocumented = [key for key, _, doc in keys() if not doc]
    assert not undocumented, f"config keys without a doc (a comment beside or above the field): {undocumented}"
    assert len(keys()) > 130  # every section walked into


def _syncwise(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "syncwise", *args], capture_output=True, text=True, timeout=120)


def test_syncwise_config_prints_the_resolved_config_with_docs_and_defaults():
    proc = _syncwise("config", "train", "model.path=/models/mine", "rl.dataset=p.jsonl", "rl.reward_fn=m:f")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    config, _ = load_job_config("train", None, ["model.path=/models/mine", "rl.dataset=p.jsonl", "rl.reward_fn=m:f"])
    want = config_to_dict(config)
    assert printed == {k: v for k, v in want.items() if k not in ("sft", "dpo")}  # the YAML is the job's config
    assert ("  # the peak learning rate (syncwise train on a model.path: 1e-6 unless set) (default: 0.001)\n"
            "  lr: 1.0e-06") in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == (
        "# beside the defaults: model.path=/models/mine, rl.dataset=p.jsonl, rl.reward_fn=m:f (command line); "
        "optim.lr=1e-06 (the defaults for a pretrained model)")
    sft = _syncwise("config", "sft", "sft.steps=3")
    assert sft.returncode == 0 and "sft" in yaml.safe_load(sft.stdout) and "rl" not in yaml.safe_load(sft.stdout)
    bad = _syncwise("config", "train", "optim.learning_rate=1e-6")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "syncwise: config error: unknown key 'optim.learning_rate': TRL's learning_rate is optim.lr here")


def test_help_names_the_sections_and_points_to_syncwise_config():
    for args in (["--help"], ["train", "--help"], ["sft", "--help"], ["dpo", "--help"]):
        proc = _syncwise(*args)
        text = " ".join(proc.stdout.split())
        assert proc.returncode == 0
        assert "in the sections model, engine, sync, optim, dist, sft, dpo, rl, critic, train" in text
        assert "`syncwise config [train|sft|dpo]` prints every key with its doc and default" in text


def test_syncwise_config_prints_a_job_that_still_lacks_its_reward_and_says_so():
    """Issue 80 (4): `syncwise config train model.path=... rl.dataset=...`, as the README prints it, was refused (no
    reward yet). It prints the config, and its last line says what `syncwise train` still needs."""
    proc = _syncwise("config", "train", "model.path=/models/mine", "rl.dataset=p.jsonl")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["rl"]["dataset"] == "p.jsonl"
    assert proc.stdout.strip().splitlines()[-1] == ("# before syncwise train can run it: rl.dataset needs rl.reward_fn "
                                                    "(package.module:function): a prompt file brings no reward")
