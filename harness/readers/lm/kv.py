"""The KV sweep of an lm run (`bench lm --kv-policy`) read back: accuracy and continuation perplexity per
(policy, ratio, mode) with their 95% intervals, the kept cache's bytes, a decoded token's time against the
full cache, and the frontier figure (quality against KV bytes kept). Reading and drawing only."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.fmt import fmt_bytes, fmt_time
from harness.readers.lm.figures import plain_log_labels
from harness.readers.lm.frames import _accuracy
from harness.readers.plots import save_figure
from harness.readers.tables import markdown_table
from harness.stats import bootstrap_paired_difference, bootstrap_pooled_mean

FULL = "full cache"  # the sweep's baseline label (harness/lm/config.py's FULL_CACHE)
CONTINUATION = "kv:continuation"
BRANCH = ["policy", "ratio", "mode"]


def kv_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["task"].astype(str).str.startswith("kv:")] if "task" in df else df.iloc[:0]


def kv_accuracy_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (task, length, setting): exact-match accuracy over the prompts with Wilson's 95% interval, the policy,
    ratio and mode, the kept bytes (mean over prompts) and a decoded token's time (median over prompts)."""
    rows = kv_rows(df)
    rows = rows[rows["task"] != CONTINUATION]
    out = _accuracy(rows, ["task", "length", "setting", *BRANCH], "trials")
    if rows.empty:
        return out.assign(state_bytes=[], token_s=[])
    extra = rows.groupby(["task", "length", "setting"], sort=False).agg(
        state_bytes=("state_bytes", "mean"), token_s=("token_s", "median")
    )
    return out.join(extra, on=["task", "length", "setting"])


