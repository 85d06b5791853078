"""`bench compare`: two speed runs matched cell by cell, their time and memory ratios."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from harness.fmt import fmt_time
from harness.readers.speed.compare import KEY as KEY_COLUMNS
from harness.readers.speed.compare import compare_runs, geomean
from harness.readers.speed.summary import NOISE_NOTE

from .common import existing_run, make_console


def _percent(text: str) -> float:
    raw = text.strip().removesuffix("%")
    try:
        value = float(raw) / 100
    except ValueError:
        raise typer.BadParameter(f"--fail-if-slower: {text!r} is not a percentage (e.g. 10%)") from None
    if not math.isfinite(value) or value <= 0:
        raise typer.BadParameter(f"--fail-if-slower: {text!r} must be a finite percentage above 0% (e.g. 10%)")
    return value


RunBArgument = Annotated[Path, typer.Argument(help="The run to compare with it (B).")]
FailIfSlowerOption = Annotated[
    Optional[str],
    typer.Option(
        help="A percentage, e.g. 10%: exit 1 when a variant's geometric-mean time ratio B/A exceeds 1 + 10%, or a cell ok in A is not in B."
    ),
]


def compare(
    run_a: Annotated[Path, typer.Argument(help="The reference run (A).")],
    run_b: RunBArgument,
    fail_if_slower: FailIfSlowerOption = None,
) -> None:
    """Match the cells of two runs and print time and memory ratios B/A, with a geometric mean per variant.

    For catching regressions between commits or machines: `bench compare results/old results/new --fail-if-slower 10%`.
    """
    threshold = _percent(fail_if_slower) if fail_if_slower is not None else None
    cells, per_variant, broken = compare_runs(existing_run(run_a), existing_run(run_b))
    console = make_console()
    if not broken.empty:  # a cell that ran in A and not in B is a regression, whatever its speed
        console.print(f"[red]{len(broken)} cells ok in A are not ok in B[/]:")
        for r in broken.sort_values(KEY_COLUMNS).to_dict("records"):
            console.print(
                f"  {r['device']} {r['variant']} {r['pass']}{' causal' if r['causal'] else ''} N={r['n']}: "
                f"{r['status']} — {str(r['message'])[:200]}"
            )
    if cells.empty:
        console.print("[yellow]no matching ok cells[/] (same device, variant, pass, causal, N, B, H, D and dtype)")
        raise typer.Exit(1 if threshold is not None else 0)
    noisy = int((cells["noisy_a"] | cells["noisy_b"]).sum())
    table = Table(title=f"B/A per cell  (A = {run_a}, B = {run_b})", title_justify="left")
    for col in ("device", "variant", "pass", "causal", "N", "time A", "time B", "time B/A", "mem B/A"):
        table.add_column(col, justify="right" if col not in ("device", "variant", "pass") else "left")
    for r in cells.sort_values(["device", "variant", "pass", "causal", "n"]).to_dict("records"):
        table.add_row(
            r["device"],
            r["variant"],
            r["pass"],
            "yes" if r["causal"] else "no",
            str(r["n"]),
            fmt_time(r["time_median_s_a"]),
            fmt_time(r["time_median_s_b"]),
            f"{r['time_ratio']:.3f}" + (" ~" if r["noisy_a"] or r["noisy_b"] else ""),
            "—" if r["mem_ratio"] != r["mem_ratio"] else f"{r['mem_ratio']:.3f}",
        )
    console.print(table)
    if noisy:
        console.print(f"[yellow]~ {noisy} cells were noisy in A or B[/]: {NOISE_NOTE}")
    summary = Table(title="geometric mean per variant", title_justify="left")
    for col in ("device", "variant", "pass", "causal", "cells", "time B/A", "mem B/A", "verdict"):
        summary.add_column(col)
    failed = []
    for r in per_variant.to_dict("records"):
        slower = threshold is not None and r["time_geomean"] > 1 + threshold
        if slower:
            failed.append(f"{r['variant']} ({r['device']}, {r['pass']}{', causal' if r['causal'] else ''})")
        verdict = "[red]slower[/]" if slower else ("ok" if threshold is not None else "")
        summary.add_row(
            r["device"],
            r["variant"],
            r["pass"],
            "yes" if r["causal"] else "no",
            str(r["cells"]),
            f"{r['time_geomean']:.3f}",
            "—" if r["mem_geomean"] != r["mem_geomean"] else f"{r['mem_geomean']:.3f}",
            verdict,
        )
    console.print(summary)
    ratios = cells["time_ratio"]
    console.print(
        f"all {len(cells)} matched ok cells: time B/A geometric mean {geomean(ratios):.3f} "
        f"(cells {ratios.min():.3f} to {ratios.max():.3f})"
    )
    if failed:
        console.print(f"[red]slower by more than {threshold:.0%}[/]: {', '.join(failed)}")
    if threshold is not None and (failed or not broken.empty):
        raise typer.Exit(1)
