"""What every figure shares: matplotlib's settings, each variant's colour and marker, captions, the panel grid,
and saving byte-identically. The figures: speed/plots.py, quality/plots.py, lm/figures.py.

Figures read a run directory only (never measure). One figure per question, one panel per (device, pass,
causal). Output is deterministic: the same run gives byte-identical files.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

FORMATS = ("png", "svg", "pdf")


# a variant's colour and marker come from its spec (`style`, recorded in a run's metadata); names without one get a stable pick
_FALLBACK_COLORS = ["#8c564b", "#e377c2", "#bcbd22", "#ff7f0e", "#aec7e8", "#ffbb78", "#c5b0d5"]


_FALLBACK_MARKERS = ["<", ">", "h", "*", "p", "d", "8"]


def matplotlib_rc() -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    matplotlib.rcParams["svg.hashsalt"] = "attnbench"  # deterministic SVG ids


def variant_style(name: str, facts: dict | None = None) -> tuple[str, str]:
    """(colour, marker) of variant `name`: its spec's `style` as `facts` ({variant: facts}, a run's
    metadata["variants"]) recorded it, else a stable pick from the name."""
    style = ((facts or {}).get(name) or {}).get("style")
    if style:
        return style[0], style[1]
    h = zlib.crc32(name.encode())
    return _FALLBACK_COLORS[h % len(_FALLBACK_COLORS)], _FALLBACK_MARKERS[(h // 7) % len(_FALLBACK_MARKERS)]


def fmt_n(n: float) -> str:
    n = int(n)
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def caption(metadata: dict) -> str:
    env, cfg = metadata.get("environment", {}), metadata.get("config", {})
    gpu = (metadata.get("machine") or {}).get("gpu") or {}
    cpu = env.get("cpu", {})
    machine = f"{cpu.get('model') or 'CPU'} ({cpu.get('usable_cores') or cpu.get('cores')} cores)"
    if gpu.get("name"):
        machine += f", {gpu['name']}"
    nodes = (metadata.get("machine") or {}).get("nodes")
    if nodes:  # a run on a cluster (--executor ray): the hardware of its nodes, not the driver's
        kinds = dict.fromkeys(n["gpu_name"] if n.get("gpus") else n["cpu_model"] for n in nodes)
        machine = f"Ray cluster of {len(nodes)} node{'s' if len(nodes) > 1 else ''}: " + ", ".join(
            str(k) for k in kinds
        )
    if "d_model" in cfg:  # a quality run: the model's shape
        shape = (
            f"d_model={cfg.get('d_model')} layers={cfg.get('layers')} heads={cfg.get('heads')} batch={cfg.get('batch')}"
        )
    else:
        kv = f" on {cfg['kv_heads']} K/V" if cfg.get("kv_heads") else ""
        shape = f"B={cfg.get('batch')} H={cfg.get('heads')}{kv} D={cfg.get('head_dim')}"
    return f"{machine} · {cfg.get('dtype', 'float32')} · {shape} · torch {env.get('versions', {}).get('torch')}"


def grid(n_panels: int, max_cols: int, panel_size: tuple[float, float]):
    """A figure of n_panels axes, at most max_cols a row, the unused cells hidden: (fig, the axes)."""
    matplotlib_rc()
    import matplotlib.pyplot as plt

    cols = min(max_cols, n_panels)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(panel_size[0] * cols, panel_size[1] * rows), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n_panels])


def save_figure(fig, path: Path) -> Path:
    """Save without the timestamps and version strings that would make two saves differ."""
    fmt = path.suffix.lstrip(".") or "png"
    metadata = {
        "png": {"Software": None},
        "svg": {"Date": None, "Creator": None},
        "pdf": {"CreationDate": None, "Creator": None, "Producer": None},
    }[fmt]
    matplotlib_rc()
    fig.savefig(path, format=fmt, dpi=110, metadata=metadata, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
