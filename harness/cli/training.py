"""What `bench quality` shows: a progress bar while it trains (a training stopped early fills its share; one that
diverged ends the command, exit 1), and the held-out accuracy table after."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from harness.readers.quality.positions import positions_summary
from harness.readers.quality.report import accuracy_text, final_accuracy_grid

from .common import progress_bar


def quality_with_progress(session, console: Console) -> list[dict]:
    steps = session.config.train.steps
    progress = progress_bar(console)
    done = {"step": 0}
    bar = {}

    def before(total, completed):
        bar["task"] = progress.add_task("starting", total=total, completed=completed)

    def on_start(task_name, length, name, seed, phase):
        done["step"] = 0
        if phase == "cost":
            progress.update(
                bar["task"], description=f"[cyan]{task_name} L={length} {name}[/] measuring a training step"
            )
        else:
            progress.update(bar["task"], description=f"[cyan]{task_name} L={length} {name} seed {seed}[/] training")

    def on_eval(row):
        stage = row.get("stage", 0)  # a final row completes its stage's share, also where it stopped early
        here = (stage + 1) * steps if row.get("final") else stage * steps + row["step"]
        progress.advance(bar["task"], here - done["step"])
        done["step"] = here
        progress.update(
            bar["task"],
            description=f"[cyan]{row['task']} L={row['length']} {row['variant']} seed {row.get('seed', 0)}[/] "
            f"loss {row['train_loss']:.3f} acc {row['eval_accuracy']:.1%}",
        )

    from harness.quality.train import TrainingDiverged

    try:
        with progress:
            return session.run(on_eval=on_eval, on_start=on_start, before=before)
    except TrainingDiverged as err:
        console.print(f"[red]training diverged[/]: {err}")
        raise typer.Exit(1) from None


def print_accuracy(rows: list[dict], config, console: Console) -> None:
    if config.positions:  # an axis of encodings: accuracy at each evaluated length, per (variant, encoding)
        summary = positions_summary(rows)
        table = Table(title="held-out token accuracy % at L and beyond (mean over seeds)", title_justify="left")
        for name in ("task", "variant", "encoding", *(f"{f}x" for f in sorted(summary["factor"].unique()))):
            table.add_column(name, justify="left" if name in ("task", "variant", "encoding") else "right")
        for (task, variant, encoding), part in summary.groupby(["task", "variant", "positions"], sort=False):
            table.add_row(task, variant, encoding, *(f"{100 * a:.1f}" for a in part.sort_values("factor")["accuracy"]))
        console.print(table)
        return
    columns, grid = final_accuracy_grid(rows)
    seeds = f" (mean of {config.seeds} seeds, min-max)" if config.seeds > 1 else ""
    table = Table(title=f"held-out token accuracy after training{seeds}", title_justify="left")
    table.add_column("variant")
    for t, n in columns:
        table.add_column(f"{t} L={n}", justify="right")
    for name, cells in grid:
        table.add_row(
            name, *["" if c is None else accuracy_text(c, t, config.seeds) for c, (t, _) in zip(cells, columns)]
        )
    console.print(table)