def kv_perplexity_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (length, setting): the continuation's perplexity over every scored token of the windows with its 95%
    bootstrap interval, and against the full cache on the same windows (`vs_full`, paired interval)."""
    rows = kv_rows(df)
    rows = rows[rows["task"] == CONTINUATION]
    columns = ["length", "setting", *BRANCH, "ppl", "low", "high", "vs_full", "vs_low", "vs_high", "windows"]
    out = []
    for (length, setting), group in rows.groupby(["length", "setting"], sort=False):
        full = rows[(rows["length"] == length) & (rows["setting"] == FULL)].set_index("window")
        group = group[group["window"].isin(full.index)].sort_values("window")
        sums, counts = list(group["nll"] * group["scored"]), [int(c) for c in group["scored"]]
        low, high = bootstrap_pooled_mean(sums, counts)
        base = list(full.loc[group["window"], "nll"] * full.loc[group["window"], "scored"])
        d_low, d_high = bootstrap_paired_difference(sums, base, counts)
        nll, gap = sum(sums) / sum(counts), (sum(sums) - sum(base)) / sum(counts)
        first = group.iloc[0]
        out.append([length, setting, first["policy"], first["ratio"], first["mode"], math.exp(nll)])
        out[-1] += [math.exp(low), math.exp(high), math.exp(gap), math.exp(d_low), math.exp(d_high), len(group)]
    return pd.DataFrame(out, columns=columns)


def decode_slope(table: pd.DataFrame) -> tuple[float, float, float] | None:
    """(token time of the full cache, fitted seconds per unit of kept fraction, its intercept) over every branch of
    an accuracy table at one length: a least-squares line of token time against 1 − ratio."""
    rows = table.dropna(subset=["token_s"])
    if rows.empty or rows["ratio"].nunique() < 2:
        return None
    x, y = 1 - rows["ratio"].astype(float), rows["token_s"].astype(float)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    full = rows[rows["setting"] == FULL]["token_s"]
    return (float(full.iloc[0]) if not full.empty else float("nan")), slope, float(y.mean() - slope * x.mean())


def _cell(value: float, low: float, high: float, percent: bool) -> str:
    if percent:
        return f"{value * 100:.0f} [{low * 100:.0f}–{high * 100:.0f}]"
    return f"{value:.2f} [{low:.2f}–{high:.2f}]"


def _grid(table: pd.DataFrame, value: str, low: str, high: str, percent: bool) -> str:
    """Rows: the full cache (ratio 0), then each policy and mode; columns: the ratios."""
    ratios = sorted(float(r) for r in table["ratio"].unique())
    body = []
    for (policy, mode), rows in table.groupby(["policy", "mode"], sort=False):
        by_ratio = {float(r["ratio"]): r for _, r in rows.iterrows()}
        name = f"`{FULL}`" if policy == "none" else f"`{policy}` {mode}"
        body.append(
            [name]
            + [
                _cell(by_ratio[r][value], by_ratio[r][low], by_ratio[r][high], percent) if r in by_ratio else ""
                for r in ratios
            ]
        )
    return markdown_table(["policy \\ ratio", *(f"{r:g}" for r in ratios)], body)


def kv_section(df: pd.DataFrame, figure: Path | None) -> list[str]:
    """The KV sweep's part of REPORT.md: accuracy and perplexity grids, cost, the frontier figure."""
    rows = kv_rows(df)
    if rows.empty:
        return []
    lines = [
        "## KV-cache policies",
        "",
        "Each prompt is prefilled once with exact attention; the full cache and every policy at every ratio "
        "(the fraction of the prompt's positions removed, per K/V head) are branches of that prefill. Query-aware: "
        "the question is compressed with the prompt; agnostic: the context alone, the question fed after it. "
        "Policies: variants/kvcache/; docs/lm.md says how each follows kvpress.",
        "",
    ]
    if figure is not None:
        lines += [f"![{figure.stem}](figures/{figure.name})", ""]
    accuracy = kv_accuracy_table(df)
    for (task, length), table in accuracy.groupby(["task", "length"], sort=False):
        trials = int(table["trials"].min())
        lines += [
            f"`{task[3:]}` at {int(length)} tokens: exact match (%) over {trials} prompts a cell, Wilson's 95% interval.",
            "",
            _grid(table, "accuracy", "low", "high", True),
            "",
        ]
    ppl = kv_perplexity_table(df)
    for length, table in ppl.groupby("length", sort=False):
        lines += [
            f"Continuation at {int(length)} tokens: perplexity of a window's last 256 tokens after its first "
            f"{int(length) - 256} were compressed, "
            f"{int(table['windows'].min())} windows, 95% bootstrap interval over windows.",
            "",
            _grid(table, "ppl", "low", "high", False),
            "",
            "Against the full cache on the same windows: perplexity / the full cache's, 95% paired bootstrap interval.",
            "",
            _grid(table[table["policy"] != "none"], "vs_full", "vs_low", "vs_high", False),
            "",
        ]
    for length, table in accuracy.groupby("length", sort=False):
        fit = decode_slope(table)
        kept = table.groupby("ratio", sort=True).agg(state=("state_bytes", "mean"), token=("token_s", "median"))
        lines += [
            f"Cost at {int(length)} tokens: the kept cache and a generated token's time (median over prompts and "
            "policies; every branch timed on the same machine in one run).",
            "",
            markdown_table(
                ["ratio", "KV kept", "token"],
                [[f"{r:g}", fmt_bytes(k.state), fmt_time(k.token)] for r, k in kept.iterrows()],
            ),
            "",
        ]
        if fit is not None:
            full, slope, intercept = fit
            lines += [
                f"Token time against the kept fraction k = 1 − ratio (least squares over {len(table)} cells): "
                f"{fmt_time(intercept)} + {fmt_time(slope)} × k; the full cache's {fmt_time(full)}.",
                "",
            ]
    return lines


def sweep_prompts(df: pd.DataFrame, length: int) -> set[tuple]:
    """The sweep's passkey prompts at `length`, as (depth, key index, key): what another run's prompts are
    compared with."""
    rows = kv_rows(df)
    rows = rows[(rows["task"] == "kv:passkey") & (rows["length"] == length) & (rows["policy"] == "none")]
    return set(zip(rows["depth"], rows["key_index"], rows["key"]))


