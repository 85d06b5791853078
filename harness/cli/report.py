"""`bench report`: a run's REPORT.md and figures, or the trade-off report of several runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from harness.readers.report import make_report
from harness.readers.advise.tradeoff import write_tradeoff_report

from .common import at_least, checked, existing_run, make_console


RunDirsOption = Annotated[
    list[Path],
    typer.Argument(
        help="A run directory written by bench run or bench quality; or speed runs and quality runs together for the trade-off report."
    ),
]
OutOption = Annotated[
    Optional[Path], typer.Option(help="With several runs: where the trade-off report goes (default results/tradeoff).")
]
LengthOption = Annotated[
    Optional[int],
    typer.Option(
        "--len",
        callback=at_least(1),
        help="With several runs: the N of the trade-off (default: the tokens the model read at each task's largest L).",
    ),
]


def report(run_dirs: RunDirsOption, out: OutOption = None, length: LengthOption = None) -> None:
    """Write RUN_DIR/REPORT.md and its figures: command and environment, per-panel tables, exponents, crossovers, cells that did not run.

    bench run and bench quality write it at their end; run this to redraw it (partial runs too). Given a
    speed run and a quality run (`bench report results/cpu-reference results/quality-long`), write the
    trade-off report instead: accuracy against time per call at the same N. Reads the run directories only.
    """
    if len(run_dirs) == 1:
        if out is not None or length is not None:
            raise typer.BadParameter(
                "--out and --len are for the trade-off report of several runs; one run's report goes in RUN_DIR"
            )
        with checked():
            path, figures = make_report(existing_run(run_dirs[0]))
        make_console().print(f"wrote {path} and {len(figures)} figures in {run_dirs[0] / 'figures'}")
        return
    for run_dir in run_dirs:
        existing_run(run_dir)
    with checked():
        path, figures = write_tradeoff_report(run_dirs, out or Path("results") / "tradeoff", n=length)
    make_console().print(f"wrote {path} and {len(figures)} figures in {path.parent / 'figures'}")
