"""REPORT.md of a run, and the comparison of two runs. Both read run directories only."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import pandas as pd

from harness.fmt import fmt_bytes, fmt_time
from harness.quality.config import TOKENS_PER_L, recall_layout
from harness.readers.advise import advise, advise_table, log_interp, recommendation, speed_rows, split_runs
from harness.readers.frames import load_frame
from harness.readers.lm_report import write_lm_report
from harness.readers.plots import plot_quality, plot_run, tradeoff_figure
from harness.readers.quality_frames import (
    accuracy_summary,
    accuracy_within,
    by_distance_frame,
    cost_frame,
    quality_rows,
    state_frame,
)
from harness.readers.summary import NOISE_NOTE, PANEL, crossover_text, noisy_mask, summarize
from harness.readers.tables import code_span, markdown_table
from harness.store.storage import read_metadata, read_rows, variant_facts
from harness.sweep.config import BASELINE

KEY = ["device", "variant", "pass", "causal", "n", "batch", "heads", "head_dim", "dtype"]


def _cell_text(row: pd.Series) -> str:
    if row["status"] != "ok":
        return row["status"]
    return f"{fmt_time(row['time_median_s'])} / {fmt_bytes(row['peak_bytes'])}"


def panel_tables(df: pd.DataFrame) -> list[tuple[tuple, str]]:
    """Per (device, pass, causal): a variant x N table of 'time / memory' or the status."""
    out = []
    for panel, sub in df.groupby(PANEL, sort=False):
        ns = sorted(sub["n"].unique())
        rows = []
        for variant, group in sub.groupby("variant", sort=False):
            by_n = {int(r["n"]): _cell_text(r) for _, r in group.iterrows()}
            rows.append([f"`{variant}`"] + [by_n.get(int(n), "") for n in ns])
        out.append((panel, markdown_table(["variant"] + [f"N={int(n)}" for n in ns], rows)))
    return out


def _summary_table(summary: pd.DataFrame) -> str:
    rows = []
    for line in summary.to_dict("records"):

        def num(value, fmt):
            return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt(value)

        rows.append(
            [
                line["device"],
                line["pass"],
                "yes" if line["causal"] else "no",
                f"`{line['variant']}`",
                num(line["max_n"], lambda n: str(int(n))),
                num(line["time_s"], fmt_time),
                num(line["peak_bytes"], fmt_bytes),
                num(line["time_exp"], lambda e: f"{e:.2f}"),
                num(line["mem_exp"], lambda e: f"{e:.2f}"),
                "(baseline)" if line["variant"] == BASELINE else crossover_text(line),
            ]
        )
    return markdown_table(
        [
            "device",
            "pass",
            "causal",
            "variant",
            "largest N",
            "time",
            "peak memory",
            "time ~ N^",
            "memory ~ N^",
            "beats full from N",
        ],
        rows,
    )


def make_report(run_dir: Path) -> tuple[Path, list[Path]]:
    """Draw the run's figures and write REPORT.md (what `bench report` does and `bench run` does at its end).
    Returns (REPORT.md, figures); ValueError when the run has no row yet."""
    if read_metadata(run_dir).get("kind") == "lm":
        return write_lm_report(run_dir)
    figures = plot_run(run_dir) if read_rows(run_dir, quiet=True) else []
    quality_figures = plot_quality(run_dir)
    if not figures and not quality_figures:
        raise ValueError(f"{run_dir} has no results yet")
    return write_report(run_dir, figures, quality_figures), [*figures, *quality_figures]


def write_report(run_dir: Path, figures: list[Path], quality_figures: list[Path] = ()) -> Path:
    """RUN_DIR/REPORT.md: command and environment, then the speed part (figures, tables, exponents,
    crossovers, cells that did not run) and the quality part, for whichever the run holds."""
    run_dir = Path(run_dir)
    meta = read_metadata(run_dir)
    env, cfg, machine = meta.get("environment", {}), meta.get("config", {}), meta.get("machine", {}) or {}
    cpu, git = env.get("cpu", {}), env.get("git", {})
    lines = [
        f"# attnbench report: {run_dir.name}",
        "",
        f"Command: {code_span(env.get('command', '?'))}",
        "",
        f"- Machine: {md_text(cpu.get('model'))}, {cpu.get('usable_cores')} usable cores, {fmt_bytes(cpu.get('memory_bytes'))} RAM"
        + (
            f"; GPU {md_text(machine['gpu'].get('name'))} (driver {md_text(machine['gpu'].get('driver'))})"
            if (machine.get("gpu") or {}).get("name")
            else ""
        ),
        f"- Software: Python {env.get('python')}, torch {env.get('versions', {}).get('torch')}, "
        f"xformers {env.get('versions', {}).get('xformers') or 'not installed'}, attnbench {env.get('versions', {}).get('attnbench')} "
        f"(git {md_text(str(git.get('commit'))[:10])}{' + local changes' if git.get('dirty') else ''})",
        f"- Started {md_text(env.get('started'))}.",
        "",
        "Regenerate this report and its figures with `bench report " + str(run_dir) + "`.",
        "",
    ]
    df = load_frame(run_dir)
    if machine.get("nodes"):
        lines += _nodes_section(machine["nodes"], df)
    if not df.empty:
        lines += _speed_section(run_dir, df, cfg, machine, figures)
    quality = _quality_section(run_dir, cfg, quality_figures)
    lines += quality
    path = run_dir / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def _nodes_section(nodes: list[dict], df: pd.DataFrame) -> list[str]:
    """A run on a cluster (--executor ray): every node of it, and how many cells each ran."""
    ran = Counter(node.get("node_id") for node in df.get("node", []) if isinstance(node, dict))  # (NaN: not run)
    rows = [
        [
            md_text(n.get("host")),
            code_span(str(n.get("node_id"))[:8]),
            md_text(n.get("ip")),
            str(n.get("cpus")),
            md_text(n.get("cpu_model")),
            f"{n.get('gpus')} x {md_text(n.get('gpu_name'))}" if n.get("gpus") else "-",
            md_text(f"torch {n.get('torch')}" + (f", CUDA {n.get('cuda')}" if n.get("cuda") else "")),
            str(ran.get(n.get("node_id"), 0)),
        ]
        for n in nodes
    ]
    return [
        "## Nodes (Ray cluster)",
        "",
        markdown_table(["host", "node", "address", "CPUs", "CPU", "GPUs", "software", "cells run"], rows),
        "",
    ]


def md_text(value) -> str:
    """Text taken from a run's files, made inert in Markdown: one line, markup characters escaped."""
    text = " ".join(str(value).split())
    return re.sub(r"([\\`*_{}\[\]<>()#+!|~-])", r"\\\1", text)


