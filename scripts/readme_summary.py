"""Copy the tables of the committed reports into docs/speed.md (the sweep's summary, one line a variant, then
whole, and the long sweep's to N = 65536) and docs/quality.md (the quality runs'), between their markers.

    python scripts/readme_summary.py results/cpu-reference/REPORT.md results/quality-quick/REPORT.md \
        results/quality-long/REPORT.md results/cpu-long/REPORT.md
"""

import sys
from pathlib import Path

from harness.fmt import fmt_bytes, fmt_time
from harness.readers.speed.frames import load_frame
from harness.readers.speed.summary import summarize
from harness.readers.tables import replace_block
from harness.store.storage import baseline_of, variant_facts


def per_variant(run_dir: Path) -> str:
    """One line a variant of the sweep's summary: each pass's time at the largest N (bidirectional / causal),
    the forward's peak extra memory, and from which N its causal forward beats full's."""
    summary = summarize(load_frame(run_dir), baseline_of(variant_facts(run_dir)))
    largest = int(summary["max_n"].max())
    at = {(r["variant"], r["pass"], bool(r["causal"])): r for r in summary.to_dict("records")}

    def cell(variant, pass_, causal, value=lambda r: fmt_time(r["time_s"])):
        r = at.get((variant, pass_, causal))
        if r is None or r["max_n"] != r["max_n"] or r["max_n"] is None:
            return "—"
        return value(r) + ("" if int(r["max_n"]) == largest else f" @{int(r['max_n'])}")

    def peak(variant):
        causal = cell(variant, "fwd", True, lambda r: fmt_bytes(r["peak_bytes"]))
        bidir = cell(variant, "fwd", False, lambda r: fmt_bytes(r["peak_bytes"]))
        return causal if causal != "—" or bidir == "—" else bidir + " (bidir)"

    def beats(variant):
        if variant == "full":
            return "(baseline)"
        r = at.get((variant, "fwd", True))
        bidir = (
            r is None or r["max_n"] != r["max_n"] or r["max_n"] is None
        )  # (an encoder method: its bidirectional forward)
        r = at.get((variant, "fwd", False)) if bidir else r
        if r is None:
            return "—"
        note = r["crossover_note"] or (
            f"{int(r['crossover_n'])}" if r["crossover_n"] == r["crossover_n"] and r["crossover_n"] else "—"
        )
        return str(note) + (" (bidir)" if bidir else "")

    lines = [
        f"| variant | fwd at N={largest}: bidir / causal | fwd+bwd: bidir / causal | fwd peak (causal) | causal fwd beats full from N |",
        "|---|---|---|---|---|",
    ]
    for variant in dict.fromkeys(summary["variant"]):
        lines.append(
            f"| `{variant}` | {cell(variant, 'fwd', False)} / {cell(variant, 'fwd', True)} | "
            f"{cell(variant, 'fwdbwd', False)} / {cell(variant, 'fwdbwd', True)} | "
            f"{peak(variant)} | {beats(variant)} |"
        )
    return "\n".join(lines)


def summary_table(report: str, ran_only: bool = False) -> str:
    """The table of a sweep report's Summary section (without the report's sentence on exponents);
    ran_only: the table alone, without the lines of a mode or pass a variant does not run (nothing but —)."""
    table = report.split("## Summary", 1)[1].split("## Every cell", 1)[0].strip().split("\n", 2)[2]
    if not ran_only:
        return table
    table = table.split("\n## ", 1)[0].strip()  # the table alone, not the report's next sections
    return "\n".join(line for line in table.splitlines() if not line.endswith("| — | — | — | — | — | — |"))


def quality_part(report: str, end: str) -> str:
    """A quality report's tables from its first one to `end`: its recipe paragraph is the report's (linked)."""
    part = report.split("## Quality: copy and associative recall", 1)[1].split(end, 1)[0].strip()
    return part[part.index("\n|") + 1 :] if "\n|" in part else part


speed_report, quality_report, long_report, sweep_long_report = (Path(p).read_text() for p in sys.argv[1:5])
quality = quality_part(quality_report, "\n#").split("![", 1)[0].strip()
long_quality = quality_part(long_report, "### Cost of a training step")
speed = Path("docs/speed.md").read_text()
speed = replace_block(
    speed,
    "per-variant",
    (
        f'From [`{sys.argv[1]}`](../{sys.argv[1]}), one line a variant ("@N": the largest N it reached; "—": a mode '
        f'it does not run; "beats full from N": the smallest N from which it is faster at every larger N):\n\n'
        f"{per_variant(Path(sys.argv[1]).parent)}"
    ),
)
speed = replace_block(
    speed,
    "summary",
    (
        f"Summary from [`{sys.argv[1]}`](../{sys.argv[1]}) (exponents fitted on the upper half of the lengths; "
        f'"beats full from N": the smallest N from which the variant is faster at every larger N):\n\n{summary_table(speed_report)}'
    ),
)
speed = replace_block(
    speed,
    "long-summary",
    (
        f"Summary from [`{sys.argv[4]}`](../{sys.argv[4]}) (exponents fitted on the upper half of the lengths; "
        f'"beats full from N" within this run\'s lengths; the modes a variant does not run left out):\n\n'
        f"{summary_table(sweep_long_report, ran_only=True)}"
    ),
)
Path("docs/speed.md").write_text(speed)
page = Path("docs/quality.md").read_text()  # one folder down: its links go up first
page = replace_block(
    page, "quality", f"From [`{sys.argv[2]}`](../{sys.argv[2]}), its recipe in full there:\n\n{quality}"
)
page = replace_block(
    page, "quality-long", f"From [`{sys.argv[3]}`](../{sys.argv[3]}), its recipe in full there:\n\n{long_quality}"
)
Path("docs/quality.md").write_text(page)
