"""The measuring core, shared by `bench run`'s worker and the micro-benchmarks in `benchmarks/`.

    set_threads()                                   # CPU threads from the affinity mask
    q, k, v = make_inputs(b, h, n, d, "float32", "cpu", requires_grad=True)
    verdict = gate(attn, b, h, n, d, "float32", "cpu", causal=False, backward=True)  # before any timing
    call = pass_call(attn, q, k, v, causal=False, backward=True)
    timing = measure_time(call, torch.device("cpu"), warmup=1, repeats=10, min_time=1.0)

Everything here works on one process's tensors; where a call runs (a fresh child per cell, or a
pytest session) is the caller's business.

The calls (calls.py), the correctness gate (gate.py) and timing (timing.py) are re-exported here; this
module measures the machine's limits itself: matmul throughput and memory bandwidth.
"""

from __future__ import annotations

import torch

from harness.core.timing import clock_for, warm_up


def memory_bandwidth(device: str, threads: int = 0, seconds: float = 1.0) -> dict:
    """Measured memory bandwidth (GB/s) of a STREAM-style copy through torch (b.copy_(a) of 256 MiB on the CPU,
    1 GiB on CUDA; bytes read + written per second): the limit of a decoding step, which reads its state once."""
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    nbytes = 2**30 if dev.type == "cuda" else 2**28
    a = torch.ones(nbytes // 4, device=dev)
    b = torch.empty_like(a)
    clock = clock_for(dev)
    warm_up(lambda: b.copy_(a), clock, calls=2, seconds=0.0)
    calls, elapsed = 0, 0.0
    while elapsed < seconds or calls < 3:
        clock.start()
        b.copy_(a)
        elapsed += clock.stop()
        calls += 1
    return {"gbs": 2 * nbytes * calls / elapsed / 1e9, "bytes": nbytes, "calls": calls}


def matmul_peak(device: str, dtype: str, threads: int = 0, seconds: float = 1.0) -> dict:
    """Measured dense matmul throughput (GFLOP/s): the machine's practical limit for reports.

    The products are enqueued back to back and the device synchronized once per batch, as attention
    kernels run. On CUDA, float32 is measured with TF32 tensor cores allowed: the fused attention
    kernels use them for float32, and a peak below what they reach would put a "fraction of peak" above 1.
    """
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    precision = dtype
    if dev.type == "cuda" and dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = True  # this process only (a child of bench run, or a benchmark session)
        precision = "float32 (TF32 tensor cores allowed)"
    n = 4096 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    clock = clock_for(dev)
    warm_up(lambda: a @ b, clock, calls=3, seconds=0.0)
    calls, elapsed, batch = 0, 0.0, 1
    while elapsed < seconds or calls < 3:
        clock.start()
        for _ in range(batch):
            a @ b
        elapsed += clock.stop()
        calls += batch
        batch = min(batch * 2, 64)
    return {"gflops": 2 * n**3 * calls / elapsed / 1e9, "n": n, "calls": calls, "precision": precision}
