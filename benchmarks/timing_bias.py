"""Does `bench run` time what a plain loop times? Each cell in a fresh process of its own, measured there by a
plain loop and by the harness, alternating, and by the harness with one of its differences from a loop taken away.

    python benchmarks/timing_bias.py --variants full,linear,sliding_window --lengths 2048 --passes fwd,fwdbwd
    python benchmarks/timing_bias.py ... --limit 0.10      # exit 1 when a cell's harness / plain is off by > 10%

Methods, each the median of --rounds measurements taken in turn within the cell's process:
- plain: warm-up of --warmup seconds, then the median of 30 calls each timed alone (perf_counter), glibc held
  steady as the harness holds it (`memory.steady_allocator`), torch's threads from the affinity mask.
- harness: `worker.measure_cell`, all of it: the memory limit (RLIMIT_DATA), warm-up, calls per sample, noise.
- no-limit: the same without the memory limit; one-call: the same with one call a sample.
- forked: `worker.measure_cell` in a child of the fork server, as `bench run` runs a cell.
A ratio harness / plain far from 1 that one of the others closes names the cause. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace

METHODS = ("plain", "harness", "no-limit", "one-call", "forked")
CALLS = 30  # timed calls of the plain loop


def _config(variant: str, n: int, pass_: str, causal: bool, budget: int):
    from harness.sweep.plan import build_run_config

    config = build_run_config(
        variants=variant,
        lengths=(n,),
        devices="cpu",
        passes=pass_,
        causal=(causal,),
        options={},
        imports=[],
        min_time=1.0,
        cell_timeout=600,
    )
    return replace(config, memory_budget=(("cpu", budget),))


def _plain(config, cell, warmup_s: float) -> float:
    import torch

    import variants
    from harness.core.calls import make_inputs, pass_call, set_threads
    from harness.core.memory import steady_allocator

    set_threads(config.threads)
    steady_allocator()  # (measure_cell pins the mmap threshold once it has timed: undone here)
    attn = variants.build(cell.variant, device=torch.device("cpu"), **config.variant_options(cell.variant))
    backward = cell.pass_ == "fwdbwd"
    q, k, v = make_inputs(config.batch, config.heads, cell.n, config.head_dim, config.dtype, "cpu", backward)
    call = pass_call(attn, q, k, v, causal=cell.causal, backward=backward)
    began = time.perf_counter()
    while time.perf_counter() - began < warmup_s:
        call()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(method: str, config, cell, warmup_s: float) -> float:
    from harness.core import timing
    from harness.core.isolation import run_isolated
    from harness.sweep import worker

    if method == "plain":
        return _plain(config, cell, warmup_s)
    if method == "forked":
        outcome = run_isolated(worker.measure_cell, (config, cell), timeout=config.cell_timeout)
        if outcome.kind != "result":
            raise RuntimeError(f"{cell.label()}: {outcome.describe()}")
        return outcome.value["time_median_s"]
    if method == "no-limit":
        return worker.measure_cell(replace(config, memory_budget=()), cell)["time_median_s"]
    if method == "one-call":
        saved, timing.CPU_MIN_SAMPLE_S = timing.CPU_MIN_SAMPLE_S, 0.0
        try:
            return worker.measure_cell(config, cell)["time_median_s"]
        finally:
            timing.CPU_MIN_SAMPLE_S = saved
    return worker.measure_cell(config, cell)["time_median_s"]


def one_cell(variant: str, n: int, pass_: str, causal: bool, rounds: int, warmup_s: float, budget: int) -> dict:
    """In this process: every method's median of `rounds` measurements of the cell, taken in turn."""
    from harness.sweep.config import Cell

    config = _config(variant, n, pass_, causal, budget)
    cell = Cell("cpu", variant, pass_, causal, n)
    got: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(rounds):
        for method in METHODS:
            got[method].append(_measure(method, config, cell, warmup_s))
    return {
        "variant": variant,
        "n": n,
        "pass": pass_,
        "causal": causal,
        **{m: statistics.median(got[m]) for m in METHODS},
    }


def in_fresh_process(variant: str, n: int, pass_: str, causal: bool, rounds: int, warmup_s: float) -> dict:
    """`one_cell` in a new Python process (nothing of this one's history: its allocator, threads, imports)."""
    budget = _available_bytes() // 2
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); from timing_bias import one_cell; "
        f"print(json.dumps(one_cell({variant!r}, {n}, {pass_!r}, {causal}, {rounds}, {warmup_s}, {budget})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} N={n} {pass_}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="full,linear,sliding_window")
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--passes", default="fwd,fwdbwd")
    parser.add_argument("--causal", action="store_true", help="causal cells (default: not causal, as bench run's auto)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each method, in turn (default 3)")
    parser.add_argument("--warmup", type=float, default=1.0, help="the plain loop's warm-up in seconds (default 1)")
    parser.add_argument("--limit", type=float, default=None, help="exit 1 when |harness / plain - 1| > this")
    args = parser.parse_args(argv)
    print(f"{'cell':28s}" + "".join(f"{m:>10s}" for m in METHODS) + "   harness/plain  forked/plain")
    off = []
    for variant in args.variants.split(","):
        for n in (int(x) for x in args.lengths.split(",")):
            for pass_ in args.passes.split(","):
                r = in_fresh_process(variant, n, pass_, args.causal, args.rounds, args.warmup)
                ratio, forked = r["harness"] / r["plain"], r["forked"] / r["plain"]
                label = f"{variant} {pass_} N={n}"
                print(
                    f"{label:28s}"
                    + "".join(f"{r[m] * 1e3:8.2f}ms" for m in METHODS)
                    + f"   {ratio:13.3f}  {forked:12.3f}"
                )
                if args.limit is not None and max(abs(ratio - 1), abs(forked - 1)) > args.limit:
                    off.append(label)
    if off:
        print(f"off by more than {args.limit:.0%}: {', '.join(off)}")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
