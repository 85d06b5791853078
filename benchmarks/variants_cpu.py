"""Side-by-side forward / forward+backward benchmark of the variants on CPU (issue: subquadratic goals).

    python benchmarks/variants_cpu.py --lengths 1024,4096,16384

Measures, in one process, the median time of each call at B=1, H=8, D=64, float32 (all timings
first, with glibc's allocator as it is), then the peak extra RSS of each call (VmHWM reset through
/proc/self/clear_refs, with glibc's mmap threshold pinned so that every call shows its own
allocations), and prints the ratios the goals are stated in. Each implementation is first checked
against its dense float64 definition (`reference`) at N=300 and is not timed if that fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import variants
from harness.memory import measure_peak, pin_mmap_threshold

CPU = torch.device("cpu")


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dense_check(attn, causal: bool, n: int = 300) -> float:
    """Max abs error of the float32 call against the variant's dense float64 definition."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    with torch.no_grad():
        out = attn(q, k, v, causal=causal)
        ref = attn.double().reference(q.double(), k.double(), v.double(), causal=causal)
        attn.float()
    return (out.double() - ref).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--compression", type=int, default=3)
    p.add_argument("--naive-max", type=int, default=8192, help="largest N for full_naive")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    h, d = 8, 64
    cases = [  # (label, variant, options, causal, passes)
        ("full", "full", {}, False, ("fwd", "fwdbwd")),
        ("full causal", "full", {}, True, ("fwd",)),
        ("full_naive", "full_naive", {}, False, ("fwd", "fwdbwd")),
        ("sliding_window", "sliding_window", {"window": args.window}, False, ("fwd", "fwdbwd")),
        ("sliding_window_flex", "sliding_window_flex", {"window": args.window}, False, ("fwd",)),
        ("flex direct", None, {}, False, ("fwd",)),
        ("linear", "linear", {}, False, ("fwd", "fwdbwd")),
        ("linear causal", "linear", {}, True, ("fwd", "fwdbwd")),
        ("memory_compressed", "memory_compressed", {"compression": args.compression, "num_heads": h, "head_dim": d}, False, ("fwd", "fwdbwd")),
    ]
    calls = []  # (label, n, pass, fn)
    for label, name, opts, causal, passes in cases:
        if name is not None:
            attn = variants.build(name, **opts)
            err = dense_check(attn, causal)
            if err > 1e-4:
                print(f"{label}: dense check failed (max err {err:.2e}); not timed")
                continue
        for n in map(int, args.lengths.split(",")):
            if name == "full_naive" and n > args.naive_max:
                continue
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(1, h, n, d, generator=g) for _ in range(3))
            for pass_ in passes:
                calls.append((label, n, pass_, make_call(name, attn if name else None, q, k, v, causal, pass_, args.window)))
    rows = []
    for label, n, pass_, fn in calls:
        secs = median_time(fn, args.repeats)
        rows.append({"case": label, "n": n, "pass": pass_, "ms": secs * 1e3})
        print(f"time   {label:22s} N={n:6d} {pass_:7s} {secs * 1e3:10.1f} ms", flush=True)
    pinned = pin_mmap_threshold()
    for row, (label, n, pass_, fn) in zip(rows, calls):
        row["peak_mib"] = measure_peak(fn, CPU)["peak_bytes"] / 2**20
        print(f"memory {label:22s} N={n:6d} {pass_:7s} {row['peak_mib']:10.1f} MiB{'' if pinned else ' (allocator not pinned)'}", flush=True)
    print_goals(rows, args.lengths)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def make_call(name, attn, q, k, v, causal, pass_, window):
    if name is None:  # FlexAttention called directly, with a block mask made by torch's own helper
        from torch.nn.attention.flex_attention import create_block_mask

        from variants.sliding_window_flex import compiled_flex_attention

        n = q.shape[-2]
        block_mask = create_block_mask(lambda b, h, qi, ki: (qi - ki).abs() <= window, None, None, n, n, device="cpu")
        flex = compiled_flex_attention()

        def call():
            with torch.no_grad():
                flex(q, k, v, block_mask=block_mask)

        return call
    if pass_ == "fwd":
        def call():
            with torch.no_grad():
                attn(q, k, v, causal=causal)

        return call
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def call():
        attn(qg, kg, vg, causal=causal).sum().backward()
        qg.grad = kg.grad = vg.grad = None

    return call


def print_goals(rows, lengths: str) -> None:
    """The ratios issue 3 states its goals in, at the largest N measured."""
    n = max(map(int, lengths.split(",")))
    at = {(r["case"], r["pass"], r["n"]): r for r in rows}

    def ms(case, pass_="fwd", nn=n):
        row = at.get((case, pass_, nn))
        return row["ms"] if row else float("nan")

    def mib(case, pass_="fwd", nn=n):
        row = at.get((case, pass_, nn))
        return row["peak_mib"] if row else float("nan")

    lines = [  # (what, measured, goal: at most this)
        ("sliding_window_flex / flex direct (fwd)", ms("sliding_window_flex") / ms("flex direct"), 1.1),
        ("sliding_window / flex direct (fwd)", ms("sliding_window") / ms("flex direct"), 2.0),
        ("sliding_window / full (fwd)", ms("sliding_window") / ms("full"), 0.12),
        ("sliding_window fwdbwd / fwd", ms("sliding_window", "fwdbwd") / ms("sliding_window"), 3.5),
        ("sliding_window peak MiB (fwd)", mib("sliding_window"), 256),
        ("linear causal / full causal (fwd)", ms("linear causal") / ms("full causal"), 0.07),
        ("linear / full (fwd)", ms("linear") / ms("full"), 0.015),
        ("linear peak MiB (fwd, causal)", mib("linear causal"), 128),
        ("linear peak MiB (fwd)", mib("linear"), 128),
        ("memory_compressed / full (fwd)", ms("memory_compressed") / ms("full"), 0.4),
        ("memory_compressed peak MiB (fwd)", mib("memory_compressed"), 256),
    ]
    quarter = n // 4
    for case in ("sliding_window", "linear", "linear causal", "memory_compressed"):
        lines.append((f"{case} peak({n}) / peak({quarter}) (fwd)", mib(case) / mib(case, nn=quarter), 4.5))
    print(f"\ngoals at N={n}:")
    for what, value, goal in lines:
        verdict = "met" if value <= goal else f"MISSED by {value / goal - 1:.1%}"
        print(f"  {what:50s} {value:10.4g}   goal <= {goal:<6g} {verdict}")


if __name__ == "__main__":
    main()
