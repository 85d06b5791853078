"""The measuring core, shared by `bench run`'s worker and the micro-benchmarks in `benchmarks/`.

    set_threads()                                   # CPU threads from the affinity mask
    q, k, v = make_inputs(b, h, n, d, "float32", "cpu", requires_grad=True)
    verdict = gate(attn, b, h, n, d, "float32", "cpu", causal=False, backward=True)  # before any timing
    call = pass_call(attn, q, k, v, causal=False, backward=True)
    timing = measure_time(call, torch.device("cpu"), warmup=1, repeats=10, min_time=1.0)

Everything here works on one process's tensors; where a call runs (a fresh child per cell, or a
pytest session) is the caller's business.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

from harness.core.memory import steady_allocator
from harness.core.noise import Snapshot

# The correctness gate, FlashAttention's criterion: the variant's error against the float64 definition
# may be at most twice the error of the dense definition computed in the run's dtype, plus a small
# allowance (relative to max |reference|) for the rounding a different order of summation brings.
GATE_ALLOWANCE = {"float64": 1e-9, "float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}  # about 16, 1 and 1 ulp at 1.0
# used alone where the dense definition itself overflows in the run's dtype (no bound to double)
FALLBACK_TOLERANCE = {"float64": 1e-6, "float32": 1e-3, "float16": 2e-2, "bfloat16": 8e-2}
CHECK_BATCH = 2  # the gate checks a batch of 2, so broadcasting over the batch is exercised

# A fresh process runs its first calls slower for a few hundred milliseconds, whatever the count of
# calls (measured on a quiet 2-core VM: sliding_window N = 256 at 3.6 ms in its first 0.25 s, 2.6 ms
# after 1.5 s of work, or at once after a second of other work; on CUDA, kernels at small N take less
# time than the host needs to launch them): warm up for at least WARMUP_S. Then a sample times enough
# calls to last MIN_SAMPLE_S between one start and stop of the clock: a sub-millisecond CPU call timed
# alone catches a timer interrupt or a scheduler tick in a large share of its samples, and a CUDA
# kernel shorter than its launch would time the launch (pyperf and triton.testing.do_bench calibrate so).
WARMUP_S = 0.25
CPU_MIN_SAMPLE_S = 0.01
CUDA_MIN_SAMPLE_S = 0.001
MAX_CALLS_PER_SAMPLE = 1000


def set_threads(threads: int = 0) -> int:
    """Pin torch's CPU threads: `threads`, or (0) every core this process may run on (its affinity
    mask, not os.cpu_count(): a container or `taskset` may allow fewer). Returns the count."""
    count = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(count)
    return count


def make_inputs(
    batch: int,
    heads: int,
    n: int,
    head_dim: int,
    dtype: str,
    device,
    requires_grad: bool,
    seed: int | None = None,
    kv_heads: int | None = None,
):
    """q of shape (batch, heads, n, head_dim), k and v of (batch, kv_heads or heads, n, head_dim) (grouped-query):
    standard normal, drawn on the CPU from a generator seeded by `seed` (default: n), so every device and process
    gets the same numbers."""
    g = torch.Generator(device="cpu").manual_seed(n if seed is None else seed)
    shapes = [(batch, h, n, head_dim) for h in (heads, kv_heads or heads, kv_heads or heads)]
    return tuple(
        torch.randn(shape, generator=g).to(device=device, dtype=getattr(torch, dtype)).requires_grad_(requires_grad)
        for shape in shapes
    )


def pass_call(attn, q, k, v, *, causal: bool, backward: bool, sync: bool = False):
    """The call a pass times: the forward under no_grad ("fwd"), or forward + backward of a fixed random
    output gradient ("fwdbwd"; input gradients cleared after each call). `sync`: wait for the device
    at the end of each call (for a host clock on CUDA)."""
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device) if backward else None
    cuda = q.device.type == "cuda"

    def call():
        if backward:
            attn(q, k, v, causal=causal).backward(grad_out)
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                attn(q, k, v, causal=causal)
        if sync and cuda:
            torch.cuda.synchronize(q.device)

    return call


# -- the correctness gate ----------------------------------------------------------------------------

DECODE_CHECK_STEPS = 3  # positions the gate decodes one at a time (after a prefill of the rest)


def decode_call(
    attn,
    batch: int,
    heads: int,
    n: int,
    head_dim: int,
    dtype: str,
    device,
    sync: bool = False,
    kv_heads: int | None = None,
):
    """(the call a decode cell times: one step of one new position after N, the state after N) — the state
    built by the variant's own prefill of N positions, not timed; every call steps from that same state."""
    q, k, v = make_inputs(batch, heads, n + 1, head_dim, dtype, device, False, kv_heads=kv_heads)
    with torch.no_grad():
        # max_len: a KV cache is one buffer of N + 1 positions the step writes into (no copy of the cache per step)
        empty = attn.init_state(batch, heads, head_dim, head_dim, q.dtype, device, max_len=n + 1, kv_heads=kv_heads)
        state = attn.prefill(q[:, :, :n], k[:, :, :n], v[:, :, :n], empty)
    new = tuple(t[:, :, n:].contiguous() for t in (q, k, v))
    del q, k, v
    cuda = torch.device(device).type == "cuda"

    def call():
        with torch.no_grad():
            attn.step(*new, state)
        if sync and cuda:
            torch.cuda.synchronize(device)

    return call, state


