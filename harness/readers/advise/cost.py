"""`bench advise`'s cost side: the speed runs' rows of one setup, and each variant's time and memory at N
(measured, or on the log-log line of the nearest measured lengths)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.options import ArgumentError
from harness.readers.speed.frames import load_frame
from harness.readers.quality.frames import quality_rows
from harness.readers.speed.summary import fit_exponent
from harness.store.storage import RESULTS


@dataclass
class Answer:
    variant: str
    label: str = ""  # the variant, with the options that tell it apart where the runs timed several option sets
    time_s: float | None = None
    peak_bytes: float | None = None
    how: str = ""  # "measured", "interpolated ...", "extrapolated ...", or why there is no figure
    failed: str = ""  # "oom at N=..." when the variant stopped at or below N
    accuracy: float | None = None
    accuracy_range: tuple[float, float] | None = None
    quality_length: int | None = None
    quality_note: list[str] = field(default_factory=list)
    fits: bool = True
    rank: int | None = None
    excluded: str = ""


def split_runs(run_dirs: list[Path]) -> tuple[list[Path], list[Path]]:
    """(speed runs, quality runs) among the directories; a directory must be one or the other."""
    speed, quality = [], []
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise ArgumentError(f"RUN_DIR {str(run_dir)!r} is not a directory")
        has_speed, has_quality = (run_dir / RESULTS).exists(), bool(quality_rows(run_dir))
        if not has_speed and not has_quality:
            raise ArgumentError(f"RUN_DIR {str(run_dir)!r} holds no rows of bench run or bench quality")
        (speed if has_speed else quality).append(run_dir)
    if not speed:
        raise ArgumentError(
            "bench advise needs at least one speed run (written by bench run) beside the quality runs; "
            f"got only quality runs: {', '.join(map(str, quality))}"
        )
    return speed, quality


SETUP = (
    "device_name",
    "batch",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "threads",
)  # what a speed row measured besides its cell


def speed_rows(speed_dirs: list[Path], device: str | None, pass_: str, causal: bool) -> tuple[str, pd.DataFrame]:
    """(device, the speed runs' rows of that device, pass and causality); device None: cpu if the runs
    hold it. ArgumentError naming what the runs hold when they have no such rows, and naming the difference
    when the runs measured different setups (machine, B, H, D, dtype, threads): rows of different setups are
    never pooled. A variant timed with different options in different runs is one `setting` per option set
    (labelled with the options that differ); a cell measured by several runs of one setup is their median."""
    frames = []
    for d in speed_dirs:
        frame = load_frame(d)
        frame["run"] = str(d)
        frames.append(frame)
    df = pd.concat(frames, ignore_index=True)
    df["causal"] = df["causal"].astype(bool)
    devices = sorted(df["device"].unique())
    device = device or ("cpu" if "cpu" in devices else devices[0])
    if device not in devices:
        raise ArgumentError(f"--device {device}: the speed runs hold {', '.join(devices)} only")
    sel = df[(df["device"] == device) & (df["pass"] == pass_) & (df["causal"] == causal)]
    if sel.empty:
        mine = df[df["device"] == device]
        have = ", ".join(
            f"{p} {_causal_word(c)}" for p, c in sorted({(p, bool(c)) for p, c in zip(mine["pass"], mine["causal"])})
        )
        raise ArgumentError(
            f"the speed runs have no {pass_} {_causal_word(causal)} rows on {device}; they hold {have} "
            "(--pass, --causal/--no-causal)"
        )
    _check_one_setup(sel)
    return device, _settings(sel)


def _known(value) -> bool:
    return value is not None and value == value  # (NaN: not recorded by an older run)


def _check_one_setup(sel: pd.DataFrame) -> None:
    """ArgumentError naming each setup field whose recorded values differ between the runs (a field a run
    did not record is not compared)."""
    diffs = []
    for name in SETUP:
        if name not in sel:
            continue
        per_run = {
            run: sorted({str(v) for v in group[name] if _known(v)}) for run, group in sel.groupby("run", sort=False)
        }
        values = {v for vs in per_run.values() for v in vs}
        if len(values) > 1:
            diffs.append(f"{name} " + ", ".join(f"{'/'.join(vs)} in {run}" for run, vs in per_run.items() if vs))
    if diffs:
        raise ArgumentError(
            "the speed runs measured different setups, whose rows cannot be pooled: "
            + "; ".join(diffs)
            + " (give speed runs of one machine and shape)"
        )


def _options_key(options) -> str:
    """The options a row was timed with, those at None left out (a run older than an option did not record it)."""
    return json.dumps({k: v for k, v in (options or {}).items() if v is not None}, sort_keys=True, default=str)


def _settings(sel: pd.DataFrame) -> pd.DataFrame:
    """The rows with a `setting` column (the variant, with the options that tell its option sets apart where
    the runs timed it with several) and one row per (setting, N): the median over the runs that measured it
    (`runs` says how many), a failed row only where no run measured that cell."""
    sel = sel.assign(options_key=[_options_key(o) for o in sel["options"]])
    labels = {}
    for variant, group in sel.groupby("variant", sort=False):
        keys = list(dict.fromkeys(group["options_key"]))
        for key in keys:
            if len(keys) == 1:
                labels[(variant, key)] = variant
                continue
            mine, others = json.loads(key), [json.loads(k) for k in keys if k != key]
            differ = {k: v for k, v in mine.items() if any(o.get(k) != v for o in others)}
            labels[(variant, key)] = (
                f"{variant} ({options_text(differ)})" if differ else variant
            )  # (the other sets add options)
    sel = sel.assign(setting=[labels[(v, k)] for v, k in zip(sel["variant"], sel["options_key"])])
    out = []
    for (_, n), group in sel.groupby(["setting", "n"], sort=False):
        ok = group[group["status"] == "ok"]
        if len(ok) > 1:
            row = ok.iloc[0].copy()
            row["time_median_s"] = float(ok["time_median_s"].median())
            peaks = [b for b in ok["peak_bytes"] if _known(b)]
            row["peak_bytes"] = float(pd.Series(peaks).median()) if peaks else None
            row["runs"] = len(ok)
            out.append(row)
        else:
            row = (ok if len(ok) else group).iloc[0].copy()
            row["runs"] = 1
            out.append(row)
    return pd.DataFrame(out).reset_index(drop=True)


def log_interp(points: list[tuple[int, float]], n: int) -> tuple[float, str]:
    """Value at n on the log-log line through the measured points: exact, between two, or beyond the ends
    (slope fitted on the two nearest points' side: the last half of the points)."""
    points = sorted(points)
    for m, v in points:
        if m == n:
            return v, "measured"
    below = [(m, v) for m, v in points if m < n]
    above = [(m, v) for m, v in points if m > n]
    if below and above:
        (m0, v0), (m1, v1) = below[-1], above[0]
        k = math.log(v1 / v0) / math.log(m1 / m0)
        return v0 * (n / m0) ** k, f"interpolated between N={m0} and N={m1}"
    if len(points) < 2:
        return float("nan"), f"only N={points[0][0]} measured: no exponent to extrapolate with"
    if below:  # beyond the largest
        k = fit_exponent([m for m, _ in points], [v for _, v in points])
        m0, v0 = below[-1]
        return v0 * (n / m0) ** k, f"extrapolated from N={m0} (~N^{k:.2f})"
    k = fit_exponent([m for m, _ in points[:2]], [v for _, v in points[:2]], upper_fraction=1.0)
    m1, v1 = above[0]
    return v1 * (n / m1) ** k, f"extrapolated down from N={m1} (~N^{k:.2f})"


def _causal_word(causal: bool) -> str:
    return "causal" if causal else "non-causal"


def options_text(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items() if v is not None)
