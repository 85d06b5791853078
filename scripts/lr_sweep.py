"""Fill a page's learning-rate-sweep table (between its `<!-- lr-sweep:start -->` / `end` markers) from quality
runs that trained the same probe at different learning rates: each variant's recall at each rate, its best
rate, and the decoding state it holds (Zoology's practice: the same rates for every variant, the best reported).

    python scripts/lr_sweep.py docs/quality.md results/quality-load/pairs-32-lr1e-3 results/quality-load/pairs-32 results/quality-load/pairs-32-lr1e-2

The runs must differ in the learning rate only (every other field of the recipe, the options, device and
dtype the same), each at one length and seed: a ValueError names what differs, since rows that measure
different things must not share a table. A variant a run has not trained yet reads "—".
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.fmt import fmt_bytes
from harness.readers.quality.frames import final_frame, quality_rows, recipe
from harness.readers.tables import markdown_table, replace_block

MARKER = "lr-sweep"


def sweep(runs: list[Path]) -> tuple[list[float], dict[str, dict]]:
    """(the rates, ascending; per variant in first-seen order: {"state": bytes, rate: accuracy, ...})."""
    probes, cells, rates = {}, {}, {}  # probes: per variant (its options are its own), the first run's recipe
    for run in runs:
        df = final_frame([r for r in quality_rows(run) if r.get("task") == "recall"])
        if df.empty:
            raise ValueError(f"{run}: no finished recall training")
        if df["length"].nunique() > 1 or df["seed"].nunique() > 1:
            raise ValueError(f"{run}: trains several lengths or seeds; a sweep table holds one of each")
        for row in df.to_dict("records"):
            mine = {k: v for k, v in recipe(row).items() if k != "cfg_lr"} | {
                "length": row["length"],
                "seed": row["seed"],
            }
            first, theirs = probes.setdefault(row["variant"], (run, mine))
            diff = [k for k in mine if mine[k] != theirs[k]]
            if diff:
                raise ValueError(
                    f"{run} and {first} differ in {', '.join(diff)} for {row['variant']}, not only in the learning rate"
                )
            rate = float(row["cfg_lr"])
            if rates.setdefault(rate, run) != run:
                raise ValueError(f"{run} and {rates[rate]} both trained at lr {rate:g}")
            cells.setdefault(row["variant"], {"state": row.get("state_bytes")})[rate] = float(row["eval_accuracy"])
    return sorted(rates), cells


def table(rates: list[float], cells: dict[str, dict]) -> str:
    header = ["variant", "state", *(f"lr {r:g}" for r in rates), "best"]
    rows = []
    for variant, got in cells.items():
        best = max((r for r in rates if r in got), key=got.get)
        rows.append(
            [
                f"`{variant}`",
                fmt_bytes(got["state"]) if got["state"] else "—",
                *((f"**{got[r]:.1%}**" if r == best else f"{got[r]:.1%}") if r in got else "—" for r in rates),
                f"{got[best]:.1%} (lr {best:g})",
            ]
        )
    return markdown_table(header, rows)


def main(page: str, *runs: str) -> None:
    path = Path(page)
    text = path.read_text()
    if f"<!-- {MARKER}:start -->" not in text or f"<!-- {MARKER}:end -->" not in text:
        raise SystemExit(f"{page}: no <!-- {MARKER}:start --> ... <!-- {MARKER}:end --> block to fill")
    filled = table(*sweep([Path(r) for r in runs]))
    path.write_text(replace_block(text, MARKER, filled))
    print(filled)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], *sys.argv[2:])
