"""Heat-maps of the attention pattern each variant really applies, on one random input.

The weights come from running the variant itself (`attention_matrix`: the variant called with
v = identity), not from a drawing of what it should do — so the picture doubles as a visual check
of causality, of the window and of the global tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

import variants
from harness.quality.inspect import attention_maps, attribution, example, head_summary, load_model, rank_correlation
from harness.quality.kept_models import kept_models
from harness.readers.plots import matplotlib_rc, save_figure


def attention_patterns(
    names: list[str], n: int, causal: bool, options: dict, head_dim: int = 16, seed: int = 0
) -> dict:
    """{variant: ((N, N) weights of head 0, the options shown in its title: those of `options` it takes that
    change its function, per its spec)} on one random (1, 1, N, head_dim) input; skips what cannot run here."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 1, n, head_dim, generator=g) for _ in range(2))
    patterns, skipped = {}, {}
    for name in names:
        cls = variants.variant_class(name)
        reason = cls.unavailable_reason("cpu")
        if reason:
            skipped[name] = reason
            continue
        if cls.mode_unsupported_reason(causal):
            skipped[name] = cls.mode_unsupported_reason(causal)
            continue
        opts = variants.options_taken(name, options)
        attn = variants.build(name, num_heads=1, head_dim=head_dim, **opts)
        reason = attn.length_unsupported_reason(n, n)
        if reason:
            skipped[name] = f"at N={n}: {reason}"
            continue
        shown = {
            key: value for key, value in opts.items() if key in cls.spec.function_options
        }  # what changes the pattern
        patterns[name] = (attn.attention_matrix(q, k, causal=causal)[0, 0], shown)
    return {"patterns": patterns, "skipped": skipped}