def gate_length(attn, default: int, longest: int) -> int:
    """N of the gate: `default`, raised to what the variant needs to exercise its sparse paths
    (`attn.check_length`, e.g. 2w + 3 tiles for a band) but never past `longest` (the longest N measured),
    or lowered to what it takes at most (linformer's max_len)."""
    wanted = attn.check_length(default)
    return wanted if wanted < default else max(default, min(wanted, longest))


def gate(
    attn,
    batch: int,
    heads: int,
    n: int,
    head_dim: int,
    dtype: str,
    device,
    *,
    causal: bool,
    backward: bool,
    decode: bool = False,
    kv_heads: int | None = None,
) -> dict:
    """The variant (in `dtype`, on `device`) against its dense float64 definition, outputs and gradients
    (and, `decode`, the outputs of its last DECODE_CHECK_STEPS positions decoded one step at a time after a prefill).

    Passes when, for the output and each gradient, error(variant) <= 2 * error(dense definition in
    `dtype`) + GATE_ALLOWANCE * max |reference|, and the output is neither non-finite nor all zero.
    Returns {"ok", "max_error", "check_len", "message"}.
    """
    import copy

    dev = torch.device(device)
    ref_attn = copy.deepcopy(attn).to(torch.float64)
    q, k, v = make_inputs(batch, heads, n, head_dim, dtype, dev, backward, kv_heads=kv_heads)
    out = attn(q, k, v, causal=causal)
    q64, k64, v64 = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    ref = ref_attn.reference(q64, k64, v64, causal=causal)
    qd, kd, vd = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))
    ref_dtype = attn.reference(qd, kd, vd, causal=causal)  # the same definition, computed in the run's dtype
    pairs = {"output": (out, ref_dtype, ref)}
    if backward:
        grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dev)
        got = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
        low = torch.autograd.grad(ref_dtype, (qd, kd, vd), grad_out.to(out.dtype))
        want = torch.autograd.grad(ref, (q64, k64, v64), grad_out)
        pairs.update({label: triple for label, triple in zip(("dq", "dk", "dv"), zip(got, low, want))})
    if decode:
        with torch.no_grad():
            steps = min(DECODE_CHECK_STEPS, n - 1)
            start = n - steps
            state = attn.prefill(
                *(t.detach()[:, :, :start] for t in (q, k, v)),
                attn.init_state(batch, heads, head_dim, head_dim, q.dtype, dev, kv_heads=kv_heads),
            )
            outs = []
            for i in range(start, n):
                out_i, state = attn.step(*(t.detach()[:, :, i : i + 1] for t in (q, k, v)), state)
                outs.append(out_i)
        pairs["decoded steps"] = (torch.cat(outs, dim=2), ref_dtype[:, :, start:], ref[:, :, start:])
    verdicts = {label: gate_verdict(a, b, c, dtype) for label, (a, b, c) in pairs.items()}
    # how far the method is from the softmax attention it replaces, on these inputs (at its scale, or D^-½)
    scale = attn.scale if attn.scale is not None else head_dim**-0.5
    with torch.no_grad():
        exact = exact_softmax_attention(q64.detach(), k64.detach(), v64.detach(), causal, scale)
    softmax_error = ((out.detach().double() - exact).norm() / exact.norm().clamp_min(1e-12)).item()  # Frobenius
    exact_n = attn.softmax_equivalent_length()
    if exact_n is not None:  # where the definition is plain softmax attention, check against our own as well
        m = min(exact_n, n)
        with torch.no_grad():
            qs, ks, vs = (t.detach()[..., :m, :] for t in (q, k, v))
            got = attn(qs, ks, vs, causal=causal)
            low = exact_softmax_attention(qs, ks, vs, causal, attn._scale(qs))
            want = exact_softmax_attention(qs.double(), ks.double(), vs.double(), causal, attn._scale(qs))
        verdicts[f"exact softmax at N={m}"] = gate_verdict(got, low, want, dtype)
    ok = all(v["ok"] for v in verdicts.values())
    worst = max(verdicts.values(), key=lambda v: v["error"] / v["bound"] if v["bound"] else math.inf)
    detail = "; ".join(f"{label} {v['describe']}" for label, v in verdicts.items())
    return {
        "ok": ok,
        "max_error": worst["error"],
        "check_len": n,
        "softmax_error": softmax_error,
        "message": f"relative error vs dense float64 at B={batch}, N={n}: {detail}",
    }


