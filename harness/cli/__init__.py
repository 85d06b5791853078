"""The `bench` command line: presentation only. Each command parses its options, hands them to the wing
that does the work (a run's life: `harness.sweep.session`, `harness.quality.session`, `harness.lm.session`;
reading: `harness.readers`) and shows what comes back: progress bars, tables, paths, exit codes.

A module a command, named after it (list, run, plot, report, advise, compare, viz, memory, lm, quality), over
`common` (option checks, the options several commands share, the console, progress bars). The wings that load torch (the sessions, `policy`, `viz`, `variants`) are imported inside the
commands that use them, so that `bench report`, `compare`, `advise` and `--help` never load torch.

    bench list                                   # variants, their options, where they run
    bench run --variants all --max-len 16384     # the sweep: time, memory, FLOP/s per cell, then REPORT.md
    bench run --resume results/<run>             # finish an interrupted run
"""

from __future__ import annotations

import typer

from . import advise, compare, lm, memory, plot, quality, report, run, viz
from .list import list_variants

app = typer.Typer(
    help="attnbench: which attention should I use at my sequence length, on my hardware? Measure it.",
    no_args_is_help=True,
    add_completion=False,
    # click's plain help: at 80 columns rich's option table left the help text a 30-column strip
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
# the order of `bench --help`
app.command("list")(list_variants)
app.command()(run.run)
app.command()(plot.plot)
app.command()(report.report)
app.command()(advise.advise)
app.command()(compare.compare)
app.command()(viz.viz)
app.command()(memory.memory)
app.command()(lm.lm)
app.command()(quality.quality)


def main() -> None:  # pragma: no cover
    app()