def _figure_links(run_dir: Path, figures) -> list[str]:
    lines = []
    for fig in figures:
        fig = Path(fig).resolve()
        rel = fig.relative_to(run_dir.resolve()) if fig.is_relative_to(run_dir.resolve()) else fig
        lines += [f"![{fig.stem}]({rel.as_posix()})", ""]
    return lines


def _softmax_error_section(df: pd.DataFrame) -> list[str]:
    """Each variant's relative error against exact softmax attention on the check's inputs (rows made
    before runs recorded it have none: no section)."""
    if "softmax_error" not in df or df["softmax_error"].isna().all():
        return []
    known = df[df["softmax_error"].notna()]
    errors = known.groupby(["device", "variant", "causal"])["softmax_error"].first()
    modes = sorted(known["causal"].unique())
    body = [
        [
            f"`{variant}` ({device})",
            *(f"{errors[(device, variant, mode)]:.2e}" if (device, variant, mode) in errors else "—" for mode in modes),
        ]
        for device, variant in dict.fromkeys(zip(known["device"], known["variant"]))
    ]
    return [
        "## Error against exact softmax",
        "",
        "‖out − exact‖ / ‖exact‖ of each variant's output against exact softmax attention (float64, the variant's "
        "scale or D^-½) on the correctness check's inputs (standard normal, N = the check length): what an "
        "approximation loses before any training, not what a trained model loses.",
        "",
        markdown_table(["variant", *("causal" if mode else "non-causal" for mode in modes)], body),
        "",
    ]


