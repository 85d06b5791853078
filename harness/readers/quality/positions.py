"""A quality run with an axis of position encodings (`bench quality --positions ...`, the positions preset): accuracy
at the training length L and at each --extrapolate factor, per (task, variant, encoding) over seeds; its table, its
figure (a panel per task and variant, a line per encoding), and the pairs not trained with their reasons. Such a
run is read here only: the other quality readers would pool its encodings as if seeds of one."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.readers.plots import grid, save_figure
from harness.readers.tables import figure_links, markdown_table, md_text
from harness.store.storage import read_metadata

ENCODING_STYLE = {  # (colour, line style) of each encoding in the figure, the same in every panel
    "sinusoidal": ("#1f77b4", "-"),
    "learned": ("#ff7f0e", "-"),
    "rope": ("#2ca02c", "-"),
    "alibi": ("#d62728", "--"),
    "relative": ("#9467bd", "--"),
    "none": ("#7f7f7f", ":"),
}


def positions_frame(rows: list[dict]) -> pd.DataFrame:
    """One row per (task, variant, encoding, seed, factor) of the finished trainings: factor 1 is the
    evaluation at the training length, the others the `extrapolation` the final row carries."""
    out = []
    for r in rows:
        if not r.get("final"):
            continue
        base = {"task": r["task"], "variant": r["variant"], "positions": r.get("cfg_positions") or "sinusoidal"}
        base["seed"], base["train_length"] = int(r.get("seed", 0)), int(r["length"])
        out.append({**base, "factor": 1, "accuracy": r["eval_accuracy"], "exact": r.get("eval_exact_match")})
        for e in r.get("extrapolation") or ():
            out.append(
                {**base, "factor": int(e["factor"]), "accuracy": e["eval_accuracy"], "exact": e["eval_exact_match"]}
            )
    return pd.DataFrame(
        out, columns=["task", "variant", "positions", "seed", "train_length", "factor", "accuracy", "exact"]
    )


def positions_summary(rows: list[dict]) -> pd.DataFrame:
    """Mean, min and max accuracy over seeds, and the seeds counted, per (task, variant, encoding, factor)."""
    df = positions_frame(rows)
    keys = ["task", "variant", "positions", "train_length", "factor"]
    return (
        df.groupby(keys, sort=False)
        .agg(
            accuracy=("accuracy", "mean"), low=("accuracy", "min"), high=("accuracy", "max"), seeds=("seed", "nunique")
        )
        .reset_index()
    )


def _cell(row) -> str:
    text = f"{100 * row.accuracy:.1f}"
    return text if row.seeds < 2 else f"{text} ({100 * row.low:.0f}-{100 * row.high:.0f})"


def _learned_against_sinusoidal(summary: pd.DataFrame) -> list[str]:
    """The notes' claim, checked at the training length: learned embeddings beat sinusoidal on short inputs."""
    at_one = summary[summary["factor"] == 1].set_index(["task", "variant", "positions"])["accuracy"]
    pairs = []
    for (task, variant, encoding), value in at_one.items():
        if encoding == "learned" and (task, variant, "sinusoidal") in at_one:
            pairs.append((task, variant, value - at_one[(task, variant, "sinusoidal")]))
    if not pairs:
        return []
    wins = sum(d > 0.005 for *_, d in pairs)
    losses = sum(d < -0.005 for *_, d in pairs)
    detail = ", ".join(f"{t} `{v}` {100 * d:+.1f}" for t, v, d in pairs)
    return [
        "Learned against sinusoidal positions at the training length (the notes: learned embeddings do better on "
        f"short inputs): learned ahead in {wins} of {len(pairs)} (task, variant) pairs, behind in {losses}, "
        f"within half a point in the rest (points of accuracy, mean over seeds: {detail}).",
        "",
    ]


