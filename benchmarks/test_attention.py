"""One benchmark per (variant, N, pass, causal); a table per (pass, N, causal) puts the variants side by side.

Each variant passes the correctness gate of `bench run` (outputs and gradients against its dense
float64 definition) before it is timed; torch's FlexAttention, called directly, is the yardstick
of the sliding-window variants. extra_info: useful FLOPs, GFLOP/s and the fraction of the measured
matmul peak (and the peak extra memory with --bench-memory).
"""

from __future__ import annotations

import pytest

from harness.core import measure
from harness.core.calls import pass_call
from harness.core.timing import warmed


def test_attention(benchmark, suite, case):
    reason = suite.skip_reason(case)
    if reason:
        pytest.skip(reason)
    attn = suite.gated(case)
    q, k, v = suite.inputs(case)
    call = pass_call(attn, q, k, v, causal=case.causal, backward=case.pass_ == "fwdbwd", sync=True)
    warmed(
        call, suite.device, warmup=1
    )  # as bench run: compilation (FlexAttention compiles per shape), steady allocator
    benchmark.group = case.group
    flops = suite.flops(case, attn)
    benchmark.extra_info.update(
        variant=case.variant,
        n=case.n,
        pass_=case.pass_,
        causal=case.causal,
        flops=flops,
        threads=measure.torch.get_num_threads(),
        matmul_peak_gflops=suite.peak_gflops,
    )
    benchmark(call)
    stats = getattr(benchmark, "stats", None)
    if stats is not None and not suite.disabled:
        median = stats.stats.median
        benchmark.extra_info["gflops"] = flops / median / 1e9
        benchmark.extra_info["fraction_of_peak"] = (
            flops / median / 1e9 / suite.peak_gflops if suite.peak_gflops else None
        )
    if suite.memory:  # after timing, as bench run does: pinned to make allocations visible, then steady again
        from harness.core.memory import measure_peak, pin_mmap_threshold, steady_allocator

        pin_mmap_threshold()
        benchmark.extra_info["peak_bytes"] = measure_peak(call, suite.device)["peak_bytes"]
        steady_allocator()