def _decode_section(df: pd.DataFrame, machine: dict) -> list[str]:
    """Decode cells: the state each step reads (bytes, kind) and the bandwidth of reading it once per step,
    against the machine's measured copy bandwidth."""
    ok = df[(df["pass"] == "decode") & (df["status"] == "ok")] if "state_bytes" in df else df.iloc[0:0]
    if ok.empty:
        return []
    limits = machine.get("memory_bandwidth_gbs") or {}
    lines = [
        "## Decoding: the state a step reads",
        "",
        "State: the bytes of the decoding state after N positions (a KV cache grows with N; a window keeps at most "
        "g + w positions; a recurrent state is fixed). Bandwidth: the bytes a step reads of it (all, or what the "
        "method says it reads: moba its block sums and chosen blocks) / step time, as a share of the measured "
        "copy bandwidth (" + (", ".join(f"{d}: {v:.1f} GB/s" for d, v in limits.items() if v) or "not measured") + ").",
        "",
    ]
    for device, group in ok.groupby("device", sort=False):
        ns = sorted(int(n) for n in group["n"].unique())
        rows = []
        for variant, mine in group.groupby("variant", sort=False):
            by_n = {int(r["n"]): r for r in mine.to_dict("records")}
            cells = []
            for n in ns:
                r = by_n.get(n)
                if r is None:
                    cells.append("—")
                    continue
                share = (
                    f" ({r['bandwidth_gbs'] / limits[device]:.0%})"
                    if limits.get(device) and r.get("bandwidth_gbs")
                    else ""
                )
                cells.append(f"{fmt_bytes(r['state_bytes'])}, {r['bandwidth_gbs']:.2f} GB/s{share}")
            rows.append([f"`{variant}`", mine["state_kind"].iloc[0], *cells])
        lines += [
            f"### {device}: state bytes, bandwidth (share of measured)",
            "",
            markdown_table(["variant", "state", *(f"N={n}" for n in ns)], rows),
            "",
        ]
    return lines


def _speed_section(run_dir: Path, df: pd.DataFrame, cfg: dict, machine: dict, figures) -> list[str]:
    df["causal"] = df["causal"].astype(bool)
    peaks = ", ".join(f"{k}: {v:.0f} GFLOP/s" for k, v in (machine.get("matmul_peak_gflops") or {}).items() if v)
    lines = [
        f"- Shape: B={cfg.get('batch')}, H={cfg.get('heads')}"
        + (f" on {cfg['kv_heads']} K/V heads" if cfg.get("kv_heads") else "")
        + f", D={cfg.get('head_dim')}, {cfg.get('dtype')}; "
        f"options {cfg.get('options') or 'defaults'}; memory budget per cell "
        + ", ".join(f"{d}: {fmt_bytes(b)}" for d, b in (cfg.get("memory_budget") or {}).items()),
        f"- Measured matmul peak: {peaks or 'not measured'}",
        "- Peak extra memory: on CPU the process's resident-set high-water mark above its state before the call; "
        "on CUDA the caching allocator's peak of allocated bytes above the same (reserved bytes are in `reserved_bytes`).",
        f"- {len(df)} cells, {int((df['status'] == 'ok').sum())} ok.",
        "",
        "## Figures",
        "",
        *_figure_links(run_dir, figures),
        "## Summary",
        "",
        "Exponents: least-squares slope of log(time) and log(memory) on log(N) over the upper half of the lengths that ran.",
        "",
        _summary_table(summarize(df)),
        "",
        *_softmax_error_section(df),
        "## Every cell (median time / peak extra memory, or status)",
        "",
    ]
    for (device, pass_, causal), table in panel_tables(df):
        lines += [f"### {device}, {pass_}, {'causal' if causal else 'non-causal'}", "", table, ""]
    lines += _decode_section(df, machine)
    noisy = df[(df["status"] == "ok") & noisy_mask(df)]
    if not noisy.empty:
        lines += ["## Noisy cells", "", f"{len(noisy)} {NOISE_NOTE}:", ""]
        lines += [
            f"- `{r['variant']}` {r['device']} {r['pass']}{' causal' if r['causal'] else ''} N={int(r['n'])}: {md_text(r['noise'])}"
            for r in noisy.to_dict("records")
        ]
        lines.append("")
    missing = df[df["status"] != "ok"]
    lines += ["## Cells that did not run, and why", ""]
    if missing.empty:
        return lines + ["Every cell ran.", ""]
    grouped = missing.groupby(["device", "variant", "pass", "causal", "status", "message"], sort=False)["n"].apply(
        lambda s: ", ".join(str(int(n)) for n in sorted(s))
    )
    for (device, variant, pass_, causal, status, message), ns in grouped.items():
        lines.append(f"- `{variant}` {device} {pass_}{' causal' if causal else ''}, N = {ns}: **{status}** — {message}")
    return lines + [""]


