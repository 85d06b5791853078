"""`bench advise`: which attention at N, from speed runs and quality runs."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from harness import options as opts
from harness.options import MAX_LENGTH, ArgumentError
from harness.readers.advise.answer import advise as answer
from harness.readers.advise.text import advise_table, answers_json, glance, recommendation
from harness.readers.tables import markdown_table

from .common import OneTask, Pass, checked, make_console, print_wrapped, within


class AdviceFormat(str, Enum):
    table = "table"
    markdown = "markdown"
    json = "json"


def _fraction(text: str | None) -> float | None:
    """'90%', '90' or '0.9' -> 0.9 (for --min-accuracy)."""
    if text is None:
        return None
    raw = text.strip()
    try:
        value = float(raw.removesuffix("%"))
    except ValueError:
        raise typer.BadParameter(
            f"--min-accuracy: {text!r} is not a number; give a percentage (90%) or a fraction (0.9)"
        ) from None
    value = value / 100 if raw.endswith("%") or value > 1 else value
    if not 0 <= value <= 1:
        raise typer.BadParameter(f"--min-accuracy: {text!r} is not allowed; it must lie between 0% and 100%")
    return value


RunDirsArgument = Annotated[
    list[Path], typer.Argument(help="Speed runs (bench run) and quality runs (bench quality): at least one speed run.")
]
LengthOption = Annotated[
    int, typer.Option("--len", callback=within(1, MAX_LENGTH), help="The sequence length N to choose for.")
]
DeviceOption = Annotated[
    Optional[str], typer.Option(help="Device of the speed rows to use (default: cpu if the runs hold it).")
]
PassOption = Annotated[Pass, typer.Option("--pass", help="fwd (inference) or fwdbwd (training).")]
CausalOption = Annotated[
    bool, typer.Option("--causal/--no-causal", help="Causal (decoder) or bidirectional attention rows.")
]
MemoryOption = Annotated[
    Optional[str],
    typer.Option(
        help="Memory budget of one attention call, e.g. 2GiB: variants whose peak memory at N (measured, or interpolated/extrapolated) exceeds it are left out."
    ),
]
TaskOption = Annotated[OneTask, typer.Option(help="The quality task whose accuracy counts.")]
MinAccuracyOption = Annotated[
    Optional[str],
    typer.Option(
        help="Rank only variants that keep this held-out accuracy, e.g. 90% (variants with no accuracy are not ranked either). Default: within 10 points of full's accuracy; 0 ranks every variant."
    ),
]
FormatOption = Annotated[
    AdviceFormat,
    typer.Option(
        "--format",
        help="table: for an 80-column terminal, notes numbered under it; markdown: the report's table; json: every figure, for scripts.",
    ),
]


def advise(
    run_dirs: RunDirsArgument,
    length: LengthOption,
    device: DeviceOption = None,
    pass_: PassOption = Pass.fwdbwd,
    causal: CausalOption = True,
    memory: MemoryOption = None,
    task: TaskOption = OneTask.recall,
    min_accuracy: MinAccuracyOption = None,
    format: FormatOption = AdviceFormat.table,
) -> None:
    """Which attention at N: time and memory (measured, or interpolated/extrapolated and marked), accuracy, and a ranked pick.

    Joins speed runs and quality runs: `bench advise --len 8192 --memory 1GiB --min-accuracy 90% results/cpu-reference results/quality-long`.
    Accuracy is taken at the trained length nearest to N and marked when that length is below N.
    """
    with checked():
        budget = opts.parse_size(memory, "--memory") if memory is not None else None
        if budget is not None and budget <= 0:
            raise ArgumentError(f"--memory: {memory!r} is no memory at all; give a budget above 0, e.g. 2GiB")
        answers, context = answer(
            run_dirs,
            n=length,
            device=device,
            pass_=pass_.value,
            causal=causal,
            memory=budget,
            task=task.value,
            min_accuracy=_fraction(min_accuracy),
        )
    if format is AdviceFormat.json:
        typer.echo(json.dumps(answers_json(answers, context), indent=1))
        return
    if format is AdviceFormat.markdown:
        frame = advise_table(answers)
        typer.echo(markdown_table(list(frame.columns), [list(row) for row in frame.itertuples(index=False)]))
        typer.echo("\n" + recommendation(answers, context) + (f" ({context['floor']})" if context["floor"] else ""))
        return
    console = make_console()
    title, frame, notes, shared = glance(answers, context)
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True
    )
    for column in frame.columns:
        table.add_column(
            column, justify="right" if column in ("rank", "time", "memory", "accuracy") else "left", no_wrap=True
        )
    for row in frame.itertuples(index=False):
        table.add_row(*(escape(str(cell)) for cell in row))
    console.print(table)
    lines = [(f"[{number}] ", note) for number, note in enumerate(notes, start=1)]
    lines += [("[*] ", "every variant with an accuracy: " + "; ".join(shared))] if shared else []
    lines += (
        [("~ ", "interpolated or extrapolated from the measured N (the notes say which)")]
        if any(t.endswith("~") for t in frame["time"])
        else []
    )
    for head, text in lines:
        print_wrapped(console, "  " + head, text)
    for text in (context["floor"], recommendation(answers, context)):
        if text:
            print_wrapped(console, "", text)
