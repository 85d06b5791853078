"""A `bench lm` run read back: its tables (pandas), figures (matplotlib) and REPORT.md. Reading and drawing only:
no torch, no model."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.fmt import fmt_bytes, fmt_time
from harness.readers.tables import code_span, markdown_table
from harness.store.storage import LM_RESULTS as RESULTS
from harness.store.storage import read_metadata, read_rows

OWN = "sdpa"
PANELS_ACROSS = 6  # passkey heatmaps a row
LEGEND_INSIDE = 8  # attentions a legend holds inside its axes; more go beside them
DISTILLED = " + distill "  # in a distilled attention's label (harness/lm/run.py's Setting.label)
LINEARIZED, LORA = (
    " + linearized",
    " + LoRA",
)  # a linearized attention's label; the model's own after LoRA alone (its control)
TWINS = (DISTILLED, LINEARIZED, LORA)


def base_of(setting: str) -> str:
    """The zero-shot attention a trained twin (distilled, linearized, the sdpa control) comes from."""
    for mark in TWINS:
        if mark in setting:
            return setting.split(mark)[0]
    return setting


def lm_frame(run_dir: Path) -> pd.DataFrame:
    rows = read_rows(Path(run_dir), RESULTS, quiet=True) if (Path(run_dir) / RESULTS).exists() else []
    return pd.DataFrame(rows)


def _order(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["setting"]))


def perplexity_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length): mean perplexity over the windows (exp of the mean NLL), min and max, windows."""
    ppl = df[df["task"] == "perplexity"]
    if ppl.empty:
        return pd.DataFrame(columns=["setting", "length", "ppl", "ppl_min", "ppl_max", "windows"])
    out = (
        ppl.groupby(["setting", "length"], sort=False)
        .agg(nll=("nll", "mean"), ppl_min=("ppl", "min"), ppl_max=("ppl", "max"), windows=("window", "nunique"))
        .reset_index()
    )
    out["ppl"] = out["nll"].map(math.exp)  # the perplexity of the windows' scored tokens together
    return out.drop(columns=["nll"])


def passkey_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length, depth): exact-match accuracy over the keys."""
    keys = df[df["task"] == "passkey"]
    if keys.empty:
        return pd.DataFrame(columns=["setting", "length", "depth", "accuracy", "keys"])
    keys = keys.assign(correct=keys["correct"].astype(float))
    return (
        keys.groupby(["setting", "length", "depth"], sort=False)
        .agg(accuracy=("correct", "mean"), keys=("correct", "size"))
        .reset_index()
    )


def cost_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length): a forward's time and peak extra memory, its ratio to the model's own sdpa at that
    length, and from the passkey rows a generated token's median time and the decoding state's bytes."""
    cost = df[df["task"] == "cost"]
    cost = (
        cost[["setting", "length", "forward_s", "peak_bytes"]]
        if not cost.empty
        else pd.DataFrame(columns=["setting", "length"])
    )
    keys = df[df["task"] == "passkey"]
    if not keys.empty:
        gen = (
            keys.groupby(["setting", "length"], sort=False)
            .agg(token_s=("token_s", "median"), state_bytes=("state_bytes", "max"))
            .reset_index()
        )
        cost = gen if cost.empty else cost.merge(gen, on=["setting", "length"], how="outer")
    if cost.empty:
        return cost
    if "forward_s" in cost:
        base = cost[cost["setting"] == OWN].set_index("length")["forward_s"]
        cost["vs_sdpa"] = [
            t / base[n] if n in base.index and base[n] else None for n, t in zip(cost["length"], cost["forward_s"])
        ]
    return cost


