"""The speed part of a run's REPORT.md: figures, a table a panel, exponents and crossovers, the decode
cells, the cells that did not run and why."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pandas as pd

from harness.fmt import fmt_bytes, fmt_time
from harness.readers.speed.summary import NOISE_NOTE, PANEL, crossover_text, noisy_mask, summarize
from harness.readers.tables import code_span, figure_links, markdown_table, md_text
from harness.store.storage import baseline_of, variant_facts


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
                "(baseline)" if line["variant"] == summary.attrs.get("baseline") else crossover_text(line),
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
            f"beats {summary.attrs.get('baseline') or 'the baseline'} from N",
        ],
        rows,
    )


def nodes_section(nodes: list[dict], df: pd.DataFrame) -> list[str]:
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


def speed_section(run_dir: Path, df: pd.DataFrame, cfg: dict, machine: dict, figures) -> list[str]:
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
        *figure_links(run_dir, figures),
        "## Summary",
        "",
        "Exponents: least-squares slope of log(time) and log(memory) on log(N) over the upper half of the lengths that ran.",
        "",
        _summary_table(summarize(df, baseline_of(variant_facts(run_dir)))),
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