def draw_patterns(result: dict, out: Path, n: int, causal: bool) -> Path:
    matplotlib_rc()
    import matplotlib.pyplot as plt

    patterns = result["patterns"]
    cols = min(4, max(1, len(patterns)))
    rows = max(1, math.ceil(len(patterns) / cols))
    from matplotlib.colors import PowerNorm

    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 3.6 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.set_visible(False)
    for ax, (name, (weights, shown)) in zip(axes.flat, patterns.items()):
        ax.set_visible(True)
        w = weights.float().numpy()
        # square-root colour scale: the few large weights (a query's first keys) would otherwise hide the pattern
        ax.imshow(
            w, cmap="magma", norm=PowerNorm(0.5, vmin=0.0, vmax=max(float(w.max()), 1e-9)), interpolation="nearest"
        )
        ax.set_title(name + ("\n" + ", ".join(f"{k}={v}" for k, v in shown.items()) if shown else ""), fontsize=8)
        ax.set_xlabel("key position", fontsize=7)
        ax.set_ylabel("query position", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.suptitle(
        f"Attention weights each variant applies (N={n}, {'causal' if causal else 'non-causal'}, one random input)",
        fontsize=10,
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out)


# -- what a trained quality model attends to (bench viz --run) -----------------------------------------------------


def trained_attention(run_dir: Path, task: str | None, heads: list[int] | None, attribute: bool) -> list[dict]:
    """For each variant a run kept a model of (seed 0, `task` or the run's first kept task): one held-out example, each
    layer's attention maps (`heads` only, where given), the per-head summary, and with `attribute` Integrated Gradients
    of the last answer's logit beside the attention its query gives each token (their rank correlation)."""
    paths = kept_models(run_dir)
    if not paths:
        raise ValueError(
            f"--run {run_dir}: the run kept no trained models (RUN_DIR/models); train with bench quality --keep-models"
        )
    records, seen = [], set()
    for path in paths:
        model, facts = load_model(path)
        task = task or facts["task"]
        if facts["task"] != task or facts["seed"] != 0 or facts["variant"] in seen:
            continue
        seen.add(facts["variant"])
        tokens, scored, targets, _ = example(facts)
        maps = attention_maps(model, tokens)
        chosen = heads if heads is not None else list(range(maps[0].shape[0]))
        if max(chosen) >= maps[0].shape[0]:
            raise ValueError(f"--heads {heads}: the model has {maps[0].shape[0]} heads (0..{maps[0].shape[0] - 1})")
        record = {
            "variant": facts["variant"],
            "task": task,
            "path": path,
            "tokens": tokens,
            "scored": scored,
            "maps": [m[chosen] for m in maps],
            "heads": chosen,
            "summary": [[row for row in head_summary(m) if row["head"] in chosen] for m in maps],
        }
        if attribute:
            position = int(scored.nonzero()[-1])  # the last answer
            with torch.enable_grad():
                ig = attribution(model, tokens, position, int(targets[position]))
            row = maps[-1][:, position, : position + 1].mean(0)  # the last layer's heads, averaged
            record.update(
                position=position,
                ig=ig[: position + 1],
                attention_row=row,
                rho=rank_correlation(ig[: position + 1].abs(), row.abs()),
            )
        records.append(record)
    if not records:
        raise ValueError(f"--task {task}: the run kept no model of that task at seed 0")
    return records


def draw_trained(record: dict, out: Path) -> Path:
    """A variant's attention maps, layers by heads, the example's tokens on the axes (answers' queries in red); with
    attribution, a last column of Integrated Gradients beside the attention of the last answer's query."""
    matplotlib_rc()
    import matplotlib.pyplot as plt
    from matplotlib.colors import PowerNorm

    maps, heads = record["maps"], record["heads"]
    cols = len(heads) + ("ig" in record)
    fig, axes = plt.subplots(
        len(maps), cols, figsize=(3.0 * cols, 3.0 * len(maps)), squeeze=False, layout="constrained"
    )
    labels = [str(int(t)) for t in record["tokens"]]
    n = len(labels)
    for layer, weights in enumerate(maps):
        summary = {row["head"]: row for row in record["summary"][layer]}
        for ax, h, w in zip(axes[layer], heads, weights):
            w = w.abs().float().numpy()
            ax.imshow(
                w, cmap="magma", norm=PowerNorm(0.5, vmin=0.0, vmax=max(float(w.max()), 1e-9)), interpolation="nearest"
            )
            s = summary[h]
            ax.set_title(
                f"layer {layer} head {h}: {s['kind']}\nmean distance {s['distance']:.1f}, entropy {s['entropy']:.2f}",
                fontsize=7,
            )
            step = max(1, n // 16)
            ax.set_xticks(range(0, n, step), labels[::step], fontsize=4, rotation=90)
            ax.set_yticks(range(0, n, step), labels[::step], fontsize=4)
            for tick, scored in zip(ax.get_yticklabels(), record["scored"][::step]):
                tick.set_color("red" if scored else "black")
        if "ig" in record:
            ax = axes[layer][-1]
            if layer == len(maps) - 1:
                p = record["position"]
                ig = record["ig"].abs().numpy()
                att = record["attention_row"].abs().numpy()
                ax.plot(ig / max(ig.max(), 1e-12), color="#d62728", lw=1, label="|Integrated Gradients|")
                ax.plot(att / max(att.max(), 1e-12), color="#1f77b4", lw=1, label="attention (last layer)")
                ax.set_title(f"answer at {p}: rank correlation {record['rho']:.2f}", fontsize=7)
                ax.set_xlabel("input position", fontsize=7)
                ax.legend(fontsize=6, loc="upper left")
            else:
                ax.set_visible(False)
    fig.suptitle(
        f"{record['variant']} trained on {record['task']}: attention on one held-out example "
        f"(rows query, columns key; red: answers' queries)",
        fontsize=9,
    )
    out.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out / f"trained_attention_{record['task']}_{record['variant']}.png")


def trained_table(records: list[dict]) -> str:
    """Markdown: per variant, layer and head, the head's kind, mean distance and entropy; the rank correlation of
    attribution and attention per variant where computed."""
    lines = [
        "| variant | layer | head | kind | mean distance | entropy (nats) | within 3 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        for layer, rows in enumerate(r["summary"]):
            lines += [
                f"| `{r['variant']}` | {layer} | {s['head']} | {s['kind']} | {s['distance']:.1f} | "
                f"{s['entropy']:.2f} | {s['local_share']:.0%} |"
                for s in rows
            ]
    if any("rho" in r for r in records):
        lines += [
            "",
            "| variant | answer position | Spearman rank correlation, attribution vs attention |",
            "|---|---|---|",
        ]
        lines += [f"| `{r['variant']}` | {r['position']} | {r['rho']:.2f} |" for r in records if "rho" in r]
    return "\n".join(lines) + "\n"
