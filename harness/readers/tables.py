"""Markdown for the reports: tables and inline code that survive any cell text."""

from __future__ import annotations

import re


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def code_span(value) -> str:
    """`value` as an inline code span on one line, fenced by more backticks than it contains."""
    text = " ".join(str(value).split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}"


def replace_block(page: str, marker: str, body: str) -> str:
    """`page` with the text between its `<!-- marker:start -->` and `<!-- marker:end -->` lines replaced by `body`
    (the scripts that fill README and docs tables from committed runs); unchanged where the markers are missing."""
    block = f"<!-- {marker}:start -->\n{body.strip()}\n<!-- {marker}:end -->"
    return re.sub(rf"<!-- {marker}:start -->.*<!-- {marker}:end -->", lambda m: block, page, flags=re.S)
