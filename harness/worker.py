"""What runs inside a cell's own process: the correctness check, the timing, the memory measurement.

Each function here is called in a fresh child process (`harness.isolation.run_isolated`) and returns
a plain dict; the parent never runs attention itself, so a crash, a hang or an out-of-memory kill
costs one cell only.
"""

from __future__ import annotations

import copy
import math
import os
import resource
import statistics
import time

import torch

import variants
from harness.config import Cell, RunConfig
from harness.memory import measure_peak, pin_mmap_threshold

# relative error allowed against the float64 definition, per dtype
CHECK_TOLERANCE = {"float64": 1e-6, "float32": 1e-3, "float16": 2e-2, "bfloat16": 8e-2}

OOM_MARKERS = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory")


def is_oom(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in OOM_MARKERS)


def setup_process(config: RunConfig, device: str) -> None:
    """Per-child settings: thread count, deterministic seeds."""
    if device == "cpu":  # pinned, and recorded with each row: all usable cores unless --threads says otherwise
        torch.set_num_threads(config.threads or len(os.sched_getaffinity(0)))
    torch.manual_seed(0)


def _inputs(config: RunConfig, n: int, device: torch.device, requires_grad: bool, batch=None, heads=None):
    g = torch.Generator(device="cpu").manual_seed(n)
    shape = (batch or config.batch, heads or config.heads, n, config.head_dim)
    return tuple(
        torch.randn(shape, generator=g).to(device=device, dtype=config.torch_dtype).requires_grad_(requires_grad)
        for _ in range(3)
    )


def _build(config: RunConfig, name: str, dev: torch.device):
    """The variant with the run's options, on the cell's device, in the run's dtype."""
    return variants.build(name, device=dev, **config.variant_options(name)).to(config.torch_dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_variant(config: RunConfig, device: str, name: str, causal: bool) -> dict:
    """Compare the variant in the run's dtype with its dense float64 definition at N = check_len."""
    setup_process(config, device)
    dev = torch.device(device)
    attn = _build(config, name, dev)
    ref_attn = copy.deepcopy(attn).to(torch.float64)
    backward = attn.backward_unsupported_reason(device) is None and "fwdbwd" in config.passes
    q, k, v = _inputs(config, config.check_len, dev, backward, batch=1, heads=config.heads)
    out = attn(q, k, v, causal=causal)
    q64, k64, v64 = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    ref = ref_attn.reference(q64, k64, v64, causal=causal)
    tol = CHECK_TOLERANCE[config.dtype]
    errors = {"output": _relative_error(out, ref)}
    if backward:
        grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dev)
        got = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
        want = torch.autograd.grad(ref, (q64, k64, v64), grad_out)
        for label, a, b in zip(("dq", "dk", "dv"), got, want):
            errors[label] = _relative_error(a, b)
    worst = max(errors, key=errors.get)
    ok = all(err <= tol for err in errors.values())
    detail = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
    return {"ok": ok, "max_error": errors[worst], "message": f"relative error vs dense float64 at N={config.check_len}: {detail} (tolerance {tol:g})"}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def _limit_cpu_memory(budget: int | None) -> None:
    """Make allocations past `budget` more bytes fail (RLIMIT_DATA), so they surface as `oom`, not a kill."""
    if budget is None:
        return
    with open("/proc/self/status") as f:
        data_kib = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
    limit = data_kib * 1024 + budget
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def measure_cell(config: RunConfig, cell: Cell) -> dict:
    """Time the cell's call (median, min, IQR over repeats), then its peak extra memory."""
    setup_process(config, cell.device)
    dev = torch.device(cell.device)
    attn = _build(config, cell.variant, dev)
    backward = cell.pass_ == "fwdbwd"
    q, k, v = _inputs(config, cell.n, dev, backward)
    grad_out = torch.randn_like(q.detach()) if backward else None  # the output's shape: (B, H, N, D)
    if dev.type == "cpu":
        _limit_cpu_memory(config.budget(cell.device))

    def call():
        if backward:
            attn(q, k, v, causal=cell.causal).backward(grad_out)
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                attn(q, k, v, causal=cell.causal)

    for _ in range(config.warmup):
        call()
    _sync(dev)
    times = []
    while len(times) < config.repeats and (len(times) < 3 or sum(times) < config.min_time):
        times.append(_timed(call, dev))
    pin_mmap_threshold()  # time first, with the allocator as users have it; then make memory visible
    memory = measure_peak(call, dev)
    times.sort()
    q1, q3 = _quartiles(times)
    return {
        "time_median_s": statistics.median(times),
        "time_min_s": times[0],
        "time_iqr_s": q3 - q1,
        "timed_calls": len(times),
        "peak_bytes": memory["peak_bytes"],
        "reserved_bytes": memory["reserved_bytes"],
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
    }


def _timed(call, dev: torch.device) -> float:
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _quartiles(sorted_times: list[float]) -> tuple[float, float]:
    if len(sorted_times) < 2:
        return sorted_times[0], sorted_times[0]
    q = statistics.quantiles(sorted_times, n=4, method="inclusive")
    return q[0], q[2]


def matmul_peak(device: str, dtype: str, threads: int = 0, seconds: float = 1.0) -> dict:
    """Measured dense matmul throughput (GFLOP/s): the machine's practical limit for reports."""
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    n = 4096 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    a @ b  # warm-up
    _sync(dev)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or calls < 3:
        a @ b
        calls += 1
        _sync(dev)
    elapsed = time.perf_counter() - start
    return {"gflops": 2 * n**3 * calls / elapsed / 1e9, "n": n, "calls": calls}


def cuda_info() -> dict:
    """GPU model, driver and memory, read in a child so the parent never initializes CUDA."""
    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    driver = None
    try:
        import subprocess

        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"name": props.name, "total_bytes": total, "free_bytes": free, "driver": driver, "cuda": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}", "pid": os.getpid()}
