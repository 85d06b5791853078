"""The sections of a `bench lm` REPORT.md that explain a training: what distillation and linearization did,
step by step, and what the trained attention got right and wrong by position."""

from __future__ import annotations

import math

import pandas as pd

from harness.fmt import fmt_time
from harness.readers.lm.frames import DISTILLED, OWN, base_of, distill_table, linearize_table, perplexity_table
from harness.readers.tables import markdown_table


def distill_section(
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


def linearize_section(df: pd.DataFrame, cfg: dict, lengths: list[int], about: dict) -> list[str]:
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
        "on the model's own attention. Each stage: parameters · steps · time · before → after."
        + (
            f" Each training sequence starts at a random position below {recipe['position_offsets']} (position ids "
            "shifted, targets unchanged: `--position-offsets`)."
            if recipe.get("position_offsets")
            else ""
        ),
        "",
        markdown_table(["attention", "stage 1", "stage 2", "tokens", "time"], budget),
        "",
        "Perplexity of the scored text, zero-shot → after (× the model's own `sdpa`):",
        "",
        markdown_table(["attention", *map(str, lengths)], [own_row, *quality] if any(own_row[1:]) else quality),
        "",
    ]
    lines += _error_by_position(table)
    nothing = about.get("nothing_to_linearize")
    if nothing:
        lines += [
            "Nothing to linearize (no parameters of their own; evaluated zero-shot): "
            + ", ".join(f"`{s}`" for s in nothing)
            + ".",
            "",
        ]
    return lines


def _error_by_position(table: pd.DataFrame) -> list[str]:
    """Stage 1's held-out error with the same text moved to each span of positions (runs from before: none)."""
    rows = [
        r for r in table.itertuples() if isinstance(r.transfer_error_by_position, dict) and r.transfer_error_by_position
    ]
    if not rows:
        return []
    spans = list(dict.fromkeys(span for r in rows for span in r.transfer_error_by_position))
    cells = [
        [f"`{r.setting}`", *(f"{r.transfer_error_by_position.get(s, float('nan')):.3f}" for s in spans)] for r in rows
    ]
    return [
        "Stage 1's held-out error after training, the same held-out text placed at the end of each span of positions "
        "(the targets move with it: what is left is what the maps owe to position):",
        "",
        markdown_table(["attention", *spans], cells),
        "",
        *_older_share(table),
    ]


def _older_share(table: pd.DataFrame) -> list[str]:
    """The out-of-window attention share, the variant's against softmax's, at each context (window variants)."""
    rows = [r for r in table.itertuples() if isinstance(r.transfer_older_share, dict) and r.transfer_older_share]
    if not rows:
        return []
    lengths = list(dict.fromkeys(n for r in rows for n in r.transfer_older_share))
    cells = [[f"`{r.setting}`", *("{:.0%} / {:.0%}".format(*r.transfer_older_share[n]) for n in lengths)] for r in rows]
    return [
        "After stage 1, the share of the last 64 queries' attention on keys older than the window, the variant's / "
        "softmax's on the same q, k (the training text's last tokens; averaged over layers and heads):",
        "",
        markdown_table(["attention", *lengths], cells),
        "",
    ]
