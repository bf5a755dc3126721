"""Building the config's dataclasses from nested dicts: each key checked against its section's fields (an unknown
key named, with the closest known one), each value against its type."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from .checks import ConfigError
from .peers import peer_hint

# Keys that moved into a section: named in the error instead of a guess.
MOVED = {f"rl.{old}": f"rl.loss.{new}" for old, new in (
    ("clip_low", "clip_low"), ("clip_high", "clip_high"), ("loss_agg", "agg"), ("entropy_coef", "entropy_coef"),
    ("kl_coef", "kl_coef"), ("kl_estimator", "kl_estimator"),
)} | {"rl.sampler": "rl.rollout_engine"}


def build(cls: type, data: Any, prefix: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(data, dict):
        section = prefix.rstrip(".") or "config"
        raise ConfigError(
            f"{section}: is a section, got the value {data!r}; set its keys ({', '.join(names)}), "
            f"e.g. {section}.{names[0]}=..."
        )
    hints = typing.get_type_hints(cls)
    kwargs, unknown = {}, []  # every unknown key of every section, in one error: not one a run
    for key, value in data.items():
        if key not in names:
            unknown.append(_unknown(names, prefix, key, value))
        elif dataclasses.is_dataclass(hints[key]):
            try:
                kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
            except UnknownKeys as exc:
                unknown.append(str(exc))
        else:
            kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    if unknown:
        raise UnknownKeys("; ".join(unknown))
    return cls(**kwargs)


class UnknownKeys(ConfigError):
    """One or more keys no section has: each named, with its nearest known key or its TRL / verl equivalent."""


def _unknown(names: list[str], prefix: str, key: str, value: Any) -> str:
    if f"{prefix}{key}" in MOVED:
        return f"'{prefix}{key}' is now '{MOVED[prefix + key]}'"
    peer = peer_hint(f"{prefix}{key}", value)
    if peer:
        return f"unknown key '{peer[0]}': {peer[1]}"
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
    return f"unknown key '{prefix}{key}'{hint}; known keys: {', '.join(names)}"


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return build(tp, value, prefix=f"{key}.")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for candidate in inner[:-1]:  # the first type the value fits
            try:
                return _coerce(candidate, value, key)
            except ConfigError:
                pass
        return _coerce(inner[-1], value, key)
    if origin is dict:  # a section of overrides, checked where it is used (Config.critic_config)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: is a section, got the value {value!r}; set its keys, e.g. {key}.lr=...")
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # YAML 1.1 reads true/false, on/off, yes/no as booleans
            return "true" if value else "false"
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {tp}")  # pragma: no cover - a bug in this module


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` written over it, section by section (``lora: {rank: 4}`` keeps lora's other
    keys)."""
    merged = dict(base)
    for key, value in overrides.items():
        inner = merged.get(key)
        merged[key] = deep_merge(inner, value) if isinstance(inner, dict) and isinstance(value, dict) else value
    return merged
