"""Markdown for the reports: tables, inline code and text from a run's files that survive any cell text,
and a page's marked blocks (`replace_block`)."""

from __future__ import annotations

import re
from pathlib import Path


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


def md_text(value) -> str:
    """Text taken from a run's files, made inert in Markdown: one line, markup characters escaped."""
    text = " ".join(str(value).split())
    return re.sub(r"([\\`*_{}\[\]<>()#+!|~-])", r"\\\1", text)


def figure_links(run_dir: Path, figures) -> list[str]:
    lines = []
    for fig in figures:
        fig = Path(fig).resolve()
        rel = fig.relative_to(run_dir.resolve()) if fig.is_relative_to(run_dir.resolve()) else fig
        lines += [f"![{fig.stem}]({rel.as_posix()})", ""]
    return lines
