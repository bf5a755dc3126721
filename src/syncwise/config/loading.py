"""Loading a config: YAML with ``key=value`` overrides, built section by section into the dataclasses (an
unknown key or a value of the wrong type is an error naming it), then validated."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from .building import build, deep_merge
from .checks import ConfigError
from .dpo import DPOConfig
from .jobs import SFTConfig
from .root import Config


def packaged_config(name: str) -> Path:
    """A config file shipped with syncwise (``grpo.yaml``: the default ``syncwise train`` job)."""
    return Path(__file__).parent.parent / "configs" / name


# Keys a packaged job config sets for its own preset (``grpo.yaml``'s LoRA targets include the LM head of its
# random-weight Llama): with a ``model.path`` the user's model is not that preset, and they keep their defaults.
PRESET_ONLY_KEYS = ("model.lora.target_modules",)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, packaged: bool = False) -> Config:
    """Build a validated :class:`Config` from an optional YAML file and ``section.key=value`` overrides.

    Values in overrides are parsed as YAML scalars (``lr=3e-4``, ``cpu_offload=true``, ``path=null``).
    ``packaged``: ``path`` is a config shipped with syncwise (:func:`packaged_config`), whose
    :data:`PRESET_ONLY_KEYS` do not apply to a ``model.path`` unless an override sets them.
    """
    data = read_yaml(path) if path is not None else {}
    data = deep_merge(data, overrides_dict(overrides or []))
    if packaged and (data.get("model") or {}).get("path"):
        overridden = {item.partition("=")[0].strip() for item in overrides or []}
        for key in set(PRESET_ONLY_KEYS) - overridden:
            *parents, leaf = key.split(".")
            node = data
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(leaf, None)
    return load_config_dict(data)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(loaded).__name__}")
    return loaded


def overrides_dict(overrides: list[str]) -> dict[str, Any]:
    """``section.key=value`` items as a nested dict, each value read as YAML."""
    data: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            node[leaf] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:  # e.g. rl.stop=[####]: '#' starts a YAML comment
            problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
            raise ConfigError(f"{key.strip()}: cannot read {raw!r} as a YAML value ({problem}); quote it, e.g. "
                              f"{key.strip()}=\"['...']\"") from exc
    return data


# The built-in task's tuned recipe per job: it applies to the built-in task alone (no YAML of the user's, no
# model.path, no rl.dataset) -- a job on the user's model or data starts from the defaults
RECIPES = {"train": "grpo.yaml"}
# Beside the defaults, for a job on the user's (pretrained) model: TRL's GRPO learning rate
PRETRAINED = {"train": {"optim": {"lr": 1.0e-6}}}


def load_job_config(job: str, path: str | Path | None, overrides: list[str],
                    runnable: bool = True) -> tuple[Config, list[str]]:
    """The config of ``syncwise <job>``, layered: the defaults, the built-in task's recipe (:data:`RECIPES`, only
    for the built-in task), the defaults for a pretrained model (:data:`PRETRAINED`, with ``model.path``), the
    YAML at ``path``, the command line -- and the lines that say which keys differ from the defaults and where
    each came from."""
    given = overrides_dict(overrides)
    user_yaml = read_yaml(path) if path is not None else {}
    mine = deep_merge(user_yaml, given)
    if job in OWN_SECTIONS:
        _refuse_train_keys(job, mine.get("train") or {})
    layers: list[tuple[str, dict[str, Any]]] = []
    if path is None and job in RECIPES and not (mine.get("model") or {}).get("path") \
            and not (mine.get("rl") or {}).get("dataset"):
        recipe = packaged_config(RECIPES[job])
        layers.append((f"the built-in task's recipe, {recipe.name}", read_yaml(recipe)))
    if job in PRETRAINED and (mine.get("model") or {}).get("path"):
        layers.append(("the defaults for a pretrained model", PRETRAINED[job]))
    if path is not None:
        layers.append((str(path), user_yaml))
    layers.append(("command line", given))
    merged: dict[str, Any] = {}
    for _, layer in layers:
        merged = deep_merge(merged, layer)
    config = load_config_dict(merged, runnable)
    return config, _differences(config, layers)


# The jobs whose run's keys (logger, bar, folder, steps) are in a section of their own, not ``train``
OWN_SECTIONS = {"sft": SFTConfig, "dpo": DPOConfig}


def _refuse_train_keys(job: str, train: dict[str, Any]) -> None:
    """``syncwise sft`` / ``dpo`` read their run's keys from their own section: a ``train.`` key that section also
    has (its logger, its bar, its folder) would be read by no one -- a ConfigError naming the key to use."""
    shadowed = [key for key in train if key in {f.name for f in dataclasses.fields(OWN_SECTIONS[job])}]
    if shadowed:
        raise ConfigError(f"train.{shadowed[0]}: syncwise {job} does not read the train section; set "
                          f"{job}.{shadowed[0]}")


def flat_keys(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as ``section.key -> value``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out |= flat_keys(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _differences(config: Config, layers: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Per source, the keys whose value is not the default's, as ``key=value``."""
    defaults = flat_keys(config_to_dict(load_config_dict({})))
    values = flat_keys(config_to_dict(config))
    set_by = [(name, set(flat_keys(layer))) for name, layer in reversed(layers)]  # the last layer wins
    by_source: dict[str, list[str]] = {}
    for key, value in values.items():
        if key in defaults and value == defaults[key]:
            continue
        source = next((name for name, keys in set_by if key in keys), "derived from these")
        by_source.setdefault(source, []).append(f"{key}={value}")
    return [f"{', '.join(keys)} ({source})" for source, keys in by_source.items()]


def load_config_dict(data: dict[str, Any], runnable: bool = True) -> Config:
    """A validated :class:`Config` from a nested dict (as :func:`config_to_dict` writes it); ``runnable``: see
    :meth:`Config.validate`."""
    return build(Config, data, prefix="").validate(runnable)


def config_to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for logging or writing back to YAML."""
    return yaml.safe_load(yaml.safe_dump(dataclasses.asdict(config), default_flow_style=False))
