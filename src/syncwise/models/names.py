"""A wrapped model's parameter and module names as the unwrapped model's."""

from __future__ import annotations

import re

# Wrappers that put a component into the names (activation checkpointing, FSDP1) -- and that torch's
# state-dict utilities drop again.
_WRAPPER_PART = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_fsdp_wrapped_module)(?=\.|$)")


def unwrapped_name(name: str, ddp: bool = False) -> str:
    """``name`` without the wrappers' components (and DDP's leading ``module.`` with ``ddp``)."""
    name = _WRAPPER_PART.sub("", name).lstrip(".")
    return name.removeprefix("module.") if ddp else name