def exact_softmax_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v written here, independently of every variant's code (k, v of fewer heads than q
    serve groups of query heads)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (
        torch.matmul(q, k.transpose(-1, -2)).float() * scale
        if q.dtype in (torch.float16, torch.bfloat16)
        else torch.matmul(q, k.transpose(-1, -2)) * scale
    )
    if causal:
        n_q, n_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def gate_verdict(got: torch.Tensor, low: torch.Tensor, want: torch.Tensor, dtype: str) -> dict:
    """One tensor's verdict: relative errors of the variant (got) and of the dense definition in the run's
    dtype (low) against float64 (want), the bound, and whether the output is degenerate."""
    got, low, want = got.detach().double(), low.detach().double(), want.detach().double()
    error = _relative_error(got, want)
    low_error = _relative_error(low, want)
    if math.isfinite(low_error):
        bound = 2 * low_error + GATE_ALLOWANCE[dtype]
        how = f"allowed {bound:.1e} = 2 x {low_error:.1e} (dense {dtype}) + {GATE_ALLOWANCE[dtype]:g}"
    else:  # the dense definition overflows in this dtype: no bound to double, use the fixed tolerance
        bound = FALLBACK_TOLERANCE[dtype]
        how = f"allowed {bound:g}: the dense {dtype} definition overflows"
    degenerate = ""  # the gate's inputs are finite random numbers: no attention gives NaN or all zeros on them
    if not torch.isfinite(got).all():
        degenerate = "non-finite values"
    elif not got.abs().max().item():
        degenerate = "all zeros"
    ok = not degenerate and error <= bound
    describe = f"degenerate ({degenerate})" if degenerate else f"{error:.1e} ({how})"
    return {"ok": ok, "error": error, "bound": bound, "describe": describe + ("" if ok else " FAILED")}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


# -- timing ------------------------------------------------------------------------------------------


class WallClock:
    """Host wall time: start(), then stop() -> seconds since start."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self._t0


class CudaClock:
    """CUDA events around the enqueued work: start(), then stop() -> seconds, after a synchronize."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        torch.cuda.synchronize(self.device)
        return self._start.elapsed_time(self._end) / 1e3


