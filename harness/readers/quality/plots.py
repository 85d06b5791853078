"""A quality run's figures: accuracy by length and by distance, decoding-state size, training cost and
curves; and the trade-off figure, accuracy against time per call."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.readers.plots import caption, fmt_n, grid, matplotlib_rc, save_figure, variant_style
from harness.readers.quality.frames import (
    accuracy_summary,
    by_distance_frame,
    cost_frame,
    quality_rows,
    state_frame,
    sweep_rows,
    width_frame,
)
from harness.readers.quality.positions import positions_figure
from harness.store.storage import read_metadata


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
    if cfg.get("positions_axis"):  # encodings are read apart (never pooled as seeds of one)
        return [positions_figure(run_dir, rows, out_dir, fmt)]
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
    if cfg.get("d_models") or cfg.get("lrs"):
        paths.append(width_figure(width_frame(sweep_rows(run_dir)), meta, out_dir / f"quality_width.{fmt}"))
    paths.append(_curves_figure(df, out_dir / f"quality_curves.{fmt}", meta.get("variants")))
    return paths


def width_figure(widths: pd.DataFrame, meta: dict, path: Path) -> Path:
    """Zoology's figure: accuracy (the best learning rate at each width) against d_model, and against the decoding
    state's bytes (log x), a line per variant; a panel pair per (task, L)."""
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(zip(widths["task"], widths["length"])))
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 4.2 * len(panels)), squeeze=False, layout="constrained")
    for (left, right), (task, length) in zip(axes, panels):
        sub = widths[(widths["task"] == task) & (widths["length"] == length)]
        for variant, group in sub.groupby("variant", sort=False):
            color, marker = variant_style(variant, meta.get("variants"))
            group = group.sort_values("d_model")
            left.plot(group["d_model"], group["accuracy"], color=color, marker=marker, lw=1.4, label=variant)
            if group["state_bytes"].notna().all():
                right.plot(group["state_bytes"], group["accuracy"], color=color, marker=marker, lw=1.4, label=variant)
        _length_axis(left, sorted(sub["d_model"].unique()), "model dimension d_model")
        right.set_xscale("log", base=2)
        right.set_xlabel("decoding state after the sequence (bytes, every layer, batch 1)")
        right.grid(True, alpha=0.3)
        for ax in (left, right):
            ax.set_ylim(-0.02, 1.02)
            ax.set_ylabel("held-out accuracy (best learning rate)")
            ax.set_title(f"{task} L={length}", fontsize=9)
        left.legend(fontsize=7, loc="lower right")
    fig.suptitle("Accuracy against model width and state size (Zoology's figure)", fontsize=10)
    return save_figure(fig, path)


def _state_figure(states: pd.DataFrame, meta: dict, path: Path) -> Path:
    """Recall accuracy against the decoding state's bytes (log x), a line per variant through its lengths."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    lengths = sorted(states["length"].unique())
    for variant, group in states.groupby("variant", sort=False):
        color, marker = variant_style(variant, meta.get("variants"))
        group = group.sort_values("state_bytes")
        span = sorted(int(n) for n in group["length"].unique())
        label = variant + (f" (L {span[0]}–{span[-1]})" if len(span) > 1 else f" (L {span[0]})")
        ax.plot(group["state_bytes"], group["accuracy"], color=color, lw=1.2, label=label, marker=marker, ms=3)
        sizes = [10 + 14 * lengths.index(n) for n in group["length"]]  # larger: longer (no labels to collide)
        ax.scatter(group["state_bytes"], group["accuracy"], s=sizes, color=color, marker=marker, zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decoding state after the sequence (bytes, every layer, batch 1)")
    ax.set_ylabel("recall accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Recall against state size (Zoology's axis; a point an L, larger: longer)", fontsize=10)
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
    fig, axes = grid(len(panels), 3, (4.6, 3.6))
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
            widths = sorted(sub["cfg_d_model"].unique())  # a sweep's widths: a line each, dashed the narrower
            for (variant, width), line in sub.groupby(["variant", "cfg_d_model"], sort=False):
                color, marker = variant_style(variant, meta.get("variants"))
                name = variant if len(widths) == 1 else f"{variant} d_model {width}"
                line, dashes = line.sort_values("seq_len"), {"linestyle": "--"} if width != widths[-1] else {}
                ax.plot(line["seq_len"], line[ycol] * scale, color=color, marker=marker, lw=1.3, label=name, **dashes)
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
    fig, axes = grid(len(panels), 4, (4.2, 3.4))
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
