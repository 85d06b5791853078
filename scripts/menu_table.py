"""Fill the README's menu table (between its `menu` markers) with what the code and the committed runs say
of each variant: the decoding state it keeps (from the variant's own `init_state`), its recall at the longest
length the quality run trained it on, and its perplexity inside SmolLM2 (zero-shot, after attention transfer where a run
distilled it, after the linearization recipe where a run linearized it) at the longest context every lm run measured.

    python scripts/menu_table.py results/quality-long results/lm-smollm2-menu results/lm-smollm2-linearized

The first four columns (variant, method, time, extra memory) are kept as the README has them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import variants
from harness.readers.lm.frames import lm_frame, perplexity_table
from harness.quality.config import QualityConfig
from harness.readers.quality.frames import accuracy_summary, quality_rows
from harness.readers.tables import replace_block
from harness.store.storage import read_metadata

README = Path("README.md")
DOCS_VARIANTS = Path("docs/variants.md")
MARKER, DEPLOY = "menu", "deploy"


def state_kind(name: str) -> str:
    """The decoding state the variant keeps, read from its own init_state ("no" when it cannot decode)."""
    cls = variants.variant_class(name)
    if cls.decode_unsupported_reason():
        return "no"
    try:
        return variants.build(name, num_heads=1, head_dim=8).init_state(1, 1, 8, 8).kind
    except (RuntimeError, ValueError, ImportError):  # cannot be built on this machine (xformers: CUDA only)
        return "kv" if cls.init_state is variants.AttentionVariant.init_state else "?"  # the default state: a KV cache


def recall_column(run: Path) -> tuple[str, dict[str, str]]:
    """Each variant's recall at the longest L it was trained on (mean over seeds), labelled with that L:
    the long preset trains every variant to L = 256 and one of each family further."""
    summary = accuracy_summary(quality_rows(run))
    recall = summary[summary["task"] == "recall"]
    cells = {}
    for variant, rows in recall.groupby("variant", sort=False):
        r = rows.loc[rows["length"].idxmax()]
        cells[variant] = f"{r['accuracy']:.0%} (L={int(r['length'])})"
    return "recall (longest L)", cells


def run_recipe(run: Path) -> str:
    """'long preset, 3 seeds': how the quality run was made, from its metadata."""
    config = QualityConfig.from_json(read_metadata(run)["config"])
    return f"{config.preset} preset, {config.seeds} seed{'s' if config.seeds != 1 else ''}"


def number(x: float) -> str:
    """A perplexity in a table cell: 11.1, 3,317, 9.4e5 (three figures where the value runs to millions)."""
    return f"{x:.1f}" if x < 100 else f"{x:,.0f}" if x < 1e5 else f"{x:.1e}".replace("e+0", "e").replace("e+", "e")


def lm_column(runs: list[Path]) -> tuple[str, dict[str, str]]:
    """Each variant's perplexity in SmolLM2 at the longest context every lm run measured, from every run: zero-shot,
    'distilled' after --distill, 'linearized' after --linearize (LoLCATs' recipe)."""
    tables = [perplexity_table(lm_frame(run)) for run in runs]
    length = max(set.intersection(*({int(n) for n in t["length"]} for t in tables)))
    cells: dict[str, list[str]] = {}
    for table in tables:
        for r in table[table["length"] == length].to_dict("records"):
            # labels: "full", "sliding_window(window=256, global_tokens=4)", "mamba2 + distill 100" (after attention
            # transfer), "window_linear + linearized" (after the linearization recipe)
            label, _, steps = r["setting"].partition(" + distill ")
            linearized = label.endswith(" + linearized")
            name, _, options = label.removesuffix(" + linearized").partition("(")
            if name.startswith("sdpa"):  # (the model's own attention, and its LoRA control)
                continue
            text = (
                f"{number(r['ppl'])} [{number(r['ppl_low'])}–{number(r['ppl_high'])}]"
                + (f" ({options}" if options else "")
                + (" distilled" if steps else "")
                + (" linearized" if linearized else "")
            )
            if text not in cells.setdefault(name, []):
                cells[name].append(text)
    return f"SmolLM2 ppl, {length} tokens", {name: "; ".join(texts) for name, texts in cells.items()}


STEPS = (
    ("export", "exports with `torch.export`"),
    ("compile", "compiles with `torch.compile`"),
    ("onnx", "exports to ONNX"),
)


def deploy_sentence() -> str:
    """What the specs say of deployment (`not_deployable`), as the sentence the README and docs/variants.md give:
    which variants take each step, the others named."""
    shipped = [
        name for name in variants.available() if variants.variant_class(name).__module__.startswith("variants.methods.")
    ]
    parts = []
    for step, words in STEPS:
        refused = [
            f"`{name}`"
            for name in shipped
            if any(s == step for s, _ in variants.variant_class(name).spec.not_deployable)
        ]
        if not refused:
            parts.append(f"every variant {words}")
        else:
            names = refused[0] if len(refused) == 1 else ", ".join(refused[:-1]) + " and " + refused[-1]
            parts.append(f"all but {names} {words.replace('exports', 'export').replace('compiles', 'compile')}")
    return "Deployment, as the specs say (`not_deployable`, tested): " + "; ".join(parts) + "."


def main(quality_run: str, *lm_runs: str) -> None:
    text = README.read_text()
    block = re.search(rf"<!-- {MARKER}:start -->\n(.*?)<!-- {MARKER}:end -->", text, re.S)
    lines = [line for line in block.group(1).splitlines() if line.startswith("|")]
    recall_head, recall = recall_column(Path(quality_run))
    lm_head, lm = lm_column([Path(run) for run in lm_runs])
    rows = [
        "| variant | method | time | extra memory | decodes | " + recall_head + " | " + lm_head + " |",
        "|---|---|---|---|---|---|---|",
    ]
    for line in lines[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))][:4]
        name = cells[0].strip("`")
        same = variants.variant_class(name).spec.same_function_as  # not trained: its function's accuracy is another's
        kept = recall.get(name) or (f"{recall[same]} (= `{same}`)" if same in recall else "—")
        rows.append("| " + " | ".join([*cells, state_kind(name), kept, lm.get(name, "—")]) + " |")
    body = (
        f"- Decodes: the state `init_state` keeps (kv and latent grow with N, fenwick as log N, window and compressed "
        f"are bounded or shortened, recurrent is constant). Recall: held-out accuracy in [{quality_run}]({quality_run}/"
        f"REPORT.md) ({run_recipe(Path(quality_run))}; mean over seeds).\n"
        f"- SmolLM2: perplexity with the attention swapped zero-shot, 'distilled' after `--distill`'s attention transfer "
        f"(for a variant with parameters), 'linearized' after `--linearize`'s LoLCATs recipe, [its 95% bootstrap "
        f"interval over the scored windows], in "
        + ", ".join(f"[{run}]({run}/REPORT.md)" for run in lm_runs)
        + f"; — where not measured. Filled by `python scripts/menu_table.py {quality_run} {' '.join(lm_runs)}`.\n\n"
        + "\n".join(rows)
        + "\n"
    )
    README.write_text(replace_block(text[: block.start(1)] + body + text[block.end(1) :], DEPLOY, deploy_sentence()))
    page = DOCS_VARIANTS.read_text()
    DOCS_VARIANTS.write_text(replace_block(page, DEPLOY, deploy_sentence()))


if __name__ == "__main__":
    main(*sys.argv[1:])
