"""A `bench lm` run's figures (matplotlib): perplexity, passkey, cost, decoding and training curves against
context length, one colour a method."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.readers.plots import save_figure
from harness.readers.lm.frames import (
    DISTILLED,
    LEGEND_INSIDE,
    LINEARIZED,
    LORA,
    OWN,
    PANELS_ACROSS,
    base_of,
    cost_table,
    decode_table,
    passkey_table,
    perplexity_table,
    position_table,
)


def draw_lm(run_dir: Path, df: pd.DataFrame, settings: list[str]) -> list[Path]:
    """figures/lm_perplexity.png, lm_position.png, lm_passkey.png, lm_decode.png, lm_linearize.png, lm_cost.png (those the run has
    rows for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(run_dir) / "figures"
    folder.mkdir(exist_ok=True)
    out = []
    ppl = perplexity_table(df)
    if not ppl.empty:
        style = setting_styles(settings)
        many = len(settings) > LEGEND_INSIDE
        fig, ax = plt.subplots(figsize=(10, 5.5) if many else (7, 4.5))
        for s in settings:
            mine = ppl[ppl["setting"] == s].sort_values("length")
            if mine.empty:
                continue
            ax.errorbar(
                mine["length"],
                mine["ppl"],
                yerr=[mine["ppl"] - mine["ppl_low"], mine["ppl_high"] - mine["ppl"]],
                capsize=3,
                label=s,
                **style[s],
            )
        trained = ("; dotted: after attention transfer" if any(DISTILLED in s for s in settings) else "") + (
            "; dash-dot: linearized" if any(LINEARIZED in s or LORA in s for s in settings) else ""
        )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="context length (tokens)",
            ylabel="perplexity of the scored tokens (95% interval)",
            title=f"perplexity against context (zero-shot{trained})",
        )
        _legend(ax, many, 8)
        ax.grid(True, which="both", alpha=0.3)
        _length_axis(ax, ppl["length"])
        plain_log_labels(ax.yaxis)
        out.append(_save(fig, folder / "lm_perplexity.png"))
    positions = position_table(df)
    if not positions.empty:
        out.append(_draw_positions(positions, setting_styles(settings), settings, folder / "lm_position.png"))
    keys = passkey_table(df)
    if not keys.empty:
        shown = [s for s in settings if s in set(keys["setting"])]
        across = min(len(shown), PANELS_ACROSS)
        down = -(-len(shown) // across)
        fig, axes = plt.subplots(down, across, figsize=(3.2 * across, 3.2 * down), squeeze=False)
        lengths, depths = sorted(keys["length"].unique()), sorted(keys["depth"].unique())
        for ax in axes.flat[len(shown) :]:
            ax.set_visible(False)
        for ax, s in zip(axes.flat, shown):
            grid = (
                keys[keys["setting"] == s]
                .pivot(index="length", columns="depth", values="accuracy")
                .reindex(index=lengths, columns=depths)
            )
            ax.imshow(grid.values.astype(float), vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
            ax.set_xticks(range(len(depths)), [f"{int(d)}%" for d in depths], fontsize=7)
            ax.set_yticks(range(len(lengths)), [str(int(n)) for n in lengths], fontsize=7)
            for i in range(len(lengths)):
                for j in range(len(depths)):
                    value = grid.values[i, j]
                    if value == value:
                        ax.text(
                            j,
                            i,
                            f"{value:.0%}",
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white" if value < 0.6 else "black",
                        )
            ax.set(title=s, xlabel="depth of the key")
            if len(s) > 24:
                ax.title.set_fontsize(8)
        for row in axes:
            row[0].set_ylabel("context length")
        fig.suptitle("passkey retrieval (exact match)")
        out.append(_save(fig, folder / "lm_passkey.png"))
    decode = decode_table(df)
    if not decode.empty:
        out.append(draw_decode(decode, setting_styles(settings), settings, folder / "lm_decode.png"))
    curves = df[df["task"] == "linearize"] if "task" in df else df.iloc[:0]
    if not curves.empty:
        out.append(_draw_training(curves, setting_styles(settings), folder / "lm_linearize.png"))
    cost = cost_table(df)
    if not cost.empty:
        panels = [
            (c, label)
            for c, label in (
                ("forward_s", "forward time (s)"),
                ("token_s", "time a generated token (s)"),
                ("state_bytes", "decoding state (bytes)"),
            )
            if c in cost
        ]
        style, many = setting_styles(settings), len(settings) > LEGEND_INSIDE
        fig, axes = plt.subplots(
            1, len(panels), figsize=(4.2 * len(panels) + (3 if many else 0), 3.6 + (1.5 if many else 0)), squeeze=False
        )
        for ax, (column, label) in zip(axes[0], panels):
            for s in settings:
                mine = cost[(cost["setting"] == s)].dropna(subset=[column]).sort_values("length")
                if not mine.empty:
                    ax.plot(mine["length"], mine[column], label=s, **style[s])
            ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel=label)
            ax.grid(True, which="both", alpha=0.3)
        _legend(axes[0][-1] if many else axes[0][0], many, 7)
        fig.suptitle("cost in the model")
        out.append(_save(fig, folder / "lm_cost.png"))
    return out


def draw_decode(table: pd.DataFrame, style: dict, settings: list[str], path: Path) -> Path:
    """A generated token's time and the decoding state's bytes against the context, each attention a line."""
    import matplotlib.pyplot as plt

    many = len(settings) > LEGEND_INSIDE
    fig, axes = plt.subplots(1, 2, figsize=(11 + (3 if many else 0), 4.2))
    for s in settings:
        mine = table[table["setting"] == s].sort_values("length")
        if mine.empty:
            continue
        axes[0].plot(mine["length"], mine["token_s"] * 1e3, label=s, **style[s])
        axes[1].plot(mine["length"], mine["state_bytes"] / 2**20, label=s, **style[s])
    axes[0].set(
        xscale="log",
        xlabel="context length (tokens)",
        ylabel="time a generated token (ms)",
        title="decoding: one token after the context",
    )
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="context length (tokens)",
        ylabel="cache after the prompt (MiB)",
        title="decoding state",
    )
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        _length_axis(ax, table["length"])
    axes[0].set_ylim(bottom=0)  # a linear time axis from 0: the ratios between the lines read as drawn
    _legend(axes[1] if many else axes[0], many, 7)
    return _save(fig, path)


