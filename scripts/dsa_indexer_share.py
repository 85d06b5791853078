"""How much of DeepSeek Sparse Attention's forward its lightning indexer takes: the whole causal forward, and
its selection alone (the indexer's scores and each query's top_k, block by block as the forward runs them),
the median of a few calls each (timed as `bench run` times a cell), side by side in one process.

    python scripts/dsa_indexer_share.py            # N = 16384, B = 1, H = 8, D = 64, float32, top_k 2048
    python scripts/dsa_indexer_share.py --n 4096 --calls 5
"""

from __future__ import annotations

import argparse
import statistics

import torch

import variants
from harness.core.timing import measure_time
from variants._utils import spans


def median_time(call, calls: int) -> float:
    """Seconds a call, timed as `bench run` times a cell (warm-up, then the median of `calls` samples)."""
    timing = measure_time(call, torch.device("cpu"), warmup=1, repeats=calls, min_time=0.0, min_repeats=calls)
    return statistics.median(timing.times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384, help="sequence length N")
    parser.add_argument("--calls", type=int, default=3, help="timed calls of each (median)")
    args = parser.parse_args()
    torch.manual_seed(0)
    attn = variants.build("dsa", num_heads=8, head_dim=64)
    q, k, v = (torch.randn(1, 8, args.n, 64) for _ in range(3))

    def select():
        k_index = attn.indexer.keys(k)
        for rows in spans(args.n, attn.block):
            attn._chosen(q[:, :, rows], k[:, :, : rows.stop], k_index[:, :, : rows.stop], None)

    with torch.no_grad():
        whole = median_time(lambda: attn(q, k, v, causal=True), args.calls)
        chosen = median_time(select, args.calls)
    print(f"dsa at N={args.n} (top_k {attn.top_k}, {torch.get_num_threads()} threads, {args.calls} calls a median)")
    print(f"forward {whole:.2f} s; indexer and selection {chosen:.2f} s: {chosen / whole:.0%} of it")


if __name__ == "__main__":
    main()
