"""The speed and memory ratios of the sliding-window and memory-compressed goals, side by side in one process.

    python scripts/window_goals.py                              # N = 16384, B = 1, H = 8, D = 64, w = 256, c = 3
    python scripts/window_goals.py --out results/window-goals/cpu-16384.json
    python scripts/window_goals.py --before 044c749             # and the three methods' files at that commit, beside
    PYTHONPATH=DIR python scripts/window_goals.py --import MODULE --also NAME   # another implementation beside ours

Times: every call is timed once per round, the calls taking turns (A B C A B C ...), so a machine whose speed
drifts over minutes (a VM's does, by 10-20 %) drifts under every call alike; each ratio is the median over the
rounds of that round's ratio. The calls: `sliding_window` forward and forward+backward, `sliding_window_flex`
forward, torch's FlexAttention called directly with torch's own `create_block_mask` (the yardstick), causal and
not. Memory: each call's peak extra bytes beyond its inputs (`harness.core.memory.measure_peak`, glibc's mmap threshold
pinned before the first allocation), each in a fresh process of its own, for those and `full` (fused SDPA) and `memory_compressed`, plus
sliding_window's forward+backward at --flat-lengths: its peak beyond the output and the three input gradients,
which should not grow with N. Run it alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

B, H, D = 1, 8, 64


def _inputs(n: int, grad: bool):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, n, D, generator=g).requires_grad_(grad) for _ in range(3)]


def build_call(name: str, n: int, pass_: str, causal: bool, window: int, compression: int):
    """A no-argument call of one (method, pass, causal) at N; `flex_direct` is FlexAttention called directly."""
    import variants
    from harness.core.calls import pass_call

    backward = pass_ == "fwdbwd"
    q, k, v = _inputs(n, backward)
    if name == "flex_direct":
        from torch.nn.attention.flex_attention import create_block_mask

        from variants.methods.sliding_window_flex import compiled_flex_attention

        def band(b, h, i, j):
            near = (i - j).abs() <= window
            return near & (j <= i) if causal else near

        mask = create_block_mask(band, None, None, n, n, device="cpu")
        flex = compiled_flex_attention("cpu")

        def call():
            with torch.no_grad():
                flex(q, k, v, block_mask=mask, scale=D**-0.5)

        return call
    options = {"window": window} if "sliding" in name else {}
    if name.startswith("memory_compressed"):
        options = {"compression": compression, "num_heads": H, "head_dim": D}
    attn = variants.build(name, **options)
    return pass_call(attn, q, k, v, causal=causal, backward=backward)


def peak_in_child(
    name: str, n: int, pass_: str, causal: bool, window: int, compression: int, imports: list[str]
) -> int:
    """Peak extra bytes of one call, measured in a fresh process: glibc's mmap threshold pinned before anything
    is allocated, then one untimed call (FlexAttention compiles), then the measured one. (Pinned only after calls
    under glibc's default, as `bench run` does after its timing, the same call reads ±10 MiB from one process
    to the next, from what the heap kept.)"""
    code = (
        "import sys, json, torch\n"
        f"for m in {imports!r}: __import__(m)\n"
        "sys.path.insert(0, 'scripts')\n"
        "from window_goals import build_call\n"
        "from harness.core.memory import measure_peak, pin_mmap_threshold\n"
        "pin_mmap_threshold()\n"
        f"call = build_call({name!r}, {n}, {pass_!r}, {causal}, {window}, {compression})\n"
        "call()\n"
        "print(json.dumps(measure_peak(call, torch.device('cpu'))['peak_bytes']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


BEFORE_FILES = {
    "sliding_window": "sliding_window_before",
    "sliding_window_flex": "sliding_window_flex_before",
    "memory_compressed": "memory_compressed_before",
}


def load_before(rev: str) -> list[str]:
    """The three methods' files at git revision `rev`, registered as NAME_before (module and spec renamed, the
    package's relative imports made absolute) from a temporary folder put on the path of this process and its
    children. Returns the variant names."""
    folder = tempfile.mkdtemp(prefix="window-goals-")
    for name, before in BEFORE_FILES.items():
        text = subprocess.run(
            ["git", "show", f"{rev}:variants/methods/{name}.py"], capture_output=True, text=True, check=True
        ).stdout
        text = re.sub(r"from \.\.(\w+) import", r"from variants.\1 import", text)
        text = re.sub(
            r"from \.(\w+) import", lambda m: f"from {BEFORE_FILES.get(m[1], 'variants.methods.' + m[1])} import", text
        )
        text = text.replace(f'name="{name}",', f'name="{before}",').replace(
            'same_function_as="sliding_window",', 'same_function_as="sliding_window_before",'
        )
        with open(os.path.join(folder, f"{before}.py"), "w") as f:
            f.write(text)
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join([folder, *filter(None, [os.environ.get("PYTHONPATH")])])
    return list(BEFORE_FILES.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--compression", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--flat-lengths", default="4096,16384,65536")
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], help="a module that registers --also variants"
    )
    parser.add_argument(
        "--also", action="append", default=[], help="another registered variant timed and measured beside"
    )
    parser.add_argument(
        "--before", metavar="REV", help="also the three methods' files at this git revision, as NAME_before"
    )
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    if args.before:
        names = load_before(args.before)
        args.imports += names
        args.also += names
    for module in args.imports:
        importlib.import_module(module)
    torch.manual_seed(0)
    n, w, c = args.n, args.window, args.compression
    windows = ["sliding_window", *[a for a in args.also if "sliding" in a and "flex" not in a]]
    flexes = ["sliding_window_flex", *[a for a in args.also if "flex" in a]]
    timed = [(name, p, causal) for causal in (False, True) for name in windows for p in ("fwd", "fwdbwd")]
    timed += [(name, "fwd", causal) for causal in (False, True) for name in ["flex_direct", *flexes]]
    calls = {(name, p, causal): build_call(name, n, p, causal, w, c) for name, p, causal in timed}
    for call in calls.values():  # compile (FlexAttention, per shape), steady allocator
        call()
        call()
    times = {key: [] for key in calls}
    for r in range(args.rounds):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - start)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    result = {
        "command": " ".join(["python", "scripts/window_goals.py", *sys.argv[1:]]),
        "before": args.before,
        "n": n,
        "window": w,
        "compression": c,
        "shape": [B, H, D],
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "median_ms": {
            f"{k[0]} {k[1]} {'causal' if k[2] else 'bidir'}": statistics.median(v) * 1e3 for k, v in times.items()
        },
        "ratios": {},
        "peak_mib": {},
        "flat_beyond_io_mib": {},
    }
    for causal in (False, True):
        mode = "causal" if causal else "bidir"
        for name in windows:
            result["ratios"][f"{name} fwdbwd / fwd, {mode}"] = ratio((name, "fwdbwd", causal), (name, "fwd", causal))
            result["ratios"][f"{name} fwd / flex_direct, {mode}"] = ratio(
                (name, "fwd", causal), ("flex_direct", "fwd", causal)
            )
        for name in flexes:
            result["ratios"][f"{name} / flex_direct, {mode}"] = ratio(
                (name, "fwd", causal), ("flex_direct", "fwd", causal)
            )
    measured = [
        (name, p, causal)
        for causal in (False, True)
        for p in ("fwd", "fwdbwd")
        for name in [
            "full",
            *windows,
            "memory_compressed",
            *[a for a in args.also if a.startswith("memory_compressed")],
        ]
    ]
    for name, p, causal in measured:
        label = f"{name} {p} {'causal' if causal else 'bidir'}"
        result["peak_mib"][label] = peak_in_child(name, n, p, causal, w, c, args.imports) / 2**20
        print(f"{label}: {result['peak_mib'][label]:.1f} MiB", file=sys.stderr, flush=True)
    for length in (int(x) for x in args.flat_lengths.split(",") if x):
        io = 4 * B * H * length * D * 4  # the output and dq, dk, dv (float32)
        for name in windows:
            for causal in (False, True):
                label = f"{name} N={length} {'causal' if causal else 'bidir'}"
                result["flat_beyond_io_mib"][label] = (
                    peak_in_child(name, length, "fwdbwd", causal, w, c, args.imports) - io
                ) / 2**20
                print(f"{label}: {result['flat_beyond_io_mib'][label]:.1f} MiB beyond", file=sys.stderr, flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
