"""What a run's rows say: scaling exponents, crossovers against `full`, the summary table.

Reads rows only (never measures). Used by `bench run` at the end and by the reports.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from harness.core.noise import BUSY_CORES, MAX_SPREAD
from harness.fmt import fmt_bytes, fmt_time

PANEL = ["device", "pass", "causal"]


def panel_rows(df: pd.DataFrame, panel: tuple, ok_only: bool = False) -> pd.DataFrame:
    """The rows of one (device, pass, causal) panel, optionally only those that ran."""
    device, pass_, causal = panel
    keep = (df["device"] == device) & (df["pass"] == pass_) & (df["causal"] == causal)
    if ok_only:
        keep &= df["status"] == "ok"
    return df[keep]


def fit_exponent(ns, values, upper_fraction: float = 0.5) -> float | None:
    """Least-squares slope of log(value) on log(N) over the upper lengths (at least 2 points)."""
    points = sorted((n, v) for n, v in zip(ns, values) if v is not None and v > 0 and not math.isnan(v))
    if len(points) < 2:
        return None
    keep = max(2, math.ceil(len(points) * upper_fraction))
    points = points[-keep:]
    x = np.log([p[0] for p in points])
    y = np.log([p[1] for p in points])
    if np.ptp(x) == 0:
        return None
    return float(np.polyfit(x, y, 1)[0])


def crossover(variant: pd.DataFrame, baseline: pd.DataFrame) -> tuple[int | None, str]:
    """Smallest N from which `variant` is faster than `baseline` at every larger common N.

    Returns (N, note): note is "" or "always faster" / "never faster" / "no common N".
    """
    a = variant.set_index("n")["time_median_s"]
    b = baseline.set_index("n")["time_median_s"]
    common = sorted(set(a.index) & set(b.index))
    if not common:
        return None, "no common N"
    faster = [a[n] < b[n] for n in common]
    if not faster[-1]:
        return None, "never faster"
    i = len(faster) - 1
    while i > 0 and faster[i - 1]:
        i -= 1
    return common[i], ("always faster" if i == 0 else "")


def summarize(rows: list[dict] | pd.DataFrame, baseline: str | None) -> pd.DataFrame:
    """One line per (device, pass, causal, variant): largest N that ran, its time and memory, exponents, crossover
    against `baseline` (the run's, `storage.baseline_of`; None: no crossover). `.attrs["baseline"]` names it."""
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame()
    lines = []
    for (device, pass_, causal, variant), group in df.groupby(PANEL + ["variant"], sort=False):
        ok = group[group["status"] == "ok"].sort_values("n")
        stop = group[group["status"] != "ok"].sort_values("n")
        line = {
            "device": device,
            "pass": pass_,
            "causal": bool(causal),
            "variant": variant,
            "max_n": None,
            "time_s": None,
            "peak_bytes": None,
            "time_exp": None,
            "mem_exp": None,
            "crossover_n": None,
            "crossover_note": "",
            "stopped": "",
            "noisy": noisy_count(ok),
        }
        if not ok.empty:
            last = ok.iloc[-1]
            line.update(
                max_n=int(last["n"]),
                time_s=float(last["time_median_s"]),
                peak_bytes=last["peak_bytes"],
                time_exp=fit_exponent(ok["n"], ok["time_median_s"]),
                mem_exp=fit_exponent(ok["n"], ok["peak_bytes"].astype(float)),
            )
            if variant != baseline:
                base = panel_rows(df, (device, pass_, causal), ok_only=True)
                base = base[base["variant"] == baseline]
                if not base.empty:
                    line["crossover_n"], line["crossover_note"] = crossover(ok, base)
        if not stop.empty:
            first = stop.iloc[0]
            reason = str(first.get("message") or "")
            line["stopped"] = f"{first['status']} at N={int(first['n'])}"
            if reason and not reason.startswith("series stopped"):
                line["stopped"] += f": {reason[:120]}"
        lines.append(line)
    out = pd.DataFrame(lines)
    out.attrs["baseline"] = baseline
    return out


def noisy_mask(rows: pd.DataFrame) -> pd.Series:
    """Which rows were flagged `noisy` (measured on a busy machine or with a wide spread); rows from
    before noise was recorded count as not noisy."""
    if "noisy" not in rows:
        return pd.Series(False, index=rows.index)
    return rows["noisy"].fillna(False).astype(bool)


def noisy_count(rows: pd.DataFrame) -> int:
    return int(noisy_mask(rows).sum())


NOISE_NOTE = (
    f"cells measured while other processes used > {BUSY_CORES:g} cores, or with IQR/median > {MAX_SPREAD:.0%}, "
    "are flagged `noisy` (reason in their `noise` field): the benchmark result may be unstable; "
    "re-measure them on a quiet machine"
)


def _fmt(value, fmt) -> str:
    return "—" if value is None or pd.isna(value) else fmt(value)


def crossover_text(line: dict) -> str:
    note, n = line.get("crossover_note") or "", line.get("crossover_n")
    if note in ("never faster", "no common N"):
        return note
    if n is None or pd.isna(n):
        return "—"
    return f"<= {int(n)}" if note == "always faster" else str(int(n))


def render_summary(summary: pd.DataFrame, console, title: str = "Summary") -> None:
    """Print the summary as rich tables, one per (device, pass, causal), narrow enough for an 80-column
    terminal: why a series stopped goes into numbered notes under its table, not into a column."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    if summary.empty:
        console.print("[yellow]no rows to summarize[/]")
        return
    base = summary.attrs.get("baseline") or "the baseline"
    for (device, pass_, causal), panel in summary.groupby(PANEL, sort=False):
        table = Table(
            title=f"{title}: {device}, {pass_}, {'causal' if causal else 'non-causal'}",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            padding=(0, 1),
            collapse_padding=True,
            caption_justify="left",
            caption=f"N^ t/m: fitted exponents of time and memory in N; beats {base}: faster from this N on",
        )
        for col in ("variant", "max N", "time", "memory", "N^ t/m", f"beats {base}", "stop"):
            table.add_column(col, justify="left" if col in ("variant", "stop") else "right", no_wrap=True)
        notes = []
        for line in panel.to_dict("records"):
            stop = ""
            if line["stopped"]:
                notes.append(line["stopped"])
                stop = f"[{len(notes)}]"
            exponents = f"{_fmt(line['time_exp'], lambda e: f'{e:.2f}')}/{_fmt(line['mem_exp'], lambda e: f'{e:.2f}')}"
            table.add_row(
                line["variant"],
                _fmt(line["max_n"], lambda n: str(int(n))),
                _fmt(line["time_s"], fmt_time),
                _fmt(line["peak_bytes"], fmt_bytes),
                exponents,
                "(baseline)" if line["variant"] == summary.attrs.get("baseline") else crossover_text(line),
                stop,
            )
        console.print(table)
        for number, note in enumerate(notes, start=1):
            console.print(f"  \\[{number}] {escape(note)}", overflow="fold")
    flagged = int(summary["noisy"].sum()) if "noisy" in summary else 0
    if flagged:
        console.print(f"[yellow]{flagged} noisy cells[/]: {NOISE_NOTE}")
