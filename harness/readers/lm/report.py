"""A `bench lm` run's REPORT.md: its setup, then a section a task (tables: frames.py, the trainings' sections:
training.py, figures: figures.py). Reading and drawing only: no torch, no model."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.fmt import fmt_bytes, fmt_time
from harness.readers.lm.figures import draw_lm
from harness.readers.lm.kv import draw_kv_frontier, kv_rows, kv_section
from harness.readers.lm.frames import (
    OWN,
    cost_table,
    decode_exponent,
    decode_table,
    lm_frame,
    paired_ratio_table,
    passkey_table,
    perplexity_table,
    ruler_table,
    setting_order,
)
from harness.readers.lm.training import distill_section, linearize_section
from harness.readers.tables import code_span, markdown_table
from harness.store.storage import read_metadata


def write_lm_report(run_dir: Path) -> tuple[Path, list[Path]]:
    """RUN_DIR/REPORT.md and figures/ of an lm run; ValueError when it has no rows yet."""
    run_dir = Path(run_dir)
    whole = lm_frame(run_dir)
    if whole.empty:
        raise ValueError(f"{run_dir} has no results yet")
    df = whole.drop(kv_rows(whole).index)  # (the KV sweep's rows have a section of their own)
    meta = read_metadata(run_dir)
    cfg, about, env = meta.get("config", {}), meta.get("machine", {}), meta.get("environment", {})
    model, corpus = about.get("model", {}), about.get("corpus", {})
    settings = setting_order(df)
    tasks = cfg.get("tasks") or ["perplexity", "passkey"]  # (runs made before --tasks ran both)
    lengths = sorted(int(n) for n in df[~df["task"].isin(["distill", "linearize"])]["length"].unique())
    figures = draw_lm(run_dir, df, settings) if not df.empty else []
    frontier = None
    if not kv_rows(whole).empty:
        (run_dir / "figures").mkdir(exist_ok=True)
        frontier = draw_kv_frontier(whole, run_dir / "figures" / "kv_frontier.png")
    lines = [
        f"# attnbench lm: {run_dir.name}",
        "",
        f"Command: {code_span(env.get('command', '?'))}",
        "",
        f"- Model: {model.get('name')} from `{model.get('path')}` (sha256 {str(model.get('sha256'))[:16]}…), "
        f"{model.get('layers')} layers, context {model.get('context')}",
        f"- Text: {corpus.get('source')} ({corpus.get('tokens')} tokens, sha256 {str(corpus.get('sha256'))[:16]}…)"
        + (
            (
                f"; {cfg.get('windows')} windows a length from seed {cfg.get('seed')}, each scored on its last tokens "
                "(128, or half a short context)"
                if cfg.get("scored_from") is None
                else f"; disjoint windows from seed {cfg.get('seed')}, each scored from {cfg['scored_from']:.0%} of its "
                f"length on, {cfg.get('windows') or 'enough for ' + format(cfg.get('scored_tokens'), ',') + ' tokens'} a length"
            )
            if "perplexity" in tasks
            else ""
        ),
        *(
            [
                f"- Passkey: depths {', '.join(map(str, cfg.get('depths', [])))}%, {cfg.get('keys')} keys a cell, greedy, exact match"
            ]
            if "passkey" in tasks
            else []
        ),
        f"- Attentions: {', '.join(f'`{s}`' for s in settings) or 'none beside the KV sweep'} (`{OWN}`: the model's own); "
        + (
            f"zero-shot, and `+ distill {cfg['distill']}` after attention transfer (below)"
            if cfg.get("distill")
            else "zero-shot, and `+ linearized` after the linearization recipe (below)"
            if cfg.get("linearize")
            else "zero-shot: nothing trained"
        ),
        f"- Regenerate this report with `bench report {run_dir}`.",
        "",
    ]
    lines += [f"![{p.stem}](figures/{p.name})" for p in figures] + [""]
    ppl = perplexity_table(df)
    if not ppl.empty:
        cell = {(r.setting, int(r.length)): f"{r.ppl:.2f} [{r.ppl_low:.2f}–{r.ppl_high:.2f}]" for r in ppl.itertuples()}
        count = {int(r.length): f"{int(r.windows)} windows, {int(r.tokens):,} tokens" for r in ppl.itertuples()}
        lines += [
            "## Perplexity",
            "",
            "Of every scored token of the windows together, with its 95% bootstrap interval over the windows ("
            + "; ".join(f"L = {n}: {count[n]}" for n in lengths if n in count)
            + ").",
            "",
            markdown_table(
                ["attention", *map(str, lengths)],
                [[f"`{s}`", *(cell.get((s, n), "") for n in lengths)] for s in settings],
            ),
            "",
        ]
    paired = paired_ratio_table(df)
    if not paired.empty:
        cell = {(r.setting, int(r.length)): f"{r.ratio:.3f} [{r.low:.3f}–{r.high:.3f}]" for r in paired.itertuples()}
        shown = [s for s in settings if any((s, n) in cell for n in lengths)]
        lines += [
            f"Against `{OWN}` on the same windows: perplexity / {OWN}'s, with its 95% paired bootstrap interval (the "
            "windows resampled together, so the texts' own spread cancels).",
            "",
            markdown_table(
                ["attention", *map(str, lengths)], [[f"`{s}`", *(cell.get((s, n), "") for n in lengths)] for s in shown]
            ),
            "",
        ]
    keys = passkey_table(df)
    if not keys.empty:
        depths = sorted(int(d) for d in keys["depth"].unique())
        trials = sorted({int(n) for n in keys["keys"]})
        lines += [
            "## Passkey retrieval",
            "",
            f"Exact match over {trials[0]}{'' if len(trials) == 1 else f'-{trials[-1]}'} keys a cell, with Wilson's 95% "
            "interval" + (" (fewer than 10 trials a cell: wide)." if trials[0] < 10 else "."),
            "",
        ]
        for s in settings:
            mine = {
                (int(r.length), int(r.depth)): f"{r.accuracy:.0%} [{r.low:.0%}–{r.high:.0%}]"
                for r in keys[keys["setting"] == s].itertuples()
            }
            if mine:
                lines += [
                    f"`{s}`",
                    "",
                    markdown_table(
                        ["length \\ depth", *(f"{d}%" for d in depths)],
                        [[str(n), *(mine.get((n, d), "") for d in depths)] for n in lengths],
                    ),
                    "",
                ]
    ruler = ruler_table(df)
    if not ruler.empty:
        lines += [
            "## RULER group",
            "",
            f"Exact match over {int(ruler['trials'].min())} trials a cell, with Wilson's 95% interval: multikey (one of "
            "four needles asked), multivalue (all four numbers of one word), vartrack (the five variables of a chain); "
            "docs/lm.md says how each follows RULER.",
            "",
        ]
        for subtask, mine in ruler.groupby("subtask", sort=False):
            cell = {
                (r.setting, int(r.length)): f"{r.accuracy:.0%} [{r.low:.0%}–{r.high:.0%}]" for r in mine.itertuples()
            }
            shown = [n for n in lengths if any((s, n) in cell for s in settings)]
            body = [
                [f"`{s}`", *(cell.get((s, n), "") for n in shown)]
                for s in settings
                if any((s, n) in cell for n in shown)
            ]
            lines += [f"`{subtask}`", "", markdown_table(["attention", *map(str, shown)], body), ""]
    lines += kv_section(whole, frontier)
    lines += distill_section(df, cfg, settings, lengths, about.get("distill", {}).get("nothing_to_train"))
    lines += linearize_section(df, cfg, lengths, about.get("linearize", {}))
    lines += decode_section(df, settings, lengths)
    cost = cost_table(df)
    if not cost.empty:
        rows = []
        for r in cost.sort_values(["length"], kind="stable").itertuples():
            get = lambda name: getattr(r, name, None)  # noqa: E731
            ok = lambda v: v is not None and v == v  # noqa: E731
            rows.append(
                [
                    f"`{r.setting}`",
                    str(int(r.length)),
                    fmt_time(get("forward_s")) if ok(get("forward_s")) else "",
                    f"{get('vs_sdpa'):.2f}" if ok(get("vs_sdpa")) else "",
                    fmt_bytes(get("peak_bytes")) if ok(get("peak_bytes")) else "",
                    fmt_time(get("token_s")) if ok(get("token_s")) else "",
                    fmt_bytes(get("state_bytes")) if ok(get("state_bytes")) else "",
                ]
            )
        sampled = (
            "forward_samples" in df and df["forward_samples"].notna().any()
        )  # (runs before it: the faster of two calls)
        timed = (
            "the median of 3-7 samples after a warm-up call, as `bench run` times a cell"
            if sampled
            else "the faster of two calls"
        )
        header = ["attention", "L", "forward", "× sdpa", "peak", "token", "state"]
        kept = [
            i for i in range(len(header)) if i < 2 or any(row[i] for row in rows)
        ]  # (a run without forwards: no empty columns)
        said = (
            [
                f"one forward of the whole context (time: {timed}; peak: extra resident memory of one call) against the "
                "model's own sdpa"
            ]
            if 2 in kept
            else []
        )
        said += (
            [
                "one generated token after the passkey prompt (median) and the decoding state it keeps (the variant's "
                "state after `variants.hf.use`; sdpa: its KV cache)"
            ]
            if 5 in kept
            else []
        )
        said = "; ".join(said)
        lines += [
            "## Cost",
            "",
            said[:1].upper() + said[1:] + ".",
            "",
            markdown_table([header[i] for i in kept], [[row[i] for i in kept] for row in rows]),
            "",
        ]
    path = run_dir / "REPORT.md"
    path.write_text("\n".join(lines))
    return path, figures + ([frontier] if frontier else [])


def decode_section(df: pd.DataFrame, settings: list[str], lengths: list[int]) -> list[str]:
    table = decode_table(df)
    if table.empty:
        return []
    cell = {(r.setting, int(r.length)): r for r in table.itertuples()}

    def shown(r, value: str, ratio: str, fmt) -> str:  # the value, and its ratio to sdpa's where there is one
        if r is None:
            return ""
        times = getattr(r, ratio)
        return fmt(getattr(r, value)) + (f" ({times:.2f}×)" if times is not None and times == times else "")

    rows, states = [], []
    for s in settings:
        mine = [cell.get((s, n)) for n in lengths]
        if not any(mine):
            continue
        exponent = decode_exponent(table, s)
        rows.append(
            [
                f"`{s}`",
                *(shown(r, "token_s", "vs_sdpa", fmt_time) for r in mine),
                "" if exponent is None else f"{exponent:.2f}",
            ]
        )
        states.append([f"`{s}`", *(shown(r, "state_bytes", "state_vs_sdpa", fmt_bytes) for r in mine)])
    return [
        "## Decoding inside the model",
        "",
        "A prompt of L tokens of the text, then 16 tokens fed one at a time with the cache: the model's own KV "
        "cache for `sdpa`, each layer's decoding state otherwise (`variants.hf.state_cache`). Time: the median "
        "of the 16 forwards of one token (× `sdpa` at the same L); exponent: the fitted slope of log time on "
        f"log L from 1024 to {max(lengths)} (0: flat, 1: linear in the context).",
        "",
        markdown_table(["attention", *map(str, lengths), "exponent"], rows),
        "",
        "The cache's bytes after the prompt (× the model's own KV cache):",
        "",
        markdown_table(["attention", *map(str, lengths)], states),
        "",
    ]
