"""Text a policy wrote, made safe to show: its control characters escaped as Python writes them (``\\x1b``, ``\\r``,
``\\u202e``), so that a completion cannot act on the terminal that prints it -- retitle the window, clear the screen,
write the clipboard (OSC 52), or overwrite a line with ``fake: all good`` after a carriage return -- nor reorder
what is shown around it (the bidirectional overrides). Newlines and tabs are kept: they are how a completion reads."""

from __future__ import annotations

import re

# C0 but newline and tab, DEL, C1 (a lone 0x9b is a CSI on some terminals), and the bidirectional controls
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """``text`` with every control character but newline and tab written as its escape."""
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], text)
