"""The trade-off report: accuracy against time per call at one N, from speed runs and quality runs."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.quality.config import TOKENS_PER_L
from harness.readers.advise.answer import advise
from harness.readers.advise.cost import log_interp, speed_rows, split_runs
from harness.readers.advise.text import advise_table, recommendation
from harness.readers.quality.frames import cost_frame, quality_rows, step_key
from harness.readers.quality.plots import tradeoff_figure
from harness.readers.tables import figure_links, markdown_table, md_text
from harness.store.storage import baseline_of, variant_facts


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
        *figure_links(out_dir, [figure]),
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
    base = baseline_of(variant_facts(*speed, *quality))
    if base not in op:
        return []
    body = []
    groups: dict[tuple, list[dict]] = {}  # a step's cost compares with the baseline's of the same model only
    for r in costs.to_dict("records"):
        groups.setdefault(step_key(r), []).append(r)
    several_widths = len({r["cfg_d_model"] for r in costs.to_dict("records")}) > 1
    for key, group in groups.items():
        task, length, d_model = key[0], key[1], group[0]["cfg_d_model"]
        steps = {r["variant"]: r["step_ms"] for r in group}  # (the last run's where two ran the same model)
        if base not in steps:
            continue
        tokens = int(group[0]["seq_len"])
        base_op, how = log_interp(op[base], tokens)
        for variant, step_ms in steps.items():
            if variant == base or variant not in op:
                continue
            t, how_v = log_interp(op[variant], tokens)
            marks = "" if how == how_v == "measured" else " *"
            body.append(
                [
                    task,
                    str(length) + (f" (d_model {d_model})" if several_widths else ""),
                    str(tokens),
                    f"`{variant}`",
                    f"{base_op / t:.2f}x{marks}",
                    f"{steps[base] / step_ms:.2f}x",
                ]
            )
    if not body:
        return []
    return [
        "### How much of the attention speed-up survives in a training step",
        "",
        f"Speed-up over `{base}` (above 1: faster) of one {pass_} {'causal' if causal else 'non-causal'} attention call at the "
        "tokens the model reads (speed runs; * where that N is interpolated or extrapolated, not measured), beside the "
        "speed-up of a whole training step of the quality model (embedding, MLPs, loss, AdamW; the quality runs' "
        "train_cost.jsonl). The attention call's shape is the speed run's, not the small model's.",
        "",
        markdown_table(["task", "L", "tokens", "variant", "attention call", "training step"], body),
        "",
    ]
