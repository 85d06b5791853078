"""Figures of a run: time, memory, speed-up over `full`, and distance to the hardware's limit.

Reads a run directory only (never measures). One figure per question, one panel per
(device, pass, causal). Output is deterministic: the same run gives byte-identical files.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import pandas as pd

from harness.readers.frames import load_frame
from harness.readers.quality_frames import accuracy_summary, by_distance_frame, cost_frame, quality_rows, state_frame
from harness.readers.summary import PANEL, crossover, fit_exponent, panel_rows
from harness.store.storage import read_metadata
from harness.sweep.config import BASELINE

FORMATS = ("png", "svg", "pdf")

# a variant's colour and marker come from its spec (`style`, recorded in a run's metadata); names without one get a stable pick
_FALLBACK_COLORS = ["#8c564b", "#e377c2", "#bcbd22", "#ff7f0e", "#aec7e8", "#ffbb78", "#c5b0d5"]
_FALLBACK_MARKERS = ["<", ">", "h", "*", "p", "d", "8"]
STOP_MARKER = {"oom": "OOM"}  # how a figure labels where a series stopped; other statuses by their name


def matplotlib_rc() -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    matplotlib.rcParams["svg.hashsalt"] = "attnbench"  # deterministic SVG ids


def variant_style(name: str, facts: dict | None = None) -> tuple[str, str]:
    """(colour, marker) of variant `name`: its spec's `style` as `facts` ({variant: facts}, a run's
    metadata["variants"]) recorded it, else a stable pick from the name."""
    style = ((facts or {}).get(name) or {}).get("style")
    if style:
        return style[0], style[1]
    h = zlib.crc32(name.encode())
    return _FALLBACK_COLORS[h % len(_FALLBACK_COLORS)], _FALLBACK_MARKERS[(h // 7) % len(_FALLBACK_MARKERS)]


def fmt_n(n: float) -> str:
    n = int(n)
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def caption(metadata: dict) -> str:
    env, cfg = metadata.get("environment", {}), metadata.get("config", {})
    gpu = (metadata.get("machine") or {}).get("gpu") or {}
    cpu = env.get("cpu", {})
    machine = f"{cpu.get('model') or 'CPU'} ({cpu.get('usable_cores') or cpu.get('cores')} cores)"
    if gpu.get("name"):
        machine += f", {gpu['name']}"
    nodes = (metadata.get("machine") or {}).get("nodes")
    if nodes:  # a run on a cluster (--executor ray): the hardware of its nodes, not the driver's
        kinds = dict.fromkeys(n["gpu_name"] if n.get("gpus") else n["cpu_model"] for n in nodes)
        machine = f"Ray cluster of {len(nodes)} node{'s' if len(nodes) > 1 else ''}: " + ", ".join(
            str(k) for k in kinds
        )
    if "d_model" in cfg:  # a quality run: the model's shape
        shape = (
            f"d_model={cfg.get('d_model')} layers={cfg.get('layers')} heads={cfg.get('heads')} batch={cfg.get('batch')}"
        )
    else:
        kv = f" on {cfg['kv_heads']} K/V" if cfg.get("kv_heads") else ""
        shape = f"B={cfg.get('batch')} H={cfg.get('heads')}{kv} D={cfg.get('head_dim')}"
    return f"{machine} · {cfg.get('dtype', 'float32')} · {shape} · torch {env.get('versions', {}).get('torch')}"


# what "peak extra memory" measures on each device: not the same quantity, so each axis says which
MEMORY_KIND = {"cpu": "\nprocess RSS high-water mark", "cuda": "\nCUDA allocator peak (allocated bytes)"}


def _panels(df: pd.DataFrame) -> list[tuple]:
    return list(df[PANEL].drop_duplicates().itertuples(index=False, name=None))


def _panel_title(panel: tuple) -> str:
    device, pass_, causal = panel
    what = {"fwd": "forward", "fwdbwd": "forward + backward", "decode": "decode step (1 token after N)"}.get(
        pass_, pass_
    )
    return f"{device} · {what} · {'causal' if causal else 'non-causal'}"


def _grid(n_panels: int, max_cols: int, panel_size: tuple[float, float]):
    """A figure of n_panels axes, at most max_cols a row, the unused cells hidden: (fig, the axes)."""
    matplotlib_rc()
    import matplotlib.pyplot as plt

    cols = min(max_cols, n_panels)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(panel_size[0] * cols, panel_size[1] * rows), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n_panels])


def _figure(n_panels: int, title: str, metadata: dict):
    fig, axes = _grid(n_panels, 2, (6.4, 4.8))
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
    """Faint O(N) and O(N²) lines through the smallest N at height `anchor`."""
    lo, hi = min(ns), max(ns)
    for power, label in ((1, "O(N)"), (2, "O(N²)")):
        ys = [anchor * (n / lo) ** power for n in (lo, hi)]
        ax.plot([lo, hi], ys, color="0.6", lw=0.8, ls=":", zorder=0)
        ax.annotate(label, (hi, ys[1]), fontsize=7, color="0.5", xytext=(2, 0), textcoords="offset points")


def _stop_marker(ax, group: pd.DataFrame, ycol: str, y_default: float, scale: float, facts: dict | None = None) -> None:
    """Mark where a series stopped (oom, timeout, skipped...), at its last measured height (× scale)."""
    failed = group[group["status"] != "ok"].sort_values("n")
    if failed.empty or (group["status"] == "skipped").all():  # nothing stopped: a mode or pass the variant never runs
        return
    first = failed.iloc[0]
    ok = group[(group["status"] == "ok") & (group["n"] < first["n"])].sort_values("n")
    y = (
        float(ok.iloc[-1][ycol])
        if not ok.empty and pd.notna(ok.iloc[-1][ycol]) and ok.iloc[-1][ycol] > 0
        else y_default
    )
    y *= scale
    color, _ = variant_style(first["variant"], facts)
    ax.scatter([first["n"]], [y], marker="X", s=60, color=color, edgecolor="black", linewidths=0.6, zorder=5)
    ax.annotate(
        STOP_MARKER.get(first["status"], first["status"]),
        (first["n"], y),
        fontsize=7,
        color=color,
        xytext=(4, -10),
        textcoords="offset points",
    )


def save_figure(fig, path: Path) -> Path:
    """Save without the timestamps and version strings that would make two saves differ."""
    fmt = path.suffix.lstrip(".") or "png"
    metadata = {
        "png": {"Software": None},
        "svg": {"Date": None, "Creator": None},
        "pdf": {"CreationDate": None, "Creator": None, "Producer": None},
    }[fmt]
    matplotlib_rc()
    fig.savefig(path, format=fmt, dpi=110, metadata=metadata, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _scaling_figure(df, metadata, ycol, ylabel, title, scale, path) -> Path:
    panels = _panels(df)
    fig, axes = _figure(len(panels), title, metadata)
    for ax, panel in zip(axes, panels):
        sub = panel_rows(df, panel)
        ok_all = sub[(sub["status"] == "ok") & (sub[ycol] > 0)]
        for variant, group in sub.groupby("variant", sort=False):
            color, marker = variant_style(variant, metadata.get("variants"))
            ok = group[(group["status"] == "ok") & (group[ycol] > 0)].sort_values("n")
            if not ok.empty:
                exponent = fit_exponent(ok["n"], ok[ycol].astype(float))
                label = f"{variant}: n^{exponent:.2f}" if exponent is not None else variant
                ax.plot(ok["n"], ok[ycol] * scale, color=color, marker=marker, ms=4, lw=1.4, label=label)
            _stop_marker(
                ax, group, ycol, float(ok_all[ycol].min()) if not ok_all.empty else 1.0, scale, metadata.get("variants")
            )
        if not ok_all.empty:
            _guides(ax, sub["n"].tolist(), float(ok_all.sort_values("n").iloc[0][ycol]) * scale)
        ax.set_yscale("log")
        _n_axis(ax, sub["n"].tolist())
        ax.set_ylabel(ylabel + (MEMORY_KIND.get(panel[0].split(" ")[0], "") if ycol == "peak_bytes" else ""))
        ax.set_title(_panel_title(panel), fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path)


def _speedup_figure(df, metadata, path) -> Path:
    panels = _panels(df)
    fig, axes = _figure(len(panels), f"Speed-up over {BASELINE} (time of {BASELINE} / time of variant)", metadata)
    for ax, panel in zip(axes, panels):
        sub = panel_rows(df, panel, ok_only=True)
        base = sub[sub["variant"] == BASELINE].set_index("n")["time_median_s"]
        for variant, group in sub.groupby("variant", sort=False):
            if variant == BASELINE or base.empty:
                continue
            color, marker = variant_style(variant, metadata.get("variants"))
            ok = group.set_index("n")["time_median_s"]
            common = sorted(set(ok.index) & set(base.index))
            if not common:
                continue
            ax.plot(common, [base[n] / ok[n] for n in common], color=color, marker=marker, ms=4, lw=1.4, label=variant)
            cross_n, note = crossover(group, sub[sub["variant"] == BASELINE])
            if cross_n is not None and note != "always faster":
                ax.scatter(
                    [cross_n],
                    [base[cross_n] / ok[cross_n]],
                    s=90,
                    facecolors="none",
                    edgecolors=color,
                    linewidths=1.5,
                    zorder=5,
                )
                ax.annotate(
                    f"faster from {fmt_n(cross_n)}",
                    (cross_n, base[cross_n] / ok[cross_n]),
                    fontsize=7,
                    color=color,
                    xytext=(4, 6),
                    textcoords="offset points",
                )
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_yscale("log")
        _n_axis(ax, sub["n"].tolist() or [1])
        ax.set_ylabel(f"speed-up over {BASELINE} (×)")
        ax.set_title(_panel_title(panel), fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path)


def _efficiency_figure(df, metadata, path) -> Path:
    machine = metadata.get("machine") or {}
    peaks, bandwidths = machine.get("matmul_peak_gflops") or {}, machine.get("memory_bandwidth_gbs") or {}
    dtype = metadata.get("config", {}).get("dtype", "float32")
    panels = _panels(df)
    title = "Achieved useful FLOP/s as a fraction of the measured matmul peak"
    if any(panel[1] == "decode" for panel in panels):
        title += " (decode: bytes read a second as a fraction of the measured copy bandwidth)"
    fig, axes = _figure(len(panels), title, metadata)
    for ax, panel in zip(axes, panels):
        decode = panel[1] == "decode"  # memory-bound: its limit is the bandwidth, its figure the bytes it reads
        peak = bandwidths.get(panel[0]) if decode else peaks.get(f"{panel[0]}/{dtype}")
        column = "bandwidth_gbs" if decode else "gflops"
        sub = panel_rows(df, panel, ok_only=True)
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
        ax.set_title(_panel_title(panel), fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
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


def plot_quality(run_dir: Path, out_dir: Path | None = None, fmt: str = "png") -> list[Path]:
    """Quality figures: final accuracy vs L per variant (mean over seeds, min-max band; a panel per task),
    accuracy by distance (a panel per task and L, the window's width marked), the training-step cost
    against L (when measured), and the training curves."""
    matplotlib_rc()
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = quality_rows(run_dir)
    if not rows:
        return []
    df = pd.DataFrame(rows)
    out_dir = Path(out_dir) if out_dir else run_dir / "figures"
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = read_metadata(run_dir)
    cfg = meta.get("config", {})
    summary = accuracy_summary(rows)
    tasks = list(dict.fromkeys(df["task"]))
    seeds = int(summary["seeds"].max()) if not summary.empty else 1
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.0 * len(tasks), 4.4), squeeze=False, layout="constrained")
    for ax, task in zip(axes.flat, tasks):
        for variant, group in summary[summary["task"] == task].groupby("variant", sort=False):
            color, marker = variant_style(variant, meta.get("variants"))
            group = group.sort_values("length")
            ax.plot(group["length"], group["accuracy"], color=color, marker=marker, lw=1.4, label=variant)
            if seeds > 1:
                ax.fill_between(
                    group["length"], group["accuracy_min"], group["accuracy_max"], color=color, alpha=0.15, lw=0
                )
        _length_axis(ax, sorted(df["length"].unique()))
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("held-out token accuracy" + (f" (mean of {seeds} seeds, band: min-max)" if seeds > 1 else ""))
        ax.set_title(f"{task}", fontsize=9)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(
        f"Accuracy after training, same model and recipe for every variant\n"
        f"d_model={cfg.get('d_model')}, layers={cfg.get('layers')}, steps={cfg.get('steps')}"
        f"{', curriculum' if cfg.get('curriculum') else ''}, options {cfg.get('options')}",
        fontsize=10,
    )
    paths = [save_figure(fig, out_dir / f"quality_accuracy.{fmt}")]

    distance = by_distance_frame(rows, meta.get("variants"))
    if not distance.empty:
        paths.append(_distance_figure(distance, cfg, out_dir / f"quality_distance.{fmt}", meta.get("variants")))
    costs = cost_frame(run_dir)
    if not costs.empty and (costs["status"] == "ok").any():
        paths.append(_training_cost_figure(costs[costs["status"] == "ok"], meta, out_dir / f"training_cost.{fmt}"))
    states = state_frame(rows)
    if not states.empty:
        paths.append(_state_figure(states, meta, out_dir / f"recall_state.{fmt}"))
    paths.append(_curves_figure(df, out_dir / f"quality_curves.{fmt}", meta.get("variants")))
    return paths


def _state_figure(states: pd.DataFrame, meta: dict, path: Path) -> Path:
    """Recall accuracy against the decoding state's bytes (log x), a line per variant through its lengths."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    for variant, group in states.groupby("variant", sort=False):
        color, marker = variant_style(variant, meta.get("variants"))
        group = group.sort_values("state_bytes")
        ax.plot(group["state_bytes"], group["accuracy"], color=color, marker=marker, lw=1.2, label=variant)
        for _, r in group.iterrows():
            ax.annotate(
                f"L={int(r['length'])}",
                (r["state_bytes"], r["accuracy"]),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decoding state after the sequence (bytes, every layer, batch 1)")
    ax.set_ylabel("recall accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Recall against state size (Zoology's axis)", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def _length_axis(ax, ticks, label: str = "length L") -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([fmt_n(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(True, alpha=0.3)


def _distance_figure(distance: pd.DataFrame, cfg: dict, path: Path, facts: dict | None = None) -> Path:
    """Accuracy against distance (bucket midpoints, log axis), a panel per (task, L); the window's
    reach w (one layer) and 2w (the model's) drawn as lines."""
    # copy reads every answer exactly L back: one panel across L; other tasks a panel per L
    panels = list(dict.fromkeys((t, None if t == "copy" else n) for t, n in zip(distance["task"], distance["length"])))
    fig, axes = _grid(len(panels), 3, (4.6, 3.6))
    for ax, (task, length) in zip(axes, panels):
        sub = distance[(distance["task"] == task) & ((distance["length"] == length) if length else True)]
        for variant, group in sub.groupby("variant", sort=False):
            color, marker = variant_style(variant, facts)
            if length is None:  # copy: the distance is exactly L
                mid = group["length"]
                ax.plot(mid, group["accuracy"], color=color, marker=marker, lw=1.3, ms=4, label=variant)
            else:  # a bucket [min, max]: a point at its geometric middle, a bar over its extent
                mid = (group["min"] * (group["max"] + 1)) ** 0.5
                ax.errorbar(
                    mid,
                    group["accuracy"],
                    xerr=[mid - group["min"], group["max"] + 1 - mid],
                    color=color,
                    marker=marker,
                    lw=1.3,
                    ms=4,
                    elinewidth=0.6,
                    capsize=0,
                    label=variant,
                )
            if (group["seeds"] > 1).any():
                ax.fill_between(mid, group["accuracy_min"], group["accuracy_max"], color=color, alpha=0.12, lw=0)
        reached = sub.dropna(subset=["window"]).drop_duplicates("window")
        windows = dict(
            zip(reached["window"].astype(int), reached["variant"])
        )  # each reach in the colour of its first variant
        for w in sorted(windows):
            color = variant_style(windows[w], facts)[0]
            ax.axvline(w, color=color, ls="--", lw=1)
            ax.axvline(2 * w, color=color, ls=":", lw=1)
            ax.text(w, 0.02, f" w={w}", color=color, fontsize=7)
            ax.text(2 * w, 0.1, " 2w", color=color, fontsize=7)
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("distance to the answer (positions; bars: a bucket's extent)", fontsize=8)
        ax.set_ylabel("held-out accuracy", fontsize=8)
        ax.set_title(f"{task}, L={length}" if length else f"{task}: every symbol is L back (a point per L)", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    fig.suptitle(
        "Accuracy by distance: how far back the answer sits (dashed: the window w; dotted: 2w, "
        f"the reach of {cfg.get('layers', 2)} stacked windows)",
        fontsize=10,
    )
    return save_figure(fig, path)


def _training_cost_figure(costs: pd.DataFrame, meta: dict, path: Path) -> Path:
    """Training-step time and peak memory against the sequence length the model reads, per task."""
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(costs["task"]))
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.6 * len(tasks), 7.0), squeeze=False, layout="constrained")
    for col, task in enumerate(tasks):
        sub = costs[costs["task"] == task]
        for row, (ycol, label, scale) in enumerate(
            (("step_ms", "training step (ms)", 1.0), ("train_peak_bytes", "peak memory of a step (MiB)", 1 / 2**20))
        ):
            ax = axes[row][col]
            for variant, group in sub.groupby("variant", sort=False):
                color, marker = variant_style(variant, meta.get("variants"))
                group = group.sort_values("seq_len")
                ax.plot(group["seq_len"], group[ycol] * scale, color=color, marker=marker, lw=1.3, label=variant)
            _length_axis(ax, sorted(sub["seq_len"].unique()), "tokens per sequence")
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.set_title(f"{task} (batch {int(sub['batch'].iloc[0])})", fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        "Cost of a whole training step (model, loss, backward, AdamW) with each attention\n" + caption(meta), fontsize=9
    )
    return save_figure(fig, path)


def _curves_figure(df: pd.DataFrame, path: Path, facts: dict | None = None) -> Path:
    df = df.assign(seed=df["seed"] if "seed" in df else 0)
    panels = list(dict.fromkeys(zip(df["task"], df["length"])))
    fig, axes = _grid(len(panels), 4, (4.2, 3.4))
    for ax, (task, length) in zip(axes, panels):
        sub = df[(df["task"] == task) & (df["length"] == length)]
        for (variant, seed), group in sub.groupby(["variant", "seed"], sort=False):
            color, marker = variant_style(variant, facts)
            group = group.sort_values("step")
            ax.plot(
                group["step"],
                group["eval_accuracy"],
                color=color,
                lw=1.0,
                alpha=0.8,
                label=variant if seed == sub["seed"].min() else None,
            )
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task}, L={length}", fontsize=9)
        ax.set_xlabel("training step (at this length)", fontsize=8)
        ax.set_ylabel("held-out accuracy", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    fig.suptitle("Training curves (a line per seed)", fontsize=10)
    return save_figure(fig, path)


def tradeoff_figure(panels: list[tuple[str, int, list]], path: Path, subtitle: str, facts: dict | None = None) -> Path:
    """Accuracy against time per call, a panel per (task, N): each variant one point (bar: the seeds'
    min-max); a hollow marker where the time at N is interpolated or extrapolated, not measured.
    panels: (task, N, advise.Answer list)."""
    matplotlib_rc()
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 4.4), squeeze=False, layout="constrained")
    for ax, (task, n, answers) in zip(axes.flat, panels):
        drawn = [a for a in answers if a.accuracy is not None and a.time_s is not None and math.isfinite(a.time_s)]
        for i, a in enumerate(sorted(drawn, key=lambda a: a.time_s)):
            color, marker = variant_style(a.variant, facts)
            lo, hi = a.accuracy_range or (a.accuracy, a.accuracy)
            ax.errorbar(
                [a.time_s * 1e3],
                [a.accuracy],
                yerr=[[a.accuracy - lo], [hi - a.accuracy]],
                color=color,
                marker=marker,
                ms=8,
                mfc=color if a.how == "measured" else "none",
                capsize=3,
                lw=1,
                label=a.variant,
            )
            ax.annotate(
                a.variant + ("" if a.quality_length == n else f" (L={a.quality_length})"),
                (a.time_s * 1e3, a.accuracy),
                textcoords="offset points",
                xytext=(6, 4 - 14 * (i % 2)),
                fontsize=7,
                color=color,
            )  # neighbours alternate
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.05)
        ax.set_xlabel(f"time per attention call at N={fmt_n(n)} (ms)")
        ax.set_ylabel(f"held-out accuracy, {task}")
        ax.set_title(f"{task}, N={fmt_n(n)}", fontsize=9)
        ax.grid(True, alpha=0.3)
    fig.suptitle(
        "What each variant costs and what it keeps (up and to the left is better; hollow: time not measured at N)\n"
        + subtitle,
        fontsize=9,
    )
    return save_figure(fig, path)
