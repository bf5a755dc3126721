"""Loading a config: YAML with ``key=value`` overrides, built section by section into the dataclasses (an
unknown key or a value of the wrong type is an error naming it), then validated."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from .building import build
from .checks import ConfigError
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
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    for item in overrides or []:
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


def load_config_dict(data: dict[str, Any]) -> Config:
    """A validated :class:`Config` from a nested dict (as :func:`config_to_dict` writes it)."""
    return build(Config, data, prefix="").validate()


def config_to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for logging or writing back to YAML."""
    return yaml.safe_load(yaml.safe_dump(dataclasses.asdict(config), default_flow_style=False))
