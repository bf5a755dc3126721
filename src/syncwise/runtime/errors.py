"""The first error is the one the user sees: a clean-up that fails after an error is noted on it, never raised
over it (Python would chain the clean-up's error on top, and the one-line report would name the clean-up)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def clean_up_after(error: BaseException, what: str, clean_up: Callable[[], Any]) -> None:
    """Run ``clean_up`` after ``error`` was raised; if it fails too, its failure becomes a note on ``error``
    (``what`` names the clean-up) and the caller re-raises ``error`` as it was."""
    try:
        clean_up()
    except Exception as failure:  # noqa: BLE001 - whatever it was, the first error stays the one raised
        text = str(failure).strip().splitlines()
        note = f"{what} failed as well ({type(failure).__name__}: {text[0] if text else ''})"
        add_note(error, note)


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` on every Python syncwise supports (3.10 has no ``add_note``; its
    ``__notes__`` list is what 3.11's traceback prints)."""
    notes = getattr(error, "__notes__", None)
    if notes is None:
        notes = []
        try:
            error.__notes__ = notes
        except AttributeError:  # an exception type with __slots__: nothing to hang a note on
            return
    notes.append(note)


def notes_of(error: BaseException) -> list[str]:
    return [str(n) for n in getattr(error, "__notes__", None) or []]
