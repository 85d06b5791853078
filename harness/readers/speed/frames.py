"""A sweep's rows as a pandas DataFrame: the run's own configuration's cells, typed, one device a row
of hardware. Imports no torch."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.store.rows import Row, cell_key, device_label, run_rows
from harness.store.storage import RESULTS, read_metadata, read_rows, warn
from harness.sweep.config import RunConfig


def load_frame(run_dir: Path):
    """The rows of the run's own configuration as a pandas DataFrame (one per cell, the latest where a
    cell repeats; every column of `rows.Row`, so rows from older versions get the new columns empty).
    Rows of another configuration are left out with a warning. Imports no torch."""
    meta = read_metadata(run_dir)
    rows = read_rows(run_dir)
    if meta["kind"] == "sweep":
        try:
            config = RunConfig.from_json(meta["config"])
        except TypeError:  # a partial config (older or hand-made run): match the fields it has
            config = None
        if config is not None and config.variants and config.lengths:
            rows = run_rows(run_dir, config, (meta.get("machine") or {}).get("device_names"))
        else:
            fields = {k: meta["config"][k] for k in ("batch", "heads", "head_dim", "dtype") if k in meta["config"]}
            rows = list({cell_key(r): r for r in rows if all(r.get(k) == v for k, v in fields.items())}.values())
    typed = []
    for row in rows:
        try:
            typed.append(Row.from_json(row).to_json())
        except (KeyError, TypeError, ValueError):
            warn(f"{Path(run_dir) / RESULTS}: a row without a valid cell key was skipped: {str(row)[:120]}")
    columns = [("pass" if name == "pass_" else name) for name in Row.__dataclass_fields__ if name != "extra"]
    if not typed:
        return pd.DataFrame(columns=columns)
    df = pd.DataFrame(typed)
    df["kv_heads"] = df["kv_heads"].fillna(df["heads"])  # (one K/V head a query head: every row from before --kv-heads)
    return by_hardware(df)


def by_hardware(df):
    """Where a run holds one device kind on several hardware (a cluster's A100 and H100 nodes), each is a
    device of its own: "cuda (NVIDIA H100 80GB HBM3)". Every table and figure then facets by it."""
    names = df.groupby("device")["device_name"].nunique()
    several = set(names[names > 1].index)
    if several:
        df = df.copy()
        rows = df["device"].isin(several)
        df.loc[rows, "device"] = [
            device_label(d, str(n)) for d, n in zip(df.loc[rows, "device"], df.loc[rows, "device_name"])
        ]
    return df
