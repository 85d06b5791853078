"""Error against time: how close each approximation of softmax attention comes, and what it costs, as its knob varies.

    python scripts/error_vs_time.py results/tradeoff/cpu-4096                # N = 4096, B = 1, H = 8, D = 64, forward
    python scripts/error_vs_time.py OUT --n 2048 --causal                     # causal (linformer, nystrom: not causal)

For each point — performer with features 16 … 1024, nystrom with landmarks 8 … 512, linformer (at its
initialisation) with rank 32 … 1024, linear with each feature map, and full as the time's yardstick —
one process measures the forward time with the harness's measuring core (`harness.core.timing.measure_time`:
steady allocator, warm-up, calibrated samples, the median) and the relative error ‖out − exact‖ / ‖exact‖
of the output against exact softmax attention computed in float64, on the same standard-normal inputs
(`harness.core.calls.make_inputs`, the gate's). Writes OUT/tradeoff.json (the points and the machine) and
OUT/error_vs_time.png. Run it alone on a quiet machine: the times are side by side in one process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import variants
from harness.core.calls import make_inputs, pass_call, set_threads
from harness.core.timing import measure_time, timing_stats
from harness.core.machine import environment

KNOBS = {  # variant -> (option, values): what trades accuracy for time
    "performer": ("features", (16, 32, 64, 128, 256, 512, 1024)),
    "nystrom": ("landmarks", (8, 16, 32, 64, 128, 256, 512)),
    "linformer": ("rank", (32, 64, 128, 256, 512, 1024)),
    "linear": ("feature_map", ("elu", "relu", "cosformer", "taylor")),
}


def exact_output(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v in float64, 256 queries at a time (a (B, H, 256, N) block of scores at once)."""
    q, k, v = q.double(), k.double(), v.double()
    n = k.shape[-2]
    out = []
    for start in range(0, q.shape[-2], 256):
        s = torch.matmul(q[:, :, start : start + 256], k.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(start, min(start + 256, q.shape[-2]))[:, None]
            s = s.masked_fill(torch.arange(n)[None, :] > rows, float("-inf"))
        out.append(torch.matmul(torch.softmax(s, -1), v))
    return torch.cat(out, 2)


def point(name: str, options: dict, q, k, v, exact, causal: bool, min_time: float) -> dict:
    b, h, n, d = q.shape
    attn = variants.build(name, num_heads=h, head_dim=d, **({"max_len": n} if name == "linformer" else {}), **options)
    with torch.no_grad():
        out = attn(q, k, v, causal=causal)
    error = ((out.double() - exact).norm() / exact.norm()).item()
    call = pass_call(attn, q, k, v, causal=causal, backward=False)
    timing = measure_time(call, torch.device("cpu"), warmup=1, repeats=5, min_time=min_time)
    return {
        "variant": name,
        "options": options,
        "error": error,
        "time_median_s": timing_stats(timing.times)["time_median_s"],
        "samples": len(timing.times),
    }


def draw(points: list[dict], out: Path, n: int, causal: bool) -> Path:
    from harness.readers.plots import matplotlib_rc, save_figure, variant_style

    matplotlib_rc()
    import matplotlib.pyplot as plt

    facts = {name: variants.variant_class(name).spec.facts() for name in variants.available()}
    fig, ax = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    full = next(p["time_median_s"] for p in points if p["variant"] == "full")
    ax.axvline(full * 1e3, color=variant_style("full", facts)[0], ls="--", lw=1)
    ax.text(full * 1e3, 1.0, " full (exact)", color=variant_style("full", facts)[0], fontsize=8, va="top")
    for name, (option, _) in KNOBS.items():
        mine = [p for p in points if p["variant"] == name]
        if not mine:
            continue
        color, marker = variant_style(name, facts)
        xs, ys = [p["time_median_s"] * 1e3 for p in mine], [p["error"] for p in mine]
        ax.plot(xs, ys, marker=marker, color=color, label=f"{name} ({option})", lw=1.2 if name != "linear" else 0)
        for p, x, y in zip(mine, xs, ys):
            ax.annotate(
                str(p["options"][option]), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6, color=color
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("forward time (ms, median)")
    ax.set_ylabel("relative error vs exact softmax (‖out − exact‖ / ‖exact‖)")
    ax.set_title(
        f"Error against time, N={n}, B=1, H=8, D=64, {'causal' if causal else 'non-causal'}, standard-normal inputs",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out / "error_vs_time.png")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per point (default 1)")
    args = parser.parse_args(argv)
    if args.n < 512:
        parser.error(f"--n {args.n}: at least 512 (nystrom's largest knob value is 512 landmarks)")
    set_threads()
    q, k, v = make_inputs(1, 8, args.n, 64, "float32", "cpu", False)
    exact = exact_output(q, k, v, args.causal, 64**-0.5)
    todo = [("full", {})] + [(name, {option: value}) for name, (option, values) in KNOBS.items() for value in values]
    points, started = [], time.time()
    for index, (name, options) in enumerate(todo, 1):
        if variants.variant_class(name).mode_unsupported_reason(args.causal):
            continue
        points.append(point(name, options, q, k, v, exact, args.causal, args.min_time))
        p = points[-1]
        print(
            f"[{index}/{len(todo)}] {name} {options}: error {p['error']:.4f}, {p['time_median_s'] * 1e3:.1f} ms",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "python scripts/error_vs_time.py " + " ".join(argv),
        "n": args.n,
        "causal": args.causal,
        "shape": {"batch": 1, "heads": 8, "head_dim": 64},
        "inputs": "standard normal (harness.core.calls.make_inputs)",
        "seconds": round(time.time() - started, 1),
        "environment": environment(sys.argv),
        "points": points,
    }
    (args.out / "tradeoff.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out / 'tradeoff.json'} and {draw(points, args.out, args.n, args.causal)}")


if __name__ == "__main__":
    main(sys.argv[1:])
