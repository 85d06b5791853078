"""A speed run's figures: time and memory against N (log-log, fitted exponents), the speed-up over full,
the fraction of the matmul peak; a marker where a variant stopped (OOM, skipped)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.readers.speed.frames import load_frame
from harness.readers.plots import FORMATS, caption, fmt_n, grid, matplotlib_rc, save_figure, variant_style
from harness.readers.speed.summary import PANEL, crossover, fit_exponent, panel_rows
from harness.store.storage import baseline_of, read_metadata

STOP_MARKER = {"oom": "OOM"}  # how a figure labels where a series stopped; other statuses by their name


# what "peak extra memory" measures on each device: not the same quantity, so each axis says which
MEMORY_KIND = {"cpu": "\nprocess RSS high-water mark", "cuda": "\nCUDA allocator peak (allocated bytes)"}


SMALL_MULTIPLE = 6  # a panel of more variants is drawn as one panel a kind of method, each with the baseline


def _panels(df: pd.DataFrame) -> list[tuple]:
    return list(df[PANEL].drop_duplicates().itertuples(index=False, name=None))


def _axes_plan(df: pd.DataFrame, metadata: dict) -> list[tuple[tuple, str | None, list[str]]]:
    """(panel, kind, variants) an axes: a (device, pass, causal) panel of more than SMALL_MULTIPLE variants becomes
    small multiples, one a kind of method (`VariantSpec.kind`, as the run recorded it) beside the baseline."""
    facts = metadata.get("variants") or {}
    base = baseline_of(facts)
    plan = []
    for panel in _panels(df):
        rows = panel_rows(df, panel)
        names = list(dict.fromkeys(rows.loc[rows["status"] != "skipped", "variant"]))  # (not the never-run)
        kinds = {name: (facts.get(name) or {}).get("kind") or "other" for name in names if name != base}
        if len(names) <= SMALL_MULTIPLE or set(kinds.values()) == {"other"}:
            plan.append((panel, None, names))
            continue
        for kind in dict.fromkeys(kinds.values()):
            plan.append((panel, kind, [name for name in names if name == base or kinds.get(name) == kind]))
    return plan


def _panel_title(panel: tuple, kind: str | None = None) -> str:
    device, pass_, causal = panel
    what = {"fwd": "forward", "fwdbwd": "forward + backward", "decode": "decode step (1 token after N)"}.get(
        pass_, pass_
    )
    return (f"{kind} · " if kind else "") + f"{device} · {what} · {'causal' if causal else 'non-causal'}"


def _figure(n_panels: int, title: str, metadata: dict):
    fig, axes = grid(n_panels, 2 if n_panels <= 4 else 3, (6.4, 4.8) if n_panels <= 4 else (4.8, 3.8))
    fig.suptitle(f"{title}\n{caption(metadata)}", fontsize=10)
    return fig, axes


def _n_axis(ax, ns) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(int(n) for n in ns))
    ax.set_xticks(ticks)
    ax.set_xticklabels([fmt_n(n) for n in ticks], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("sequence length N")
    ax.grid(True, which="major", alpha=0.3)


def _guides(ax, ns, anchor: float) -> None:
    """Faint O(N) and O(N²) lines through the smallest N at height `anchor`, named in the legend."""
    lo, hi = min(ns), max(ns)
    for power, label, style in ((1, "O(N)", ":"), (2, "O(N²)", "--")):
        ys = [anchor * (n / lo) ** power for n in (lo, hi)]
        ax.plot([lo, hi], ys, color="0.6", lw=0.8, ls=style, zorder=0, label=label)


def _stopped(group: pd.DataFrame) -> pd.Series | None:
    """The first row where a series stopped (oom, timeout, skipped...), None where it did not (or never ran)."""
    failed = group[group["status"] != "ok"].sort_values("n")
    if failed.empty or (group["status"] == "skipped").all():  # nothing stopped: a mode or pass the variant never runs
        return None
    return failed.iloc[0]


def _stop_marker(
    ax, group: pd.DataFrame, ycol: str, y_default: float, scale: float, facts: dict | None, label: str | None = None
) -> None:
    """Mark where a series stopped, at its last measured height (× scale); the legend says why (`_stop_text`)."""
    if _stopped(group) is None:
        return
    first = _stopped(group)
    ok = group[(group["status"] == "ok") & (group["n"] < first["n"])].sort_values("n")
    y = (
        float(ok.iloc[-1][ycol])
        if not ok.empty and pd.notna(ok.iloc[-1][ycol]) and ok.iloc[-1][ycol] > 0
        else y_default
    )
    y *= scale
    color, _ = variant_style(first["variant"], facts)
    ax.scatter(
        [first["n"]], [y], marker="X", s=60, color=color, edgecolor="black", linewidths=0.6, zorder=5, label=label
    )


def _stop_text(group: pd.DataFrame) -> str:
    """ " (skipped from 8k)": where and why the series stopped, for its legend entry; "" where it did not."""
    first = _stopped(group)
    return "" if first is None else f" ({STOP_MARKER.get(first['status'], first['status'])} from {fmt_n(first['n'])})"


def _scaling_figure(df, metadata, ycol, ylabel, title, scale, path) -> Path:
    plan = _axes_plan(df, metadata)
    fig, axes = _figure(len(plan), title, metadata)
    for ax, (panel, kind, names) in zip(axes, plan):
        sub = panel_rows(df, panel)
        sub = sub[sub["variant"].isin(names)]
        ok_all = sub[(sub["status"] == "ok") & (sub[ycol] > 0)]
        for variant, group in sub.groupby("variant", sort=False):
            color, marker = variant_style(variant, metadata.get("variants"))
            ok = group[(group["status"] == "ok") & (group[ycol] > 0)].sort_values("n")
            if not ok.empty:
                exponent = fit_exponent(ok["n"], ok[ycol].astype(float))
                label = (f"{variant}: n^{exponent:.2f}" if exponent is not None else variant) + _stop_text(group)
                ax.plot(ok["n"], ok[ycol] * scale, color=color, marker=marker, ms=4, lw=1.4, label=label)
            _stop_marker(
                ax,
                group,
                ycol,
                float(ok_all[ycol].min()) if not ok_all.empty else 1.0,
                scale,
                metadata.get("variants"),
                None if not ok.empty else variant + _stop_text(group),  # no line to name it: the marker is named
            )
        if not ok_all.empty:
            _guides(ax, sub["n"].tolist(), float(ok_all.sort_values("n").iloc[0][ycol]) * scale)
        ax.set_yscale("log")
        _n_axis(ax, sub["n"].tolist())
        ax.set_ylabel(ylabel + (MEMORY_KIND.get(panel[0].split(" ")[0], "") if ycol == "peak_bytes" else ""))
        ax.set_title(_panel_title(panel, kind), fontsize=9)
        ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def _speedup_figure(df, metadata, path) -> Path:
    plan = _axes_plan(df, metadata)
    base_name = baseline_of(metadata.get("variants") or {}) or "the baseline"
    title = f"Speed-up over {base_name} (time of {base_name} / time of variant; ○: faster from there on)"
    fig, axes = _figure(len(plan), title, metadata)
    for ax, (panel, kind, names) in zip(axes, plan):
        sub = panel_rows(df, panel, ok_only=True)
        sub = sub[sub["variant"].isin(names)]
        base = sub[sub["variant"] == base_name].set_index("n")["time_median_s"]
        for variant, group in sub.groupby("variant", sort=False):
            if variant == base_name or base.empty:
                continue
            color, marker = variant_style(variant, metadata.get("variants"))
            ok = group.set_index("n")["time_median_s"]
            common = sorted(set(ok.index) & set(base.index))
            if not common:
                continue
            cross_n, note = crossover(group, sub[sub["variant"] == base_name])
            faster = cross_n is not None and note != "always faster"  # said in the legend: no label to collide
            label = f"{variant} (faster from {fmt_n(cross_n)})" if faster else variant
            ax.plot(common, [base[n] / ok[n] for n in common], color=color, marker=marker, ms=4, lw=1.4, label=label)
            if faster:
                ax.scatter(
                    [cross_n],
                    [base[cross_n] / ok[cross_n]],
                    s=90,
                    facecolors="none",
                    edgecolors=color,
                    linewidths=1.5,
                    zorder=5,
                )
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_yscale("log")
        _n_axis(ax, sub["n"].tolist() or [1])
        ax.set_ylabel(f"speed-up over {base_name} (×)")
        ax.set_title(_panel_title(panel, kind), fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def _efficiency_figure(df, metadata, path) -> Path:
    machine = metadata.get("machine") or {}
    peaks, bandwidths = machine.get("matmul_peak_gflops") or {}, machine.get("memory_bandwidth_gbs") or {}
    dtype = metadata.get("config", {}).get("dtype", "float32")
    plan = _axes_plan(df, metadata)
    title = "Achieved useful FLOP/s as a fraction of the measured matmul peak"
    if any(panel[1] == "decode" for panel, _, _ in plan):
        title += " (decode: bytes read a second as a fraction of the measured copy bandwidth)"
    fig, axes = _figure(len(plan), title, metadata)
    for ax, (panel, kind, names) in zip(axes, plan):
        decode = panel[1] == "decode"  # memory-bound: its limit is the bandwidth, its figure the bytes it reads
        peak = bandwidths.get(panel[0]) if decode else peaks.get(f"{panel[0]}/{dtype}")
        column = "bandwidth_gbs" if decode else "gflops"
        sub = panel_rows(df, panel, ok_only=True)
        sub = sub[sub["variant"].isin(names)]
        for variant, group in sub.groupby("variant", sort=False):
            if not peak or column not in group:
                break
            color, marker = variant_style(variant, metadata.get("variants"))
            group = group.sort_values("n")
            ax.plot(group["n"], group[column] / peak, color=color, marker=marker, ms=4, lw=1.4, label=variant)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        _n_axis(ax, sub["n"].tolist() or [1])
        if decode:
            ax.set_ylabel(f"fraction of copy bandwidth ({peak:.1f} GB/s)" if peak else "no bandwidth in metadata")
        else:
            ax.set_ylabel(f"fraction of matmul peak ({peak:.0f} GFLOP/s)" if peak else "no matmul peak in metadata")
        ax.set_title(_panel_title(panel, kind), fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def plot_run(run_dir: Path, out_dir: Path | None = None, fmt: str = "png") -> list[Path]:
    """Write the run's four figures into out_dir (default RUN_DIR/figures); returns their paths."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not supported; choose from {', '.join(FORMATS)}")
    matplotlib_rc()
    run_dir = Path(run_dir)
    metadata = read_metadata(run_dir)
    df = load_frame(run_dir)
    if df.empty:
        raise ValueError(f"{run_dir} has no results yet")
    df["causal"] = df["causal"].astype(bool)
    out_dir = Path(out_dir) if out_dir else run_dir / "figures"
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _scaling_figure(
            df,
            metadata,
            "time_median_s",
            "time per call (ms)",
            "Time per call vs sequence length",
            1e3,
            out_dir / f"time.{fmt}",
        ),
        _scaling_figure(
            df,
            metadata,
            "peak_bytes",
            "peak extra memory (MiB)",
            "Peak extra memory vs sequence length",
            1 / 2**20,
            out_dir / f"memory.{fmt}",
        ),
        _speedup_figure(df, metadata, out_dir / f"speedup.{fmt}"),
        _efficiency_figure(df, metadata, out_dir / f"efficiency.{fmt}"),
    ]