def final_accuracy_grid(rows: list[dict]) -> tuple[list[tuple[str, int]], list[tuple[str, list[dict | None]]]]:
    """The finished trainings as a grid: columns (task, length), and per variant its accuracy summary
    per column (`quality_frames.accuracy_summary`: mean, min, max over seeds) or None."""
    summary = accuracy_summary(rows)
    columns = list(dict.fromkeys(zip(summary["task"], summary["length"].astype(int))))
    by = {(r["variant"], r["task"], int(r["length"])): r for r in summary.to_dict("records")}
    return columns, [
        (variant, [by.get((variant, t, n)) for t, n in columns]) for variant in dict.fromkeys(summary["variant"])
    ]


def accuracy_text(cell: dict, task: str, planned: int = 1) -> str:
    """'99.5%', with the seeds' range when there are several, '(1 of 3 seeds)' when fewer than the run
    planned have finished, and (copy) the share of exact strings."""
    text = f"{cell['accuracy']:.1%}"
    if cell["seeds"] > 1:
        text += f" ({cell['accuracy_min']:.0%}-{cell['accuracy_max']:.0%})"
    if cell["seeds"] < planned:
        text += f" ({cell['seeds']} of {planned} seeds)"
    if task == "copy":
        text += f", {cell['exact_match']:.0%} exact"
    return text


def quality_table(columns: list[tuple[str, int]], grid: list[tuple[str, list[dict | None]]], planned: int = 1) -> str:
    """Final held-out accuracy per variant (rows) and task/length (columns) of `final_accuracy_grid`: mean over
    seeds (min-max), marked where fewer seeds than `planned` finished."""
    body = [
        [f"`{variant}`"] + ["" if c is None else accuracy_text(c, t, planned) for c, (t, _) in zip(cells, columns)]
        for variant, cells in grid
    ]
    return markdown_table(["variant"] + [f"{t} L={n}" for t, n in columns], body)


def distance_table(distance: pd.DataFrame, task: str, length: int) -> str:
    """Accuracy by distance bucket (columns) per variant (rows) at one (task, L), pooled over seeds
    (`distance`: `quality_frames.by_distance_frame`)."""
    df = distance[(distance["task"] == task) & (distance["length"] == length)]
    buckets = list(dict.fromkeys(zip(df["min"], df["max"])))
    buckets.sort()
    body = []
    for variant, group in df.groupby("variant", sort=False):
        at = {(r["min"], r["max"]): r for r in group.to_dict("records")}
        body.append([f"`{variant}`"] + [f"{at[b]['accuracy']:.0%}" if b in at else "" for b in buckets])
    counts = df.groupby(["min", "max"])["count"].max()
    header = ["variant"] + [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in buckets]
    body.append(["scored (per variant)"] + [str(int(counts[b])) for b in buckets])
    return markdown_table(header, body)


