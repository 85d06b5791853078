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
