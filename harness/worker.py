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
from harness.noise import Snapshot, noise_fields

# The correctness gate, FlashAttention's criterion: the variant's error against the float64 definition
# may be at most twice the error of the dense definition computed in the run's dtype, plus a small
# allowance (relative to max |reference|) for the rounding a different order of summation brings.
GATE_ALLOWANCE = {"float64": 1e-9, "float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}  # about 16, 1 and 1 ulp at 1.0
# used alone where the dense definition itself overflows in the run's dtype (no bound to double)
FALLBACK_TOLERANCE = {"float64": 1e-6, "float32": 1e-3, "float16": 2e-2, "bfloat16": 8e-2}
CHECK_BATCH = 2  # the gate checks a batch of 2, so broadcasting over the batch is exercised

OOM_MARKERS = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory",
               "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "cufft_internal_error: out of memory")


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


def check_length(config: RunConfig, attn) -> int:
    """N of the gate: --check-len, raised to what the variant needs to exercise its sparse paths
    (`attn.check_length`, e.g. 2w + 3 tiles for a band), but never past the longest N of the run."""
    wanted = attn.check_length(config.check_len)
    return max(config.check_len, min(wanted, max(config.lengths)))


def check_variant(config: RunConfig, device: str, name: str, causal: bool) -> dict:
    """The gate: the variant in the run's dtype against its dense float64 definition, outputs and gradients.

    Passes when, for the output and each gradient, error(variant) <= 2 * error(dense definition in
    the run's dtype) + GATE_ALLOWANCE * max |reference|, and the output is neither non-finite nor all
    zero where the reference is not.
    """
    setup_process(config, device)
    dev = torch.device(device)
    attn = _build(config, name, dev)
    ref_attn = copy.deepcopy(attn).to(torch.float64)
    backward = attn.backward_unsupported_reason(device) is None and "fwdbwd" in config.passes
    n = check_length(config, attn)
    q, k, v = _inputs(config, n, dev, backward, batch=CHECK_BATCH, heads=config.heads)
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
    verdicts = {label: gate_verdict(a, b, c, config.dtype) for label, (a, b, c) in pairs.items()}
    exact_n = attn.softmax_equivalent_length()
    if exact_n is not None:  # where the definition is plain softmax attention, check against our own as well
        m = min(exact_n, n)
        with torch.no_grad():
            qs, ks, vs = (t.detach()[..., :m, :] for t in (q, k, v))
            got = attn(qs, ks, vs, causal=causal)
            low = exact_softmax_attention(qs, ks, vs, causal, attn._scale(qs))
            want = exact_softmax_attention(qs.double(), ks.double(), vs.double(), causal, attn._scale(qs))
        verdicts[f"exact softmax at N={m}"] = gate_verdict(got, low, want, config.dtype)
    ok = all(v["ok"] for v in verdicts.values())
    worst = max(verdicts.values(), key=lambda v: v["error"] / v["bound"] if v["bound"] else math.inf)
    detail = "; ".join(f"{label} {v['describe']}" for label, v in verdicts.items())
    return {"ok": ok, "max_error": worst["error"], "check_len": n,
            "message": f"relative error vs dense float64 at B={CHECK_BATCH}, N={n}: {detail}"}


def exact_softmax_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v written here, independently of every variant's code."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale if q.dtype in (torch.float16, torch.bfloat16) \
        else torch.matmul(q, k.transpose(-1, -2)) * scale
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


# CUDA kernels at small N take microseconds, less than the host needs to launch them: warm up for
# at least this long, and time enough calls between one pair of events that a sample lasts this long
# (as triton.testing.do_bench does). CPU calls are timed one by one: perf_counter resolves them.
CUDA_WARMUP_S = 0.025
CUDA_MIN_SAMPLE_S = 0.001
MAX_CALLS_PER_SAMPLE = 1000


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
    else:
        _limit_cuda_memory(config.budget(cell.device), dev)

    def call():
        if backward:
            attn(q, k, v, causal=cell.causal).backward(grad_out)
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                attn(q, k, v, causal=cell.causal)

    cuda = dev.type == "cuda"
    clock = CudaClock(dev) if cuda else WallClock()
    warm_up(call, clock, calls=config.warmup, seconds=CUDA_WARMUP_S if cuda else 0.0)
    before = Snapshot.now()
    times, per_sample = time_calls(call, clock, repeats=config.repeats, min_time=config.min_time,
                                   min_sample_s=CUDA_MIN_SAMPLE_S if cuda else 0.0)
    after = before.after()
    pin_mmap_threshold()  # time first, with the allocator as users have it; then make memory visible
    memory = measure_peak(call, dev)
    times.sort()
    q1, q3 = _quartiles(times)
    return {
        **noise_fields(before, after, statistics.median(times), q3 - q1),
        "time_median_s": statistics.median(times),
        "time_min_s": times[0],
        "time_iqr_s": q3 - q1,
        "timed_calls": len(times),
        "calls_per_sample": per_sample,
        "peak_bytes": memory["peak_bytes"],
        "reserved_bytes": memory["reserved_bytes"],
        "memory_kind": memory["kind"],
        "kernel": _kernel_name(attn, q, k, v, cell.causal, backward),
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
    }


def _kernel_name(attn, q, k, v, causal: bool, backward: bool) -> str | None:
    """Which kernel the variant dispatches to, where it can say (recorded with the row)."""
    try:
        return attn.kernel_name(q, k, v, causal=causal, backward=backward)
    except Exception as err:  # noqa: BLE001 — a diagnostic only; never costs the cell
        return f"unknown ({type(err).__name__})"


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


def warm_up(call, clock, *, calls: int, seconds: float) -> None:
    """At least `calls` calls, and (where `seconds` > 0) calls until that much time has passed."""
    clock.start()
    done = 0
    while done < calls or (seconds > 0 and done < 1_000_000 and clock.stop() < seconds):
        call()
        done += 1
    clock.stop()


def time_calls(call, clock, *, repeats: int, min_time: float, min_sample_s: float = 0.0) -> tuple[list[float], int]:
    """(seconds per call of each sample, calls per sample).

    A sample times `per_sample` consecutive calls between one start and stop of the clock, with
    `per_sample` chosen from one calibrating call so that a sample lasts >= min_sample_s (1 when
    min_sample_s is 0). Samples are taken until `repeats`, or 3 once `min_time` seconds were timed.
    """
    per_sample = 1
    if min_sample_s > 0:
        clock.start()
        call()
        once = max(clock.stop(), 1e-9)
        per_sample = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(min_sample_s / once)))
    times: list[float] = []
    while len(times) < repeats and (len(times) < 3 or sum(times) * per_sample < min_time):
        clock.start()
        for _ in range(per_sample):
            call()
        times.append(clock.stop() / per_sample)
    return times, per_sample