def _window_verdicts(distance: pd.DataFrame, task: str, length: int, cfg: dict) -> list[str]:
    """Per windowed variant: accuracy on the distance buckets inside its window, and on those from 2w on
    (beyond what the stacked windows can reach), against chance (recall: 1 / the number of values)."""
    df = distance[(distance["task"] == task) & (distance["length"] == length) & distance["window"].notna()]
    lines = []
    for variant, group in df.groupby("variant", sort=False):
        w = int(group["window"].iloc[0])
        near, n_near = accuracy_within(group, 1, w)
        far, n_far = accuracy_within(group, 2 * w, None)
        if not (n_near or n_far):
            continue
        far_edges = group[group["min"] >= 2 * w]
        text = (
            f"`{variant}` (w={w}) at L={length}: {near:.1%} on distances 1-{int(group[group['max'] <= w]['max'].max())} "
            f"({n_near} scored)"
            if n_near
            else f"`{variant}` (w={w}) at L={length}: no scored distance within w"
        )
        if n_far:
            text += (
                f", {far:.1%} on distances {int(far_edges['min'].min())}-{int(far_edges['max'].max())} ({n_far} scored)"
            )
        if task == "recall":
            values = (cfg.get("vocab") or max(64, 2 * (cfg.get("pairs") or length // 8))) // 2
            text += f"; chance is {1 / values:.1%} (1 of {values} values)"
        lines += [text + ".", ""]
    return lines


def cost_table(costs: pd.DataFrame) -> str:
    """Training-step cost per (task, L) and variant: time, tokens/s, peak memory."""
    body = []
    for r in costs.to_dict("records"):
        if r.get("status") != "ok":
            body.append(
                [r["task"], str(r["length"]), f"`{r['variant']}`", "", "", "", md_text(r.get("error", r.get("status")))]
            )
            continue
        body.append(
            [
                r["task"],
                str(r["length"]),
                f"`{r['variant']}`",
                str(r["seq_len"]),
                fmt_time(r["step_ms"] / 1e3),
                f"{r['tokens_per_s']:,.0f}",
                fmt_bytes(r["train_peak_bytes"]),
            ]
        )
    return markdown_table(["task", "L", "variant", "tokens/seq", "step", "tokens/s", "peak memory"], body)


def batch_cap(rows: list[dict], cfg: dict) -> str:
    """' (at most T tokens a batch: 16 at 512 tokens, 8 at 1024)' where --batch-tokens shrank a stage's batch, read from the rows."""
    if not cfg.get("batch_tokens"):
        return ""
    smaller = sorted(
        {(int(r["seq_len"]), int(r["batch"])) for r in rows if r.get("batch") and int(r["batch"]) < cfg["batch"]}
    )
    where = ", ".join(f"{b} at {n} tokens" for n, b in smaller)
    return f" (at most {cfg['batch_tokens']} tokens a batch{': ' + where if where else ''})"


def _filler(cfg: dict) -> str:
    """' among filler', or ', no filler' where the queries fill every place after the bindings at each recall length."""
    lengths = [*(cfg.get("lengths") or ()), *(cfg.get("long_lengths") or ())]
    places = [recall_layout(n, cfg.get("pairs"))[1] for n in lengths]
    return ", no filler" if places and all(p <= cfg["queries"] for p in places) else " among filler"


def _quality_section(run_dir: Path, cfg: dict, figures) -> list[str]:
    rows = quality_rows(run_dir)
    if not rows:
        return []
    total = sum(r["wall_s"] for r in rows if r.get("final"))
    seeds = cfg.get("seeds", 1)
    columns, grid = final_accuracy_grid(rows)
    task_text = []
    if cfg.get("pairs") or cfg.get("queries"):
        task_text.append(
            f"recall: {cfg.get('pairs') or 'L/8'} pairs"
            + (f", {cfg['queries']} distinct keys asked once each{_filler(cfg)}" if cfg.get("queries") else "")
        )
    if cfg.get("vocab"):
        task_text.append(f"vocabulary {cfg['vocab']}")
    recipe = (
        f"d_model={cfg.get('d_model')}, layers={cfg.get('layers')}, heads={cfg.get('heads')}, "
        f"steps={cfg.get('steps')}{' per length, each length starting from the model of the one before (curriculum)' if cfg.get('curriculum') else ''}, "
        + (
            f"recall first {cfg['warm_start']} steps on the dense layout at the first length, "
            if cfg.get("warm_start")
            else ""
        )
        + (
            f"a causal depthwise convolution of width {cfg['short_conv']} before each block's attention, "
            if cfg.get("short_conv")
            else ""
        )
        + f"batch={cfg.get('batch')}{batch_cap(rows, cfg)}, lr={cfg.get('lr')} (AdamW, warm-up then cosine), "
        + (f"seeds 0-{seeds - 1}" if seeds > 1 else f"seed {cfg.get('seed', 0)}")
        + f"; device {cfg.get('device', 'cpu')}, {cfg.get('dtype', 'float32')}; variant options {cfg.get('options')}"
        + (f"; {'; '.join(task_text)}" if task_text else "")
        + (
            f"; L = {', '.join(str(n) for n in cfg['long_lengths'])} trained by "
            f"{', '.join(f'`{v}`' for v in cfg.get('long_variants') or ())} only, after the other lengths"
            if cfg.get("long_lengths")
            else ""
        )
    )
    lines = [
        "## Quality: copy and associative recall",
        "",
        f"Preset {cfg.get('preset', 'quick')}. Same model and recipe for every variant: {recipe}. Held-out token accuracy after "
        f"the last step{' (mean over seeds, min-max in brackets)' if seeds > 1 else ''}; copy: and the share of strings "
        f"reproduced exactly. Training took {total / 60:.1f} min in all (the sum of every length's training and evaluations over seeds; warm starts and cost measurements not counted).",
        "",
        quality_table(columns, grid, seeds),
        "",
    ]
    untrained = [name for name in cfg.get("variants") or () if name not in {variant for variant, _ in grid}]
    fewer_seeds = any(c is not None and c["seeds"] < seeds for _, cells in grid for c in cells)
    if untrained or fewer_seeds:
        lines += [
            "The run is unfinished (`bench quality --resume RUN_DIR` trains the rest): "
            + (
                f"a cell over fewer seeds than its {seeds} says so, and lengths with no finished training are not in "
                "the table yet"
                if fewer_seeds
                else "lengths with no finished training are not in the table yet"
            )
            + (f"; variants not trained yet: {', '.join(f'`{name}`' for name in untrained)}." if untrained else "."),
            "",
        ]
    final = [r for r in rows if r.get("final") and r.get("by_distance")]
    if final:
        distance = by_distance_frame(rows, variant_facts(run_dir))
        lines += [
            "### Accuracy by distance",
            "",
            "Distance: how many positions back the answer sits from the scored position (recall: the binding's value, "
            "or an earlier answer to the same key; copy: L for every symbol). A window w sees distances up to w in one "
            "layer, and up to layers x w through the stack.",
            "",
        ]
        for task in dict.fromkeys(r["task"] for r in final):
            longest = max(int(r["length"]) for r in final if r["task"] == task)
            if task == "copy":
                continue  # one distance per L: the accuracy table is the by-distance table
            lines += [f"{task}, L={longest}:", "", distance_table(distance, task, longest), ""]
            lines += _window_verdicts(distance, task, longest, cfg)
    states = state_frame(rows)
    if not states.empty:
        lines += [
            "### Recall against state size",
            "",
            "The decoding state each trained model holds after the recall sequence (every layer, batch 1: a KV cache "
            "grows with L, a window is bounded, a recurrence is constant) against its recall accuracy, smallest state "
            "first: at equal state size the methods compare fairly (Zoology's axis).",
            "",
            markdown_table(
                ["variant", "L", "state", "kind", "recall accuracy"],
                [
                    [
                        f"`{r['variant']}`",
                        str(int(r["length"])),
                        fmt_bytes(r["state_bytes"]),
                        r["state_kind"],
                        f"{r['accuracy']:.1%}",
                    ]
                    for r in states.to_dict("records")
                ],
            ),
            "",
        ]
    costs = cost_frame(run_dir)
    if not costs.empty:
        lines += [
            "### Cost of a training step",
            "",
            "One training step (forward, loss, backward, AdamW) of the same model, measured in a process of its own: "
            "median of 5 steps after 2 warm-up steps; peak memory over the state before the step.",
            "",
            cost_table(costs),
            "",
        ]
    return lines + _figure_links(run_dir, figures)


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


def write_tradeoff_report(
    run_dirs: list[Path],
    out_dir: Path,
    n: int | None = None,
    pass_: str = "fwdbwd",
    causal: bool = True,
    device: str | None = None,
) -> tuple[Path, list[Path]]:
    """OUT/REPORT.md from speed runs and quality runs together: per task, accuracy against time per call
    at N (default: the sequence length the model read at the task's largest trained L), the figure and the
    advise table. Returns (REPORT.md, figures)."""
    speed, quality = split_runs(run_dirs)
    if not quality:
        raise ValueError("a trade-off report needs a quality run (bench quality) beside the speed runs")
    rows = [r for d in quality for r in quality_rows(d)]
    out_dir = Path(out_dir)
    (out_dir / "figures").mkdir(parents=True, exist_ok=True)
    panels, sections = [], []
    for task in dict.fromkeys(r["task"] for r in rows if r.get("final")):
        largest = max(int(r["length"]) for r in rows if r.get("final") and r["task"] == task)
        at = n or TOKENS_PER_L[task] * largest  # the tokens the model read
        answers, context = advise(run_dirs, n=at, device=device, pass_=pass_, causal=causal, task=task)
        panels.append((task, at, answers))
        table = advise_table(answers)
        sections += [
            f"### {task}, N={at}",
            "",
            markdown_table(list(table.columns), [[md_text(v) for v in row] for row in table.itertuples(index=False)]),
            "",
            md_text(recommendation(answers, context) + (f" ({context['floor']})" if context["floor"] else "")),
            "",
        ]
    sections += _surviving_speedup(speed, quality, pass_, causal, device)
    kind = "causal" if causal else "non-causal"
    figure = tradeoff_figure(
        panels,
        out_dir / "figures" / "tradeoff.png",
        f"time: {pass_} {kind} attention calls from {', '.join(d.name for d in speed)}; accuracy: {', '.join(d.name for d in quality)}",
        variant_facts(*run_dirs),
    )
    command = "bench report " + " ".join(str(d) for d in run_dirs) + f" --out {out_dir}" + (f" --len {n}" if n else "")
    lines = [
        f"# attnbench trade-off: {', '.join(d.name for d in speed)} x {', '.join(d.name for d in quality)}",
        "",
        f"Regenerate with `{command}`.",
        "",
        f"Time and memory of one {pass_} {kind} attention call at N (from the speed runs: measured, or interpolated / "
        "extrapolated on the fitted exponent and marked), against the held-out accuracy of the same attention in the "
        "quality runs at the trained length nearest to N. Copy's N is the tokens its model read (2L).",
        "",
        *_figure_links(out_dir, [figure]),
        *sections,
    ]
    path = out_dir / "REPORT.md"
    path.write_text("\n".join(lines))
    return path, [figure]


def _surviving_speedup(
    speed: list[Path], quality: list[Path], pass_: str, causal: bool, device: str | None
) -> list[str]:
    """How much of an attention call's speed-up over full survives in a whole training step: per (task, L)
    of the quality runs' measured steps, the op-level time ratio at the same tokens (speed runs) beside the
    training-step time ratio (quality runs), both against full."""
    costs = pd.concat([cost_frame(d) for d in quality], ignore_index=True)
    if costs.empty or "step_ms" not in costs:
        return []
    costs = costs[costs["status"] == "ok"]
    _, sel = speed_rows(speed, device, pass_, causal)
    ok = sel[sel["status"] == "ok"]
    op = {
        v: list(zip(g["n"].astype(int), g["time_median_s"])) for v, g in ok.groupby("setting")
    }  # (one per option set)
    if BASELINE not in op:
        return []
    body = []
    for (task, length), group in costs.groupby(["task", "length"], sort=False):
        steps = dict(zip(group["variant"], group["step_ms"]))
        if BASELINE not in steps:
            continue
        tokens = int(group["seq_len"].iloc[0])
        base_op, how = log_interp(op[BASELINE], tokens)
        for variant, step_ms in steps.items():
            if variant == BASELINE or variant not in op:
                continue
            t, how_v = log_interp(op[variant], tokens)
            marks = "" if how == how_v == "measured" else " *"
            body.append(
                [
                    task,
                    str(length),
                    str(tokens),
                    f"`{variant}`",
                    f"{base_op / t:.2f}x{marks}",
                    f"{steps[BASELINE] / step_ms:.2f}x",
                ]
            )
    if not body:
        return []
    return [
        "### How much of the attention speed-up survives in a training step",
        "",
        f"Speed-up over `{BASELINE}` (above 1: faster) of one {pass_} {'causal' if causal else 'non-causal'} attention call at the "
        "tokens the model reads (speed runs; * where that N is interpolated or extrapolated, not measured), beside the "
        "speed-up of a whole training step of the quality model (embedding, MLPs, loss, AdamW; the quality runs' "
        "train_cost.jsonl). The attention call's shape is the speed run's, not the small model's.",
        "",
        markdown_table(["task", "L", "tokens", "variant", "attention call", "training step"], body),
        "",
    ]
