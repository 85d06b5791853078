"""The measured point beside `bench memory`: a training step through L attention layers, its peak measured.

    python scripts/memory_claim.py --variant full_naive --lengths 4000 --layers 1,2

Each (variant, N, L) runs in a fresh process: L calls of the variant one after another (each layer's output the
next one's q, k and v), then the backward of their sum, and the process's resident-set high-water mark over the
step (harness.core.memory.measure_peak). Beside it, `bench memory`'s prediction for the same shape: kept x L plus
one call's peak. The defaults are the shape docs/speed.md checks the "4000 tokens need 16 GB" claim at.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

STEP = r"""
import json, sys, torch, variants
from harness.core.memory import measure_peak, pin_mmap_threshold
name, n, layers, heads, head_dim = sys.argv[1], *map(int, sys.argv[2:6])
torch.manual_seed(0)
attn = variants.build(name, num_heads=heads, head_dim=head_dim)
x = torch.randn(1, heads, n, head_dim, requires_grad=True)
def step():
    h = x
    for _ in range(layers):
        h = attn(h, h, h, causal=True)
    h.sum().backward()
    x.grad = None
pin_mmap_threshold()
print(json.dumps(measure_peak(step, torch.device("cpu"))["peak_bytes"]))
"""


def measured(name: str, n: int, layers: int, heads: int, head_dim: int) -> int:
    args = [sys.executable, "-c", STEP, name, str(n), str(layers), str(heads), str(head_dim)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="full_naive,full")
    parser.add_argument("--lengths", default="4000")
    parser.add_argument("--layers", default="1,2")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    from harness.core.kept import Shape, model_memory

    shape = Shape(1, args.heads, args.heads, args.head_dim)
    gib = 2**30
    print(f"{'variant':<12} {'N':>6} {'L':>3} {'measured GiB':>13} {'predicted GiB':>14} {'ratio':>6}")
    for name in args.variant.split(","):
        for n in map(int, args.lengths.split(",")):
            for layers in map(int, args.layers.split(",")):
                got = measured(name, n, layers, args.heads, args.head_dim)
                want = model_memory(name, {}, n, shape, layers, True, budget=2**62)["total"]
                print(f"{name:<12} {n:>6} {layers:>3} {got / gib:>13.3f} {want / gib:>14.3f} {got / want:>6.2f}")


if __name__ == "__main__":
    main()