def other_points(df: pd.DataFrame, length: int, run: str, prompts: set[tuple] = frozenset()) -> list[dict]:
    """Another lm run's attentions as points of the passkey panel at `length`: accuracy (Wilson), trials and the
    decoding state's bytes its passkey rows kept. The model's own `sdpa` rows are left out (the sweep's full
    cache is that attention). The label says "the same prompts" when a setting's prompts are exactly `prompts`
    (sweep_prompts), otherwise "its own prompts" and their count: on the same axes, never pooled."""
    rows = df[(df["task"] == "passkey") & (df["length"] == length)] if "task" in df else df.iloc[:0]
    rows = rows[rows["variant"] != "sdpa"]
    table = _accuracy(rows, ["setting"], "trials")
    state = rows.groupby("setting")["state_bytes"].mean()
    asked = {s: set(zip(g["depth"], g["key_index"], g["key"])) for s, g in rows.groupby("setting")}
    points = []
    for r in table.itertuples():
        shared = bool(prompts) and asked[r.setting] == set(prompts)
        whose = "the same prompts" if shared else f"its own prompts, {int(r.trials)} trials"
        label = f"{r.setting} ({run}: {whose})"
        points.append(
            {"label": label, "setting": r.setting, "shared": shared, "bytes": float(state[r.setting])}
            | {"value": r.accuracy, "low": r.low, "high": r.high}
        )
    return points


def draw_kv_frontier(df: pd.DataFrame, path: Path, others: list[dict] = ()) -> Path | None:
    """Quality against the KV bytes kept at the sweep's longest length, a panel per (task, mode): every policy at
    every ratio (dodged sideways a little around its ratio's bytes, so the policies do not hide each other), the
    full cache a star, 95% intervals as bars; `others` (other_points) as hollow diamonds on the passkey panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = kv_rows(df)
    if rows.empty:
        return None
    length = int(rows["length"].max())
    accuracy = kv_accuracy_table(df)
    accuracy = accuracy[accuracy["length"] == length]
    ppl = kv_perplexity_table(df)
    ppl = ppl[ppl["length"] == length].join(_bytes(rows, length), on="setting")
    panels = []
    for (task, mode), table in accuracy[accuracy["policy"] != "none"].groupby(["task", "mode"], sort=False):
        panels.append(
            (task, mode, pd.concat([accuracy[(accuracy["task"] == task) & (accuracy["policy"] == "none")], table]))
        )
    if not ppl.empty:
        panels.append((CONTINUATION, "agnostic", ppl))
    across = min(len(panels), 3)
    down = -(-len(panels) // across)
    fig, axes = plt.subplots(down, across, figsize=(5.0 * across, 4.0 * down), squeeze=False)
    policies = sorted(p for p in rows["policy"].unique() if p != "none")
    colour = {p: f"C{i}" for i, p in enumerate(policies)}
    dodge = {p: math.exp(0.045 * (i - (len(policies) - 1) / 2)) for i, p in enumerate(policies)}
    for ax, (task, mode, table) in zip(axes.flat, panels):
        value = "ppl" if task == CONTINUATION else "accuracy"
        scale = 1 if task == CONTINUATION else 100
        for policy, group in table.groupby("policy", sort=False):
            group = group.sort_values("state_bytes")
            x = group["state_bytes"] / 2**20 * (1 if policy == "none" else dodge[policy])
            y = group[value] * scale
            err = [(group[value] - group["low"]) * scale, (group["high"] - group[value]) * scale]
            if policy == "none":
                ax.errorbar(x, y, yerr=err, fmt="*", ms=13, color="black", capsize=2, label=FULL, zorder=5)
            else:
                ax.errorbar(x, y, yerr=err, color=colour[policy], marker="o", ms=4, lw=1, capsize=2, label=policy)
        if task == "kv:passkey":
            for i, point in enumerate(others):
                err = [[(point["value"] - point["low"]) * 100], [(point["high"] - point["value"]) * 100]]
                x, y, shade = point["bytes"] / 2**20, point["value"] * 100, plt.cm.tab20b(i % 20)
                ax.errorbar([x], [y], yerr=err, fmt="D", mfc="none", color=shade, capsize=2, label=point["label"])
        ax.set_xscale("log")
        plain_log_labels(ax.xaxis)
        ax.set_xlabel("KV cache kept (MiB, log)")
        ax.set_ylabel("perplexity of the last 256 tokens" if task == CONTINUATION else "exact match (%)")
        ax.set_title(f"{task[3:]}{'' if task == CONTINUATION else ' ' + mode}, {length} tokens", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    title = "◇: other runs' attentions (passkey)" if others else None
    fig.legend(handles, labels, fontsize=8, title=title, title_fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return save_figure(fig, path)


def _bytes(rows: pd.DataFrame, length: int) -> pd.Series:
    mine = rows[(rows["task"] == CONTINUATION) & (rows["length"] == length)]
    return mine.groupby("setting")["state_bytes"].mean()