def distill_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per distilled attention: its parameters, steps, time, and the held-out attention-output error (mean over
    layers, a fraction of the softmax output's mean square) before and after attention transfer."""
    rows = df[df["task"] == "distill"] if "task" in df else df
    columns = ["setting", "parameters", "steps", "lr", "tokens", "distill_s", "error_before", "error_after"]
    return rows[columns].reset_index(drop=True) if not rows.empty else pd.DataFrame(columns=columns)


def decode_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length) of the decode rows: the median generated token's time, its ratio to the model's own
    sdpa with its KV cache at that length, the state's bytes after the prompt and their ratio to sdpa's cache."""
    rows = df[df["task"] == "decode"] if "task" in df else df.iloc[:0]
    if rows.empty:
        return pd.DataFrame(columns=["setting", "length", "token_s", "vs_sdpa", "state_bytes", "state_vs_sdpa"])
    out = rows[["setting", "length", "token_s", "token_min_s", "prefill_s", "state_bytes"]].copy()
    own = out[out["setting"] == OWN].set_index("length")
    out["vs_sdpa"] = [t / own["token_s"][n] if n in own.index else None for n, t in zip(out["length"], out["token_s"])]
    out["state_vs_sdpa"] = [
        b / own["state_bytes"][n] if n in own.index else None for n, b in zip(out["length"], out["state_bytes"])
    ]
    return out.reset_index(drop=True)


def decode_exponent(table: pd.DataFrame, setting: str, low: int = 1024) -> float | None:
    """The fitted exponent of a generated token's time against the context, from `low` to the longest length
    (least squares on the logs): 0 for a constant cost, 1 for one linear in the context."""
    mine = table[(table["setting"] == setting) & (table["length"] >= low)]
    if len(mine) < 2:
        return None
    x, y = [math.log(n) for n in mine["length"]], [math.log(t) for t in mine["token_s"]]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def linearize_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per linearized attention: each stage's trained parameters, steps, tokens and seconds, stage 1's held-out
    attention error and stage 2's held-out next-token loss before and after, the seconds in all."""
    rows = df[df["task"] == "linearize"] if "task" in df else df
    out = []
    for r in rows.itertuples():
        t, lo = (x if isinstance(x, dict) else {} for x in (getattr(r, "transfer", None), getattr(r, "lora", None)))
        out.append(
            {
                "setting": r.setting,
                "seconds": r.seconds,
                "tokens": r.tokens,
                **{
                    f"transfer_{k}": t.get(k) for k in ("parameters", "steps", "seconds", "error_before", "error_after")
                },
                **{
                    f"lora_{k}": lo.get(k)
                    for k in ("parameters", "steps", "seconds", "nll_before", "nll_after", "rank")
                },
            }
        )
    return pd.DataFrame(out)


