"""MkDocs hook: the configuration reference page's tables, generated at build time from the config dataclasses'
field comments (``syncwise.config.reference``, the source ``syncwise config`` prints) -- one source for every
key's doc, so the site cannot drift from the program."""

from __future__ import annotations

MARKER = "<!-- syncwise: config reference -->"


def reference_tables() -> str:
    from syncwise.config.reference import keys, sections

    out = []
    rows = keys()
    for section in sections():
        out += [f"### `{section}`", "", "| key | default | what |", "|---|---|---|"]
        for key, default, doc in rows:
            if key.split(".")[0] == section:
                shown = "none" if default is None else repr(default) if isinstance(default, str) else default
                out.append(f"| `{key}` | `{shown}` | {doc.replace('|', '&#124;')} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, reference_tables()) if MARKER in markdown else markdown
