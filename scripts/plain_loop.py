"""Re-time a run's ok cells with a plain in-process loop, and print each harness median beside it.

    python scripts/plain_loop.py results/cpu-reference                        # every ok cell
    python scripts/plain_loop.py RUN_DIR --variants full,linear --lengths 256,2048

The yardstick of "does the harness measure what a user's own loop measures": one process, torch's
threads set to the cores this process may use, the cell's variant built with the run's options and
shape, `--warmup` untimed calls, then the median of up to `--calls` timed calls (fewer once
`--seconds` were timed, at least 5), each call timed alone with perf_counter. The allocator is left
as the user has it (glibc's defaults), unless `--steady` sets glibc to keep freed memory, as
`bench run` does while it times. Run it alone on a quiet machine, right after the run it checks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import variants
from harness.measure import make_inputs, pass_call, set_threads
from harness.memory import steady_allocator


def plain_median(attn, row: dict, *, warmup: int, calls: int, seconds: float) -> tuple[float, float]:
    """(median seconds per call, IQR / median) of the row's call in this process."""
    backward = row["pass"] == "fwdbwd"
    q, k, v = make_inputs(row["batch"], row["heads"], row["n"], row["head_dim"], row["dtype"], "cpu", backward)
    call = pass_call(attn, q, k, v, causal=row["causal"], backward=backward)
    for _ in range(warmup):
        call()
    times: list[float] = []
    while len(times) < calls and (len(times) < 5 or sum(times) < seconds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return median, (q3 - q1) / median


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--variants", default="", help="only these variants (comma-separated)")
    parser.add_argument("--lengths", default="", help="only these N (comma-separated)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    parser.add_argument("--calls", type=int, default=30, help="at most this many timed calls (default 30)")
    parser.add_argument("--seconds", type=float, default=10.0, help="stop after 5 calls once this long was timed (default 10)")
    parser.add_argument("--steady", action="store_true", help="glibc keeps freed memory, as bench run sets it while timing")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in (args.run_dir / "results.jsonl").read_text().splitlines() if line.strip()]
    wanted_variants = set(filter(None, args.variants.split(",")))
    wanted_lengths = {int(n) for n in filter(None, args.lengths.split(","))}
    rows = [r for r in rows if r["status"] == "ok" and r["device"] == "cpu"
            and (not wanted_variants or r["variant"] in wanted_variants) and (not wanted_lengths or r["n"] in wanted_lengths)]
    if not rows:
        sys.exit(f"no ok CPU cells in {args.run_dir} match --variants {args.variants!r} --lengths {args.lengths!r}")
    threads = set_threads()
    if args.steady:
        steady_allocator()
    torch.manual_seed(0)
    print(f"{'variant':20s} {'pass':6s} {'causal':6s} {'N':>6s} {'harness':>10s} {'spread':>7s} {'plain':>10s} {'spread':>7s} {'ratio':>6s}")
    ratios = []
    for row in rows:
        options = {**row["options"], "num_heads": row["heads"], "head_dim": row["head_dim"]}
        attn = variants.build(row["variant"], device=torch.device("cpu"), **options).to(getattr(torch, row["dtype"]))
        median, spread = plain_median(attn, row, warmup=args.warmup, calls=args.calls, seconds=args.seconds)
        ratio = row["time_median_s"] / median
        ratios.append(ratio)
        print(f"{row['variant']:20s} {row['pass']:6s} {str(row['causal']):6s} {row['n']:6d} {row['time_median_s'] * 1e3:8.3f}ms "
              f"{row['spread']:7.1%} {median * 1e3:8.3f}ms {spread:7.1%} {ratio:6.3f}")
    within = sum(abs(r - 1) <= 0.05 for r in ratios)
    geomean = statistics.geometric_mean(ratios)
    print(f"{len(ratios)} cells, {threads} threads{', steady allocator' if args.steady else ''}: harness / plain "
          f"geometric mean {geomean:.3f}, range {min(ratios):.3f}-{max(ratios):.3f}, {within} within 5%")


if __name__ == "__main__":
    main()
