"""The checks every config section validates with: each error names the offending key (dotted, e.g.
``engine.strategy``) and, where there is a fixed set, the allowed values."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or an invalid value. The message names the key."""


def choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")


def positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be > 0, got {value}")


def non_negative(key: str, value: float, zero: str = "") -> None:
    """``zero``: what 0 means, for the message."""
    if value < 0:
        raise ConfigError(f"{key}: must be >= 0{f' ({zero})' if zero else ''}, got {value}")
