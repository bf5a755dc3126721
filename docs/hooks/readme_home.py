"""MkDocs hook: the site's home page is the README (one text, not two), its links to ``docs/`` pages made the
site's own."""

from __future__ import annotations

import re
from pathlib import Path

MARKER = "<!-- syncwise: readme -->"
README = Path(__file__).resolve().parents[2] / "README.md"


def home() -> str:
    text = re.sub(r"\]\(docs/([^)]*)\)", r"](\1)", README.read_text())
    return text.replace("`CONTRIBUTING.md`", "`CONTRIBUTING.md` (in the repository)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, home()) if MARKER in markdown else markdown
