"""MkDocs hook: the Configuration page's table of every setting, written at build time from the settings models
(``modeld.settings_cli.reference``), so the page cannot drift from the flags."""

from __future__ import annotations

from typing import Any

MARKER = "<!-- settings-reference -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table() -> str:
    from modeld.settings_cli import reference

    lines: list[str] = []
    section = None
    for r in reference():
        if r.section != section:
            section = r.section
            lines += ["", f"### {section[0].upper()}{section[1:]}", "",
                      "| flag | variable | default | what it does |", "|---|---|---|---|"]
        where = "" if r.commands == ("serve",) else " (also `modeld http`)"
        default = f"`{_cell(r.default)}`" if r.default else ""
        lines.append(f"| `{_cell(r.flag)}` | `{r.variable}` | {default} | {_cell(r.description)}{where} |")
    return "\n".join(lines).strip() + "\n"


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARKER, table()) if MARKER in markdown else markdown
