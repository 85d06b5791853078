"""`bench plot`: a speed run's figures, drawn from its rows."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from harness.readers.speed.plots import plot_run

from .common import checked, existing_run, make_console


class Format(str, Enum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by bench run.")],
    format: Annotated[Format, typer.Option("--format", help="Image format.")] = Format.png,
    out: Annotated[Optional[Path], typer.Option(help="Where to write the figures (default RUN_DIR/figures).")] = None,
) -> None:
    """Draw the run's figures: time and memory vs N (log-log, fitted exponents), speed-up over full, fraction of the matmul peak.

    Reads the run directory only (works on partial runs); the same run gives byte-identical files.
    """
    with checked():
        paths = plot_run(existing_run(run_dir), out, format.value)
    for path in paths:
        make_console().print(f"wrote {path}")
