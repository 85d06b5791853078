"""`bench compare`: two runs matched cell by cell, their time and memory ratios."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.readers.speed.frames import load_frame
from harness.readers.speed.summary import noisy_mask

KEY = ["device", "variant", "pass", "causal", "n", "batch", "heads", "head_dim", "dtype"]


def compare_runs(run_a: Path, run_b: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(cells: ratios B/A per matched ok cell, per_variant: geometric means per variant,
    regressions: cells ok in A that are not ok in B, with B's status and message)."""
    a, b = load_frame(run_a), load_frame(run_b)
    for df in (a, b):
        df["causal"] = df["causal"].astype(bool)
        df["noisy"] = noisy_mask(df)
    broken = a[a["status"] == "ok"][KEY].merge(b[b["status"] != "ok"][KEY + ["status", "message"]], on=KEY)
    a, b = a[a["status"] == "ok"], b[b["status"] == "ok"]
    cols = KEY + ["time_median_s", "peak_bytes", "noisy"]
    merged = a[cols].merge(b[cols], on=KEY, suffixes=("_a", "_b"))
    merged["time_ratio"] = merged["time_median_s_b"] / merged["time_median_s_a"]
    merged["mem_ratio"] = merged["peak_bytes_b"].astype(float) / merged["peak_bytes_a"].astype(float).where(
        merged["peak_bytes_a"] > 0
    )
    per_variant = (
        merged.groupby(["device", "variant", "pass", "causal"], sort=False)
        .agg(cells=("n", "size"), time_geomean=("time_ratio", geomean), mem_geomean=("mem_ratio", geomean))
        .reset_index()
    )
    return merged, per_variant, broken


def geomean(values) -> float:
    """Geometric mean of the positive, finite values; NaN when there is none."""
    logs = [math.log(v) for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(logs) / len(logs)) if logs else float("nan")