def clock_for(device: torch.device):
    return CudaClock(device) if device.type == "cuda" else WallClock()


@dataclass(frozen=True)
class Timing:
    """The samples of one timed call: seconds per call of each sample, calls per sample, and the noise
    snapshots taken around the timed samples (warm-up excluded)."""

    times: list
    per_sample: int
    before: Snapshot
    after: Snapshot


def measure_time(
    call,
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    min_time: float,
    warmup_time: float = WARMUP_S,
    min_repeats: int = 3,
) -> Timing:
    """Time `call` as `bench run`'s cells and the training-step cost do: `warmed` (steady allocator, at
    least `warmup` calls lasting at least `warmup_time` seconds; the micro-benchmarks call it before
    pytest-benchmark's own loop), then `time_calls` with calls per sample calibrated from the last warm-up
    call to a sample of CPU_MIN_SAMPLE_S (CUDA_MIN_SAMPLE_S)."""
    clock, last = warmed(call, device, warmup=warmup, seconds=warmup_time)
    before = Snapshot.now()
    times, per_sample = time_calls(
        call,
        clock,
        repeats=repeats,
        min_time=min_time,
        per_call=last,
        min_repeats=min_repeats,
        min_sample_s=CUDA_MIN_SAMPLE_S if device.type == "cuda" else CPU_MIN_SAMPLE_S,
    )
    return Timing(times, per_sample, before, before.after())


def warmed(call, device: torch.device, *, warmup: int, seconds: float = WARMUP_S):
    """Make `call` ready to time on `device`: the allocator steady (CPU: `memory.steady_allocator`), then
    at least `warmup` calls, lasting at least `seconds`. Returns (the device's clock, the last call's seconds or None)."""
    if device.type != "cuda":
        steady_allocator()
    clock = clock_for(device)
    return clock, warm_up(call, clock, calls=warmup, seconds=seconds)


def warm_up(call, clock, *, calls: int, seconds: float) -> float | None:
    """At least `calls` calls, and (where `seconds` > 0) calls until that much time has passed.
    Returns the last call's seconds (what calibrates the samples), None when it made no call."""
    clock.start()
    done, elapsed, last = 0, 0.0, None
    while done < calls or (seconds > 0 and done < 1_000_000 and elapsed < seconds):
        call()
        done += 1
        now = clock.stop()
        last, elapsed = now - elapsed, now
    return last


def time_calls(
    call,
    clock,
    *,
    repeats: int,
    min_time: float,
    min_sample_s: float = 0.0,
    per_call: float | None = None,
    min_repeats: int = 3,
) -> tuple[list[float], int]:
    """(seconds per call of each sample, calls per sample).

    A sample times `per_sample` consecutive calls between one start and stop of the clock, with
    `per_sample` chosen so that a sample lasts >= min_sample_s (1 when min_sample_s is 0), from
    `per_call` (the last warm-up call's seconds) or else one calibrating call. Samples are taken until
    `repeats`, or `min_repeats` once `min_time` seconds were timed (with 1, a sample that alone lasts
    `min_time` is the only one: pyperf's calibration, a call that long being stable on its own).
    """
    per_sample = 1
    if min_sample_s > 0:
        if per_call is None:
            clock.start()
            call()
            per_call = clock.stop()
        per_sample = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(min_sample_s / max(per_call, 1e-9))))
    times: list[float] = []
    while len(times) < repeats and (len(times) < min_repeats or sum(times) * per_sample < min_time):
        clock.start()
        for _ in range(per_sample):
            call()
        times.append(clock.stop() / per_sample)
    return times, per_sample


def timing_stats(times: list[float]) -> dict:
    """Median, minimum and interquartile range of the per-call times of the samples."""
    ordered = sorted(times)
    if len(ordered) < 2:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {"time_median_s": statistics.median(ordered), "time_min_s": ordered[0], "time_iqr_s": q3 - q1}


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
