"""One table from sweep runs of bench quality: each method's best held-out accuracy at each model width, with
the rate that gave it and its decoding state, filled into a page between its `width` markers.

    python scripts/width_table.py docs/quality.md results/quality-zoology/menu results/quality-zoology/based \
        --figure results/quality-zoology/width.png

A method is a run's variant with the options that change its function (linear with feature_map=taylor is
Based); runs must share one task and length and one recipe but for the sweep (variants, d_model, lr, options),
and a width two runs both trained is read at the best rate of either. Reading only: no torch.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pandas as pd

from harness.fmt import fmt_bytes
from harness.quality.config import TrainConfig
from harness.readers.quality.frames import sweep_rows, width_frame
from harness.readers.quality.plots import width_figure
from harness.readers.tables import markdown_table, replace_block
from harness.store.storage import read_metadata, variant_facts

# what runs in one table may differ in: the sweep's axes and the variants' options (task and L: `table` checks)
SWEEP_KEYS = {"variants", "d_model", "d_models", "lr", "lrs", "options", "imports", "tasks", "lengths"}


def label(run_dir: Path, variant: str) -> str:
    """`variant`, with the options its run gave it that change its function (its spec's `function_options`, as
    the run recorded them): linear with feature_map=taylor is Based, not linear."""
    changing = variant_facts(run_dir).get(variant, {}).get("function_options") or []
    given = next((r.get("options") or {} for r in sweep_rows(run_dir) if r["variant"] == variant), {})
    named = {k: v for k, v in given.items() if k in changing}
    return f"`{variant}`" + (f" ({', '.join(f'{k}={v}' for k, v in named.items())})" if named else "")


def recipe(run: Path) -> dict:
    """A run's configuration outside the sweep, a field added after the run was made read as its default (a run
    from before `output_gate` existed trained without one)."""
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    config = {**defaults, **read_metadata(run).get("config", {})}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items() if k not in SWEEP_KEYS}


def same_recipe(runs: list[Path]) -> None:
    """Refuse runs whose recipes differ outside the sweep (a longer training is another measurement)."""
    first = recipe(runs[0])
    for run in runs[1:]:
        config = recipe(run)
        differ = sorted(k for k in first.keys() | config.keys() if config.get(k) != first.get(k))
        if differ:
            raise SystemExit(f"{run} differs from {runs[0]} in {', '.join(differ)}: one recipe a table")


def combined(runs: list[Path]) -> pd.DataFrame:
    """Every run's `width_frame`, each variant named by `label`; where two runs trained one method at one width,
    the better of the two (each the best of its rates), as Zoology takes the best of its rates."""
    frames = []
    for run in runs:
        frame = width_frame(sweep_rows(run))
        frame["variant"] = [label(run, v) for v in frame["variant"]]
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True).sort_values("accuracy", kind="stable", ascending=False)
    best = frame.drop_duplicates(["task", "length", "variant", "d_model"])
    return best.sort_index()  # the runs' order, for the table's rows


def table(runs: list[Path]) -> str:
    same_recipe(runs)
    cells, widths, points = {}, set(), set()
    frame = combined(runs)
    points |= set(zip(frame["task"], frame["length"]))
    for r in frame.to_dict("records"):
        cells[(r["variant"], r["d_model"])] = r
        widths.add(r["d_model"])
    if len(points) != 1:
        raise SystemExit(f"the runs hold {sorted(points)}: one (task, L) a table")
    widths = sorted(widths)
    names = list(dict.fromkeys(name for name, _ in cells))
    body = []
    for name in names:
        row = [name]
        for d in widths:
            r = cells.get((name, d))
            row.append(
                f"{r['accuracy']:.1%} (lr {r['lr']:g}; {fmt_bytes(r['state_bytes'])})" if r is not None else "not run"
            )
        body.append(row)
    ((task, length),) = points
    head = f"{task} at L = {length}: best held-out accuracy over the rates (that rate; decoding state), per d_model\n\n"
    return head + markdown_table(["method", *[f"d_model {d}" for d in widths]], body)


if __name__ == "__main__":
    args = sys.argv[1:]
    figure = Path(args.pop(args.index("--figure") + 1)) if "--figure" in args else None
    args = [a for a in args if a != "--figure"]
    if len(args) < 2:
        sys.exit(__doc__)
    page, runs = Path(args[0]), [Path(p) for p in args[1:]]
    page.write_text(replace_block(page.read_text(), "width", table(runs)))
    if figure:
        frame = combined(runs)
        frame["variant"] = frame["variant"].str.replace("`", "")
        print(width_figure(frame, {"variants": variant_facts(*runs)}, figure))
