"""Re-time a run's ok cells with a plain in-process loop, and print each harness median beside it.

    python scripts/plain_loop.py results/cpu-reference                        # every ok cell
    python scripts/plain_loop.py RUN_DIR --variants full,linear --lengths 256,2048
    python scripts/plain_loop.py RUN_DIR --rounds 3    # harness and plain loop measured again, alternating

With --rounds K, each cell is measured K times by the harness itself (`worker.measure_cell` in a child
of the fork server, with the run's configuration, as `bench run` does) and K times by the plain loop,
alternating, and the medians of the K are compared: a machine whose speed drifts by more than the
difference looked for (a VM's often does, by 10-20 % over minutes) then drifts under both alike.
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
from harness.core.isolation import run_isolated
from harness.core.calls import make_inputs, pass_call, set_threads
from harness.core.memory import steady_allocator
from harness.store.storage import read_metadata
from harness.sweep import worker
from harness.sweep.config import Cell, RunConfig


def harness_median(config: RunConfig, row: dict) -> float:
    """The cell measured again as bench run measures it: in a child of the fork server."""
    cell = Cell(row["device"], row["variant"], row["pass"], row["causal"], row["n"])
    outcome = run_isolated(worker.measure_cell, (config, cell), timeout=config.cell_timeout)
    if outcome.kind != "result":
        raise RuntimeError(f"{cell.label()}: {outcome.describe()}")
    return outcome.value["time_median_s"]


# The yardstick of "does the harness measure what a user's own loop measures": one process, torch's
# threads set to the cores this process may use, the cell's variant built with the run's options and
# shape, `--warmup` untimed calls, then the median of up to `--calls` timed calls (fewer once
# `--seconds` were timed, at least 5), each call timed alone with perf_counter. The allocator is left
# as the user has it (glibc's defaults), unless `--steady` sets glibc to keep freed memory, as
# `bench run` does while it times. Run it alone on a quiet machine, right after the run it checks.
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
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="stop after 5 calls once this long was timed (default 10)"
    )
    parser.add_argument(
        "--steady", action="store_true", help="glibc keeps freed memory, as bench run sets it while timing"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="measure each cell again this many times with the harness and the "
        "plain loop, alternating (default 0: compare with the run's own medians)",
    )
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in (args.run_dir / "results.jsonl").read_text().splitlines() if line.strip()]
    wanted_variants = set(filter(None, args.variants.split(",")))
    wanted_lengths = {int(n) for n in filter(None, args.lengths.split(","))}
    rows = [
        r
        for r in rows
        if r["status"] == "ok"
        and r["device"] == "cpu"
        and (not wanted_variants or r["variant"] in wanted_variants)
        and (not wanted_lengths or r["n"] in wanted_lengths)
    ]
    if not rows:
        sys.exit(f"no ok CPU cells in {args.run_dir} match --variants {args.variants!r} --lengths {args.lengths!r}")
    threads = set_threads()
    if args.steady:
        steady_allocator()
    torch.manual_seed(0)
    print(
        f"{'variant':20s} {'pass':6s} {'causal':6s} {'N':>6s} {'harness':>10s} {'spread':>7s} {'plain':>10s} {'spread':>7s} {'ratio':>6s}"
    )
    print(
        "(spread: the row's IQR/median; with --rounds, harness: (max - min) / median of its rounds, plain: the median IQR/median)"
    )
    config = RunConfig.from_json(read_metadata(args.run_dir)["config"]) if args.rounds else None
    ratios = []
    for row in rows:
        options = {**row["options"], "num_heads": row["heads"], "head_dim": row["head_dim"]}
        attn = variants.build(row["variant"], device=torch.device("cpu"), **options).to(getattr(torch, row["dtype"]))
        harness, plain, spreads = [], [], []
        for _ in range(max(1, args.rounds)):
            harness.append(harness_median(config, row) if args.rounds else row["time_median_s"])
            median, spread = plain_median(attn, row, warmup=args.warmup, calls=args.calls, seconds=args.seconds)
            plain.append(median)
            spreads.append(spread)
        got, want = statistics.median(harness), statistics.median(plain)
        ratios.append(got / want)
        print(
            f"{row['variant']:20s} {row['pass']:6s} {str(row['causal']):6s} {row['n']:6d} {got * 1e3:8.3f}ms "
            f"{row['spread'] if not args.rounds else (max(harness) - min(harness)) / got:7.1%} {want * 1e3:8.3f}ms "
            f"{statistics.median(spreads):7.1%} {got / want:6.3f}",
            flush=True,
        )
    within = sum(abs(r - 1) <= 0.05 for r in ratios)
    geomean = statistics.geometric_mean(ratios)
    print(
        f"{len(ratios)} cells, {threads} threads{', steady allocator' if args.steady else ''}"
        f"{f', {args.rounds} alternating rounds' if args.rounds else ''}: harness / plain "
        f"geometric mean {geomean:.3f}, range {min(ratios):.3f}-{max(ratios):.3f}, {within} within 5%"
    )


if __name__ == "__main__":
    main()
