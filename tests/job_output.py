"""A failed job's stderr as an assertion message.

A rank that a fault ends (glibc aborting on a corrupt heap, a segfault) prints Python's fault dump: every thread's
stack, dozens of lines. The line that says what happened -- glibc's own (``double free or corruption``) and the
dump's header -- sits above them, so a tail of the output alone cuts it off (CI 19, 24 and the last one showed only
the stacks). Here those lines come first, then the tail.
"""

from __future__ import annotations

import re

FAULT_HEADER = re.compile(r"^(Fatal Python error|Current thread )")


def failed(stderr: str, tail: int = 3000) -> str:
    """``stderr``'s fault lines (each fault dump's header, the 3 lines before it, its current thread's first frames)
    and its last ``tail`` characters."""
    lines = stderr.replace("\r", "\n").splitlines()
    picked: list[str] = []
    for i, line in enumerate(lines):
        if FAULT_HEADER.match(line):
            before = 3 if line.startswith("Fatal") else 0
            picked += lines[max(0, i - before): i + 6] + ["..."]
    head = "\n".join(["fault lines:", *picked, "tail:", ""]) if picked else ""
    return head + stderr[-tail:]
