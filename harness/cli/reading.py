"""Reading runs, never measuring: `bench plot`, `report`, `compare`, and `viz` (a variant's weights drawn)."""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from harness import options as opts
from harness.fmt import fmt_time
from harness.readers.speed.compare import KEY as KEY_COLUMNS
from harness.readers.speed.compare import compare_runs, geomean
from harness.readers.report import make_report
from harness.readers.speed.plots import plot_run
from harness.readers.speed.summary import NOISE_NOTE
from harness.readers.advise.tradeoff import write_tradeoff_report

from .common import ImportOption, OptionOption, at_least, checked, existing_run, make_console, within


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


def report(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="A run directory written by bench run or bench quality; or speed runs and quality runs together for the trade-off report."
        ),
    ],
    out: Annotated[
        Optional[Path],
        typer.Option(help="With several runs: where the trade-off report goes (default results/tradeoff)."),
    ] = None,
    length: Annotated[
        Optional[int],
        typer.Option(
            "--len",
            callback=at_least(1),
            help="With several runs: the N of the trade-off (default: the tokens the model read at each task's largest L).",
        ),
    ] = None,
) -> None:
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


def _percent(text: str) -> float:
    raw = text.strip().removesuffix("%")
    try:
        value = float(raw) / 100
    except ValueError:
        raise typer.BadParameter(f"--fail-if-slower: {text!r} is not a percentage (e.g. 10%)") from None
    if not math.isfinite(value) or value <= 0:
        raise typer.BadParameter(f"--fail-if-slower: {text!r} must be a finite percentage above 0% (e.g. 10%)")
    return value


def compare(
    run_a: Annotated[Path, typer.Argument(help="The reference run (A).")],
    run_b: Annotated[Path, typer.Argument(help="The run to compare with it (B).")],
    fail_if_slower: Annotated[
        Optional[str],
        typer.Option(
            help="A percentage, e.g. 10%: exit 1 when a variant's geometric-mean time ratio B/A exceeds 1 + 10%, or a cell ok in A is not in B."
        ),
    ] = None,
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


def viz(
    variants_: Annotated[str, typer.Option("--variants", help="'all' or names, comma-separated.")] = "all",
    n: Annotated[
        int,
        typer.Option(
            "--n", callback=within(1, 2048), help="Sequence length of the picture (it holds an N x N matrix)."
        ),
    ] = 64,
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="Draw the causal pattern.")] = False,
    window: Annotated[int, typer.Option(help="Sliding window w for the picture (small, so the band shows).")] = 6,
    global_tokens: Annotated[int, typer.Option(help="Global tokens for the sliding-window variants.")] = 2,
    compression: Annotated[int, typer.Option(help="Memory-compressed stride c.")] = 4,
    option: OptionOption = None,
    out: Annotated[Path, typer.Option(help="Image to write (.png, .svg or .pdf).")] = Path("attention_patterns.png"),
    import_: ImportOption = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
) -> None:
    """Heat-maps, side by side, of the attention weights each variant applies to one random input.

    Softmax variants show their weights, linear its normalized kernel matrix, memory_compressed the
    weight each query gives each original position. The weights are read off the variant itself
    (called with v = identity), so the picture is also a visual check of causality and of the window.
    """
    import variants
    from harness import policy
    from harness.viz import attention_patterns, draw_patterns

    with checked():
        policy.import_modules(import_ or [])
        names = (
            tuple(variants.available()) if variants_.strip() == "all" else policy.resolve_variants(variants_, ("cpu",))
        )
        options = opts.merge_options(option or [], window=window, global_tokens=global_tokens, compression=compression)
    if out.suffix.lstrip(".") not in ("png", "svg", "pdf"):
        raise typer.BadParameter(f"--out: {out} must end in .png, .svg or .pdf")
    if out.exists() and not force:
        raise typer.BadParameter(f"--out: {out} already exists; pass --force to overwrite it")
    result = attention_patterns(list(names), n, causal, options)
    path = draw_patterns(result, out, n, causal)
    console = make_console()
    for name, reason in result["skipped"].items():
        console.print(f"skipped {name}: {reason}")
    console.print(f"wrote {path}")