def positions_section(run_dir: Path, cfg: dict, rows: list[dict], figures) -> list[str]:
    """REPORT.md's section of a run with an axis of encodings."""
    summary = positions_summary(rows)
    factors = sorted(summary["factor"].unique())
    seeds = int(summary["seeds"].max()) if not summary.empty else 0
    lines = [
        "## Quality: position encodings, trained at L and evaluated at longer lengths",
        "",
        f"Preset {cfg.get('preset')}. Each variant trained with every encoding it can carry (`--positions "
        f"{'all' if cfg.get('refused') is not None else ','.join(cfg.get('positions_axis') or [])}`): d_model="
        f"{cfg.get('d_model')}, layers={cfg.get('layers')}, heads={cfg.get('heads')}, steps={cfg.get('steps')}, "
        f"batch={cfg.get('batch')}, lr={cfg.get('lr')}, a causal convolution of width {cfg.get('short_conv')} before "
        f"each attention{'' if cfg.get('short_conv') else ' (none)'}, variant options {md_text(cfg.get('options'))}; "
        f"seeds 0-{seeds - 1}. The trained model is then evaluated, never trained, at "
        f"{', '.join(f'{f}x' for f in factors[1:])} its length, on the same task with its vocabulary and pairs "
        "(recall: more places after the bindings). Held-out token accuracy in %, mean over seeds, min-max in brackets.",
        "",
    ]
    for task, part in summary.groupby("task", sort=False):
        length = int(part["train_length"].iloc[0])
        header = ["variant", "encoding", *[f"{f}x (L={f * length})" for f in factors]]
        table = []
        order = {name: i for i, name in enumerate(ENCODING_STYLE)}
        groups = part.groupby(["variant", "positions"], sort=False)
        variants = list(dict.fromkeys(part["variant"]))  # variant by variant, each encoding in the docs' order
        for (variant, encoding), cells in sorted(
            groups, key=lambda g: (variants.index(g[0][0]), order.get(g[0][1], 9))
        ):
            by_factor = {int(c.factor): _cell(c) for c in cells.itertuples()}
            table.append([f"`{variant}`", encoding, *[by_factor.get(f, "") for f in factors]])
        lines += [f"### {task}, trained at L={length}", "", markdown_table(header, table), ""]
    lines += _learned_against_sinusoidal(summary)
    refused = cfg.get("refused") or []
    if refused:
        lines += ["Pairs not trained (the variant cannot carry the encoding):", ""]
        lines += [f"- `{v}` with {p}: {md_text(why)}" for v, p, why in refused] + [""]
    return lines + figure_links(run_dir, figures)


def positions_figure(run_dir: Path, rows: list[dict], out_dir: Path, fmt: str = "png") -> Path:
    """Accuracy against the evaluation length (in units of the training length), a panel per (task, variant), a line
    per encoding (mean over seeds, band min-max)."""
    summary = positions_summary(rows)
    panels = list(summary.groupby(["task", "variant"], sort=False))
    variants = list(dict.fromkeys(summary["variant"]))
    fig, axes = grid(len(panels), len(variants), (2.6, 2.3))
    for ax, ((task, variant), part) in zip(axes, panels):
        for encoding, line in part.groupby("positions", sort=False):
            color, style = ENCODING_STYLE.get(encoding, ("black", "-"))
            line = line.sort_values("factor")
            ax.plot(line["factor"], line["accuracy"], color=color, ls=style, marker="o", ms=3, lw=1.3, label=encoding)
            ax.fill_between(line["factor"], line["low"], line["high"], color=color, alpha=0.12, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(part["factor"].unique()), [f"{f}x" for f in sorted(part["factor"].unique())])
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task} · {variant}", fontsize=8)
    axes[0].legend(fontsize=6, loc="lower left")
    meta = read_metadata(run_dir)
    cfg = meta.get("config", {})
    fig.suptitle(
        "Held-out accuracy at the training length (1x) and beyond it, never trained there "
        f"(mean of {int(summary['seeds'].max())} seeds, band min-max)\n"
        f"d_model={cfg.get('d_model')}, layers={cfg.get('layers')}, steps={cfg.get('steps')}, options {cfg.get('options')}",
        fontsize=9,
    )
    return save_figure(fig, Path(out_dir) / f"quality_positions.{fmt}")