def _draw_positions(table: pd.DataFrame, style: dict, settings: list[str], path: Path) -> Path:
    """Mean NLL against the token's position (log-spaced buckets) at the run's longest length, each attention a
    line: where in a long context an attention stops predicting as the model does."""
    import matplotlib.pyplot as plt

    longest = int(table["length"].max())
    many = len(settings) > LEGEND_INSIDE
    fig, ax = plt.subplots(figsize=(10, 5.5) if many else (7, 4.5))
    for s in settings:
        mine = table[(table["setting"] == s) & (table["length"] == longest)].sort_values("lo")
        if not mine.empty:
            ax.plot((mine["lo"] * mine["hi"]) ** 0.5, mine["nll"], label=s, **style[s])
    ticks = [4**i for i in range(1 + int(math.log(longest, 4)))]  # plain numbers: 1, 4, 16, ... not 10^2
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set(
        xscale="log",
        xlabel="position of the token in its window (log-spaced buckets)",
        ylabel="mean negative log-likelihood (nats)",
        title=f"loss by position in windows of {longest} tokens",
    )
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, many, 8)
    return _save(fig, path)


def plain_log_labels(axis) -> None:
    """A log axis labelled 8, 9, 10, 20 rather than 8×10⁰: the same ticks matplotlib would label, plain numbers."""
    from matplotlib.ticker import LogFormatter

    axis.set_major_formatter(LogFormatter())
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def _length_axis(ax, lengths) -> None:
    """A log x axis labelled with the measured context lengths in plain numbers (512, 1024, … not 10^3.3)."""
    from matplotlib.ticker import NullFormatter

    shown = sorted(int(n) for n in set(lengths))
    ax.set_xticks(shown, [str(n) for n in shown])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _draw_training(rows: pd.DataFrame, style: dict, path: Path) -> Path:
    """Each linearization's loss step by step: stage 1's attention error (MSE), stage 2's next-token loss."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows.itertuples():
        for ax, stage in zip(axes, ("transfer", "lora")):
            data = getattr(r, stage, None)
            if isinstance(data, dict) and data.get("losses"):
                ax.plot(
                    range(1, len(data["losses"]) + 1),
                    data["losses"],
                    label=base_of(r.setting),
                    color=style[r.setting]["color"],
                    linewidth=1,
                )
    axes[0].set(
        yscale="log", xlabel="step", ylabel="MSE against the softmax output", title="stage 1: attention transfer"
    )
    axes[1].set(xlabel="step", ylabel="next-token loss (nats)", title="stage 2: LoRA")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return _save(fig, path)


def setting_styles(settings: list[str]) -> dict[str, dict]:
    """A line style per attention: the model's own dashed; a distilled twin dotted, a linearized one dash-dot, in
    its zero-shot one's colour."""
    bases = list(dict.fromkeys(base_of(s) for s in settings))
    palette = (
        [f"C{i}" for i in range(10)]
        if len(bases) <= 10
        else [f"tab20:{i}" for i in (*range(0, 20, 2), *range(1, 20, 2))]
    )
    colour = {b: palette[i % len(palette)] for i, b in enumerate(bases)}

    def line(s):
        if DISTILLED in s:
            return ":", "s"
        if LINEARIZED in s or LORA in s:
            return "-.", "^"
        return ("--" if s == OWN else "-"), "o"

    return {s: {"color": _colour(colour[base_of(s)]), "linestyle": line(s)[0], "marker": line(s)[1]} for s in settings}


def _colour(name: str):
    if name.startswith("tab20:"):
        import matplotlib

        return matplotlib.colormaps["tab20"](int(name.split(":")[1]))
    return name


def _legend(ax, outside: bool, size: int) -> None:
    if outside:
        ax.legend(fontsize=size, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize=size)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    return save_figure(fig, path)
