"""Where full's decoding step loses bandwidth: one step of one query at N = 65536 (B = 1, H = 8, D = 64, float32)
through fused SDPA, SDPA's math backend, and two plain products (q Kᵀ, softmax, · V), each as GB/s of K and V read,
beside the copy bandwidth bench run measures (b.copy_(a) of 256 MiB, read + written), three rounds side by side.

    python scripts/decode_bandwidth.py
"""

import time
import torch
import torch.nn.functional as F
import statistics

torch.set_num_threads(2)
n, h, d = 65536, 8, 64
k = torch.randn(1, h, n, d)
v = torch.randn(1, h, n, d)
q = torch.randn(1, h, 1, d)
src = torch.empty(2**26)
dst = torch.empty_like(src)  # 256 MiB


def t(fn, reps=30):
    for _ in range(3):
        fn()
    xs = []
    for _ in range(reps):
        a = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - a)
    return statistics.median(xs)


def sdpa():
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_math():
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v)


def gemv():
    s = torch.matmul(q, k.transpose(-1, -2)) * d**-0.5
    return torch.matmul(torch.softmax(s, -1), v)


for rnd in range(3):
    copy = t(lambda: dst.copy_(src), 10)
    bw = 2 * src.numel() * 4 / copy / 1e9
    kv = 2 * n * h * d * 4
    res = {name: kv / t(fn) / 1e9 for name, fn in (("sdpa", sdpa), ("sdpa_math", sdpa_math), ("gemv", gemv))}
    print(f"copy {bw:.1f} GB/s | " + " | ".join(f"{k} {v:.1f} GB/s ({v / bw:.0%})" for k, v in res.items()))
