"""The FSDP units of a model by name, and which of them ``sync.deferred_units`` picks for ``partial``."""

from __future__ import annotations

from torch import nn

from ..sync.modes import SyncChoice, SyncMode, spec
from .accounting import ShardedModel
from .costs import Links, deferral_order


def unit_names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    """Each unit's module path in ``model`` (the root is ``root``), in the units' order."""
    paths = {id(module): name for name, module in model.named_modules()}
    return [paths.get(id(unit)) or "root" for unit in units]


def resolve_deferred_units(
    value: int | str, names: list[str], estimator: ShardedModel, links: Links | None = None
) -> frozenset[int]:
    """``sync.deferred_units``: a count K (the K units that save the most time per byte held, see
    :func:`syncwise.memory.costs.deferral_order`) or comma-separated unit names. Errors name the key and, for an
    unknown name, the units there are."""
    text = str(value).strip()
    if text.isdigit():
        count = int(text)
        if not 1 <= count <= len(names):
            raise ValueError(
                f"sync.deferred_units: {count} is not between 1 and the model's {len(names)} FSDP units "
                f"({_listing(names)})"
            )
        return frozenset(deferral_order(estimator, links or Links())[:count])
    wanted = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in names]
    if unknown or not wanted:
        raise ValueError(
            f"sync.deferred_units: {', '.join(map(repr, unknown)) or repr(text)} is not a unit of the model; "
            f"its FSDP units are {_listing(names)}"
        )
    return frozenset(names.index(name) for name in wanted)


def _listing(names: list[str], shown: int = 6) -> str:
    return ", ".join(names) if len(names) <= shown else ", ".join(names[: shown - 1]) + f", ..., {names[-1]}"


def configured_choice(mode: SyncMode, names: list[str], deferred_units: int | str, model: ShardedModel) -> SyncChoice:
    """``sync.mode`` as configured; for ``partial``, with the units ``sync.deferred_units`` names or counts
    (the ones that save the most time per byte held). ``names``: the FSDP units' names, in order."""
    if not spec(mode).per_unit:
        return SyncChoice(mode)
    return SyncChoice(mode, resolve_deferred_units(deferred_units, names, model))