def _limit_cuda_memory(budget: int | None, dev: torch.device) -> None:
    """Make allocations past `budget` bytes fail inside the caching allocator (an `oom`), not hurt other processes."""
    if budget is None:
        return
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)


def _quartiles(sorted_times: list[float]) -> tuple[float, float]:
    if len(sorted_times) < 2:
        return sorted_times[0], sorted_times[0]
    q = statistics.quantiles(sorted_times, n=4, method="inclusive")
    return q[0], q[2]


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
        torch.backends.cuda.matmul.allow_tf32 = True  # this child process only
        precision = "float32 (TF32 tensor cores allowed)"
    n = 4096 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    clock = CudaClock(dev) if dev.type == "cuda" else WallClock()
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


NVIDIA_SMI_FIELDS = ("uuid", "driver_version", "clocks.max.sm", "clocks.max.memory", "power.limit", "mig.mode.current",
                     "persistence_mode", "compute_mode")


def parse_nvidia_smi(stdout: str, returncode: int, uuid: str | None) -> dict:
    """The row of `nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits` for the GPU `uuid`.

    One line per GPU; fields '[N/A]' or '[Not Supported]' become None. Returns {"error": ...} when
    nvidia-smi failed, printed something else, or lists no GPU with that uuid (never its error text
    stored as a value).
    """
    if returncode != 0:
        first = (stdout.strip().splitlines() or ["no output"])[0]
        return {"error": f"nvidia-smi exited with {returncode}: {first[:200]}"}
    rows = []
    for line in stdout.strip().splitlines():
        values = [part.strip() for part in line.split(",")]
        if len(values) != len(NVIDIA_SMI_FIELDS):
            return {"error": f"nvidia-smi printed an unexpected line: {line[:200]!r}"}
        rows.append({key: (None if value.startswith("[") else value) for key, value in zip(NVIDIA_SMI_FIELDS, values)})
    if not rows:
        return {"error": "nvidia-smi listed no GPU"}
    match = [row for row in rows if uuid and row["uuid"] and (row["uuid"] == uuid or row["uuid"].endswith(uuid))]
    if not match:
        return {"error": f"nvidia-smi lists no GPU with uuid {uuid}" if uuid else "the GPU's uuid is unknown"}
    return match[0]


def _nvidia_smi(uuid: str | None) -> dict:
    import subprocess

    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as err:
        return {"error": f"nvidia-smi could not run: {err}"}
    return parse_nvidia_smi(done.stdout or done.stderr, done.returncode, uuid)


def cuda_info() -> dict:
    """What decides whether two GPU runs compare: model, memory, SMs, clocks, power limit, MIG, library
    versions and TF32 settings. Read in a child so the parent never initializes CUDA."""
    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    uuid = str(getattr(props, "uuid", "") or "") or None
    smi = _nvidia_smi(uuid)
    try:
        from importlib.metadata import version

        triton = version("triton")
    except Exception:  # noqa: BLE001 — not installed, or no metadata
        triton = None
    return {
        "name": props.name, "total_bytes": total, "free_bytes": free, "cuda": torch.version.cuda,
        "capability": f"{props.major}.{props.minor}", "sm_count": props.multi_processor_count, "uuid": uuid,
        "driver": smi.get("driver_version"), "nvidia_smi": smi,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None, "triton": triton,
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
    }