def write_lm_report(run_dir: Path) -> tuple[Path, list[Path]]:
    """RUN_DIR/REPORT.md and figures/ of an lm run; ValueError when it has no rows yet."""
    run_dir = Path(run_dir)
    df = lm_frame(run_dir)
    if df.empty:
        raise ValueError(f"{run_dir} has no results yet")
    meta = read_metadata(run_dir)
    cfg, about, env = meta.get("config", {}), meta.get("machine", {}), meta.get("environment", {})
    model, corpus = about.get("model", {}), about.get("corpus", {})
    settings = _order(df)
    tasks = cfg.get("tasks") or ["perplexity", "passkey"]  # (runs made before --tasks ran both)
    lengths = sorted(int(n) for n in df[~df["task"].isin(["distill", "linearize"])]["length"].unique())
    figures = draw_lm(run_dir, df, settings)
    lines = [
        f"# attnbench lm: {run_dir.name}",
        "",
        f"Command: {code_span(env.get('command', '?'))}",
        "",
        f"- Model: {model.get('name')} from `{model.get('path')}` (sha256 {str(model.get('sha256'))[:16]}…), "
        f"{model.get('layers')} layers, context {model.get('context')}",
        f"- Text: {corpus.get('source')} ({corpus.get('tokens')} tokens, sha256 {str(corpus.get('sha256'))[:16]}…)"
        + (
            f"; {cfg.get('windows')} windows a length from seed {cfg.get('seed')}, each scored on its last tokens "
            "(128, or half a short context)"
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
        f"- Attentions: {', '.join(f'`{s}`' for s in settings)} (`{OWN}`: the model's own); "
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
        cell = {(r.setting, int(r.length)): f"{r.ppl:.2f} ({r.ppl_min:.1f}–{r.ppl_max:.1f})" for r in ppl.itertuples()}
        lines += [
            "## Perplexity (mean over the windows, min–max)",
            "",
            markdown_table(
                ["attention", *map(str, lengths)],
                [[f"`{s}`", *(cell.get((s, n), "") for n in lengths)] for s in settings],
            ),
            "",
        ]
    keys = passkey_table(df)
    if not keys.empty:
        depths = sorted(int(d) for d in keys["depth"].unique())
        lines += ["## Passkey retrieval (exact match over the keys)", ""]
        for s in settings:
            mine = {(int(r.length), int(r.depth)): f"{r.accuracy:.0%}" for r in keys[keys["setting"] == s].itertuples()}
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
    lines += _distill_section(df, cfg, settings, lengths, about.get("distill", {}).get("nothing_to_train"))
    lines += _linearize_section(df, cfg, lengths, about.get("linearize", {}))
    lines += _decode_section(df, settings, lengths)
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
    return path, figures


def _distill_section(
    df: pd.DataFrame, cfg: dict, settings: list[str], lengths: list[int], untouched: list[str] | None
) -> list[str]:
    table = distill_table(df)
    if table.empty:
        return []
    ppl = {(r.setting, int(r.length)): r.ppl for r in perplexity_table(df).itertuples()}
    rows = []
    for r in table.itertuples():
        base = r.setting.rsplit(DISTILLED, 1)[0]
        rows.append(
            [
                f"`{base}`",
                f"{int(r.parameters):,}",
                fmt_time(r.distill_s),
                f"{r.error_before:.3f} → {r.error_after:.3f}",
                *(
                    f"{ppl[(base, n)]:.4g} → {ppl[(r.setting, n)]:.4g}"
                    if (base, n) in ppl and (r.setting, n) in ppl
                    else ""
                    for n in lengths
                ),
            ]
        )
    if untouched is None:  # (a run from before the metadata said so: those without a distillation row)
        distilled = {s.rsplit(DISTILLED, 1)[0] for s in table["setting"]}
        untouched = [s for s in settings if s != OWN and DISTILLED not in s and s not in distilled]
    lines = [
        "## Attention transfer (`--distill`)",
        "",
        f"Before being evaluated again, each variant with parameters of its own trained only those, {cfg.get('distill')} AdamW "
        f"steps a layer (learning rate {cfg.get('distill_lr')}), to reproduce the model's softmax attention output of each layer on "
        f"{int(table['tokens'].iloc[0])} tokens of standard-library docstrings (`harness/lm/distill.py`; the model's weights "
        "untouched). Error: mean squared difference from the softmax output on a held-out sequence, as a fraction of that "
        "output's mean square, averaged over the layers. Perplexity: zero-shot → distilled.",
        "",
        markdown_table(["variant", "parameters", "time", "error", *(f"ppl {n}" for n in lengths)], rows),
        "",
    ]
    if untouched:
        lines += [
            "Nothing to train (no parameters of their own; evaluated as they are): "
            + ", ".join(f"`{s}`" for s in untouched)
            + ".",
            "",
        ]
    return lines


def _decode_section(df: pd.DataFrame, settings: list[str], lengths: list[int]) -> list[str]:
    table = decode_table(df)
    if table.empty:
        return []
    cell = {(r.setting, int(r.length)): r for r in table.itertuples()}
    ok = lambda v: v is not None and v == v  # noqa: E731
    rows = []
    for s in settings:
        mine = [cell.get((s, n)) for n in lengths]
        if not any(mine):
            continue
        exponent = decode_exponent(table, s)
        rows.append(
            [
                f"`{s}`",
                *(
                    f"{fmt_time(r.token_s)} ({r.vs_sdpa:.2f}×)"
                    if r is not None and ok(r.vs_sdpa)
                    else fmt_time(r.token_s)
                    if r is not None
                    else ""
                    for r in mine
                ),
                "" if exponent is None else f"{exponent:.2f}",
            ]
        )
    states = []
    for s in settings:
        mine = [cell.get((s, n)) for n in lengths]
        if any(mine):
            states.append(
                [
                    f"`{s}`",
                    *(
                        f"{fmt_bytes(r.state_bytes)} ({r.state_vs_sdpa:.2f}×)"
                        if r is not None and ok(r.state_vs_sdpa)
                        else fmt_bytes(r.state_bytes)
                        if r is not None
                        else ""
                        for r in mine
                    ),
                ]
            )
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


def _linearize_section(df: pd.DataFrame, cfg: dict, lengths: list[int], about: dict) -> list[str]:
    table = linearize_table(df)
    if table.empty:
        return []
    recipe = cfg.get("linearize") or {}
    ppl = {(r.setting, int(r.length)): r.ppl for r in perplexity_table(df).itertuples()}
    ok = lambda v: v is not None and v == v  # noqa: E731
    budget, quality = [], []
    for r in table.itertuples():
        base = base_of(r.setting)
        stage1 = (
            (
                f"{int(r.transfer_parameters):,} · {int(r.transfer_steps)} · {fmt_time(r.transfer_seconds)} · "
                f"{r.transfer_error_before:.3f} → {r.transfer_error_after:.3f}"
            )
            if ok(r.transfer_steps)
            else "—"
        )
        stage2 = (
            (
                f"{int(r.lora_parameters):,} · {int(r.lora_steps)} · {fmt_time(r.lora_seconds)} · "
                f"{math.exp(r.lora_nll_before):.2f} → {math.exp(r.lora_nll_after):.2f}"
            )
            if ok(r.lora_steps)
            else "—"
        )
        budget.append([f"`{base}`", stage1, stage2, f"{int(r.tokens):,}", fmt_time(r.seconds)])
        cells = []
        for n in lengths:
            before, after, own = ppl.get((base, n)), ppl.get((r.setting, n)), ppl.get((OWN, n))
            cells.append(
                ""
                if after is None
                else (f"{before:.4g} → " if before is not None and base != OWN else "")
                + f"{after:.4g}"
                + (f" ({after / own:.2f}×)" if own else "")
            )
        quality.append([f"`{r.setting}`", *cells])
    own_row = [f"`{OWN}`", *(f"{ppl[(OWN, n)]:.4g}" if (OWN, n) in ppl else "" for n in lengths)]
    lines = [
        "## Linearization (`--linearize`)",
        "",
        f"LoLCATs' two stages (`harness/lm/linearize.py`), each on sequences of {recipe.get('length')} tokens of "
        f"{about.get('train_text', 'the training text')} (no run of 12 words shared with the scored text). Stage 1, "
        f"attention transfer: {recipe.get('transfer_steps')} AdamW steps (learning rate {recipe.get('transfer_lr')}) training "
        f"only the variant's own parameters, on every layer at once, to reproduce the model's softmax attention output "
        f"(error: held-out mean squared difference as a fraction of the softmax output's mean square, mean over layers). "
        f"Stage 2: {recipe.get('lora_steps')} steps of LoRA (rank {recipe.get('lora_rank')}, learning rate "
        f"{recipe.get('lora_lr')}) on q, k, v, o with next-token loss, the variant's parameters frozen, then merged "
        f"(perplexity of the held-out training text before → after). `sdpa + LoRA` is the control: the same LoRA "
        "on the model's own attention. Each stage: parameters · steps · time · before → after.",
        "",
        markdown_table(["attention", "stage 1", "stage 2", "tokens", "time"], budget),
        "",
        "Perplexity of the scored text, zero-shot → after (× the model's own `sdpa`):",
        "",
        markdown_table(["attention", *map(str, lengths)], [own_row, *quality]),
        "",
    ]
    nothing = about.get("nothing_to_linearize")
    if nothing:
        lines += [
            "Nothing to linearize (no parameters of their own; evaluated zero-shot): "
            + ", ".join(f"`{s}`" for s in nothing)
            + ".",
            "",
        ]
    return lines


def draw_lm(run_dir: Path, df: pd.DataFrame, settings: list[str]) -> list[Path]:
    """figures/lm_perplexity.png, lm_passkey.png, lm_decode.png, lm_linearize.png, lm_cost.png (those the run has
    rows for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(run_dir) / "figures"
    folder.mkdir(exist_ok=True)
    out = []
    ppl = perplexity_table(df)
    if not ppl.empty:
        style = _styles(settings)
        many = len(settings) > LEGEND_INSIDE
        fig, ax = plt.subplots(figsize=(10, 5.5) if many else (7, 4.5))
        for s in settings:
            mine = ppl[ppl["setting"] == s].sort_values("length")
            if mine.empty:
                continue
            ax.errorbar(
                mine["length"],
                mine["ppl"],
                yerr=[mine["ppl"] - mine["ppl_min"], mine["ppl_max"] - mine["ppl"]],
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
            ylabel="perplexity of the last tokens",
            title=f"perplexity against context (zero-shot{trained})",
        )
        _legend(ax, many, 8)
        ax.grid(True, which="both", alpha=0.3)
        _length_axis(ax, ppl["length"])
        out.append(_save(fig, folder / "lm_perplexity.png"))
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
        out.append(_draw_decode(decode, _styles(settings), settings, folder / "lm_decode.png"))
    curves = df[df["task"] == "linearize"] if "task" in df else df.iloc[:0]
    if not curves.empty:
        out.append(_draw_training(curves, _styles(settings), folder / "lm_linearize.png"))
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
        style, many = _styles(settings), len(settings) > LEGEND_INSIDE
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


def _draw_decode(table: pd.DataFrame, style: dict, settings: list[str], path: Path) -> Path:
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


def _styles(settings: list[str]) -> dict[str, dict]:
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
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
