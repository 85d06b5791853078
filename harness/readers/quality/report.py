"""The quality part of a run's REPORT.md: accuracy by task and length, by distance, the window's verdicts,
and what each training cost; and the sections only a sweep has (--d-model, --lr over several values):
accuracy against model width and state size at each width's best rate, and a zoology run against Zoology's
configuration."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.fmt import fmt_bytes, fmt_time
from harness.quality.config import ZOOLOGY_PUBLISHED, ZOOLOGY_VALUES, QualityConfig, recall_layout
from harness.readers.quality.frames import (
    accuracy_summary,
    accuracy_within,
    by_distance_frame,
    chosen_recipe,
    cost_frame,
    quality_rows,
    state_frame,
    sweep_rows,
    width_frame,
)
from harness.readers.quality.positions import positions_section
from harness.readers.tables import figure_links, markdown_table, md_text
from harness.store.storage import variant_facts


def final_accuracy_grid(rows: list[dict]) -> tuple[list[tuple[str, int]], list[tuple[str, list[dict | None]]]]:
    """The finished trainings as a grid: columns (task, length), and per variant its accuracy summary
    per column (`frames.accuracy_summary`: mean, min, max over seeds) or None."""
    summary = accuracy_summary(chosen_recipe(rows))  # (a sweep's rows: one recipe each)
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
    (`distance`: `frames.by_distance_frame`)."""
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
        if task in ("recall", "mqar"):
            default = 8192 if task == "mqar" else max(64, 2 * (cfg.get("pairs") or length // 8))
            values = (cfg.get("vocab") or default) // 2
            text += f"; chance is {1 / values:.1%} (1 of {values} values)"
        lines += [text + ".", ""]
    return lines


def cost_table(costs: pd.DataFrame, widths: bool = False) -> str:
    """Training-step cost per (task, L) and variant: time, tokens/s, peak memory (`widths`: with the d_model each
    was measured at, for a run that sweeps it)."""
    body = []
    for r in costs.to_dict("records"):
        cell = [r["task"], str(r["length"]), f"`{r['variant']}`", *([str(r["cfg_d_model"])] if widths else [])]
        if r.get("status") != "ok":
            body.append([*cell, "", "", "", md_text(r.get("error", r.get("status")))])
            continue
        step = [str(r["seq_len"]), fmt_time(r["step_ms"] / 1e3), f"{r['tokens_per_s']:,.0f}"]
        body.append([*cell, *step, fmt_bytes(r["train_peak_bytes"])])
    header = ["task", "L", "variant", *(["d_model"] if widths else []), "tokens/seq", "step", "tokens/s", "peak memory"]
    return markdown_table(header, body)


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


TASK_NAMES = {"copy": "copy", "recall": "associative recall", "mqar": "multi-query associative recall (Zoology's MQAR)"}


def quality_section(run_dir: Path, cfg: dict, figures) -> list[str]:
    rows = quality_rows(run_dir)
    if not rows or cfg.get("positions_axis"):  # encodings are read apart (never pooled as seeds of one)
        return positions_section(run_dir, cfg, rows, figures) if rows else []
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
    widths = (
        f"d_model swept over {', '.join(map(str, cfg['d_models']))}"
        if cfg.get("d_models")
        else f"d_model={cfg.get('d_model')}"
    )
    rates = f"lr swept over {', '.join(f'{lr:g}' for lr in cfg['lrs'])}" if cfg.get("lrs") else f"lr={cfg.get('lr')}"
    zoology = (
        "Zoology's model (layers alternating a gated convolution of width 3 and the attention, no MLP, no "
        "positions, the head tied to the embeddings), "
        if cfg.get("arch") == "zoology"
        else ""
    )
    recipe = (
        f"{zoology}{widths}, layers={cfg.get('layers')}, heads={cfg.get('heads')}, "
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
        + ("a sigmoid output gate on each attention's heads (Qwen3-Next's), " if cfg.get("output_gate") else "")
        + f"batch={cfg.get('batch')}{batch_cap(rows, cfg)}, {rates} "
        + (
            "(AdamW, warm-up then cosine), "
            if cfg.get("warmup", 0.1)
            else f"(AdamW with weight decay {cfg.get('weight_decay')}, cosine from the peak), "
        )
        + (f"a fixed set of {cfg['train_examples']:,} training sequences, " if cfg.get("train_examples") else "")
        + (f"stopped once held-out accuracy reached {cfg['early_stop']:.0%}, " if cfg.get("early_stop") else "")
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
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lines = [
        "## Quality: copy and associative recall"
        if set(tasks) <= {"copy", "recall"}
        else f"## Quality: {', '.join(TASK_NAMES.get(t, t) for t in tasks)}",
        "",
        *(sweep_lines(run_dir, cfg) if cfg.get("d_models") or cfg.get("lrs") else []),
        f"Preset {cfg.get('preset', 'quick')}. Same model and recipe for every variant: {recipe}. Held-out token accuracy after "
        f"the last step{' (mean over seeds, min-max in brackets)' if seeds > 1 else ''}"
        + ("; copy: and the share of strings reproduced exactly" if set(tasks) <= {"copy", "recall"} else "")
        + f". Training took {total / 60:.1f} min in all (the sum of every length's training and evaluations over seeds; warm starts and cost measurements not counted).",
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
    if cfg.get("d_models") or cfg.get("lrs"):
        lines += width_section(run_dir, cfg)
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
            "median of 5 steps after 2 warm-up steps; peak memory over the state before the step"
            + (
                "; d_model: the width the step was measured at (each width of the sweep is measured)."
                if cfg.get("d_models")
                else "."
            ),
            "",
            cost_table(costs, widths=bool(cfg.get("d_models"))),
            "",
        ]
    return lines + figure_links(run_dir, figures)


def sweep_lines(run_dir: Path, cfg: dict) -> list[str]:
    """What the tables of a sweep hold, true of the run as it stands (finished or not)."""
    if _unfinished_points(width_frame(sweep_rows(run_dir)), cfg):
        return [
            "The sweep is unfinished: the tables below hold, for each variant, the widest model trained at every "
            "learning rate so far, at its best rate; the section on model width holds every point trained and names "
            "the points not trained yet.",
            "",
        ]
    return [
        "Every training was made at each point of the sweep; the tables below hold, for each variant, the widest "
        "model at its best learning rate, and the section on model width holds every point.",
        "",
    ]


def width_section(run_dir: Path, cfg: dict) -> list[str]:
    """Accuracy against d_model and against decoding-state bytes, the best learning rate at each width (Zoology's
    figure), every rate's accuracy beside it; and, for the zoology preset, the run against Zoology's configuration."""
    widths = width_frame(sweep_rows(run_dir))
    if widths.empty:
        return []
    rates = sorted({lr for cell in widths["by_lr"] for lr in cell})
    body = [
        [
            f"`{r['variant']}`",
            str(r["task"]),
            str(r["length"]),
            str(r["d_model"]),
            fmt_bytes(r["state_bytes"]) if r["state_bytes"] is not None else "—",
            f"**{r['accuracy']:.1%}** ({r['lr']:g})",
            *[f"{r['by_lr'][lr]:.1%}" if lr in r["by_lr"] else "" for lr in rates],
        ]
        for r in widths.sort_values(["task", "length", "d_model"], kind="stable").to_dict("records")
    ]
    lines = [
        "### Accuracy against model width and state size",
        "",
        "Final held-out accuracy at each d_model, the best learning rate in bold (Zoology reports the best of its "
        "rates), each rate's beside it; state: the decoding state after the sequence, every layer, batch 1.",
        "",
        markdown_table(
            ["variant", "task", "L", "d_model", "state", "best (lr)", *[f"lr {lr:g}" for lr in rates]], body
        ),
        "",
        *_unfinished_points(widths, cfg),
    ]
    if cfg.get("preset") == "zoology":
        lines += [
            "### Against Zoology's published configuration",
            "",
            markdown_table(
                ["", "Zoology", "this run", "why"],
                [
                    [what, theirs, _cfg_text(cfg, key), _why(cfg, key, why)]
                    for what, theirs, key, why in ZOOLOGY_PUBLISHED
                ],
            ),
            "",
        ]
    return lines


def _unfinished_points(widths, cfg: dict) -> list[str]:
    """A line naming the sweep's (variant, d_model, lr) points (`QualityConfig.recipes`, what the run trains)
    with no finished training, if there are any."""
    config = QualityConfig.from_json(cfg)
    done = {(r["variant"], int(r["d_model"]), float(lr)) for r in widths.to_dict("records") for lr in r["by_lr"]}
    missing: dict[tuple[int, float], list[str]] = {}
    for recipe in config.recipes():
        for name in config.variants:
            if (name, recipe.d_model, recipe.lr) not in done:
                missing.setdefault((recipe.d_model, recipe.lr), []).append(f"`{name}`")
    if not missing:
        return []
    points = "; ".join(f"d_model {d} at lr {lr:g}: {', '.join(names)}" for (d, lr), names in missing.items())
    return [
        f"The sweep is unfinished (`bench quality --resume RUN_DIR` trains the rest). Not trained yet: {points}.",
        "",
    ]


def _why(cfg: dict, key: str, why: str) -> str:
    """The reason a run differs from Zoology, or nothing where it does not (a CUDA run at Zoology's values)."""
    return "" if key in ZOOLOGY_VALUES and cfg.get(key) == ZOOLOGY_VALUES[key] else why


def _cfg_text(cfg: dict, key: str) -> str:
    """A run's value of `key` for the comparison table (a key it does not hold is the text itself)."""
    if key not in cfg and key not in ("d_models", "lrs"):
        return key
    value = cfg.get(key) or ([cfg.get("d_model")] if key == "d_models" else [cfg.get("lr")] if key == "lrs" else None)
    if key == "lengths":
        return ", ".join(f"({n}, {cfg.get('pairs') or n // 16})" for n in value)
    if key == "steps":
        seen = value * cfg.get("batch", 1)
        epochs = (
            f", {seen / cfg['train_examples']:.1f} epochs of {cfg['train_examples']:,}"
            if cfg.get("train_examples")
            else ""
        )
        return f"{value} steps{epochs}"
    if isinstance(value, list):
        return ", ".join(f"{v:g}" for v in value)
    return str(value)
