"""What runs inside a cell's own process: the correctness check, the timing, the memory measurement.

Each function here is called in a fresh child process (`harness.core.isolation.run_isolated`) and returns
a plain dict; the parent never runs attention itself, so a crash, a hang or an out-of-memory kill
costs one cell only.
"""

from __future__ import annotations

import os
import resource

import torch

import variants
from harness.core.gate import CHECK_BATCH, gate, gate_length
from harness.core.calls import decode_call, make_inputs, pass_call, set_threads
from harness.core.timing import measure_time, timing_stats
from harness.core.memory import measure_peak, pin_mmap_threshold
from harness.core.noise import noise_fields
from harness.sweep.config import Cell, RunConfig


def setup_process(config: RunConfig, device: str) -> None:
    """Per-child settings: thread count (recorded with each row), deterministic seeds."""
    if device == "cpu":
        set_threads(config.threads)
    torch.manual_seed(0)


def build_variant(config: RunConfig, name: str, dev: torch.device):
    """The variant with the run's options, on the cell's device, in the run's dtype."""
    return variants.build(name, device=dev, **config.variant_options(name)).to(config.torch_dtype)


def check_variant(config: RunConfig, device: str, name: str, causal: bool) -> dict:
    """The gate (`measure.gate`) for one (device, variant, causal) of the run, before any of its cells is timed."""
    setup_process(config, device)
    attn = build_variant(config, name, torch.device(device))
    backward = attn.backward_unsupported_reason(device) is None and "fwdbwd" in config.passes
    decode = causal and "decode" in config.passes and attn.decode_unsupported_reason() is None
    n = gate_length(attn, config.check_len, max(config.lengths))
    return gate(
        attn,
        CHECK_BATCH,
        config.heads,
        n,
        config.head_dim,
        config.dtype,
        device,
        causal=causal,
        backward=backward,
        decode=decode,
        kv_heads=config.key_heads,
    )


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
    """Time the cell's call (median, min, IQR over repeats), then its peak extra memory. A decode cell's call
    is one step of one new position after N, from the state the variant's prefill built (untimed)."""
    setup_process(config, cell.device)
    dev = torch.device(cell.device)
    attn = build_variant(config, cell.variant, dev)
    backward = cell.pass_ == "fwdbwd"
    if dev.type == "cpu":
        _limit_cpu_memory(config.budget(cell.device))
    else:
        _limit_cuda_memory(config.budget(cell.device), dev)
    if cell.pass_ == "decode":
        call, state = decode_call(
            attn, config.batch, config.heads, cell.n, config.head_dim, config.dtype, dev, kv_heads=config.key_heads
        )
        facts = {"state_bytes": state.nbytes(), "state_kind": state.kind, "read_bytes": attn.step_read_bytes(state)}
    else:
        q, k, v = make_inputs(
            config.batch, config.heads, cell.n, config.head_dim, config.dtype, dev, backward, kv_heads=config.key_heads
        )
        call = pass_call(attn, q, k, v, causal=cell.causal, backward=backward)
        facts = {"kernel": _kernel_name(attn, q, k, v, cell.causal, backward)}
    timing = measure_time(
        call,
        dev,
        warmup=config.warmup,
        repeats=config.repeats,
        min_time=config.min_time,
        warmup_time=config.warmup_time,
        min_repeats=config.min_repeats,
    )
    pin_mmap_threshold()  # time first, in the allocator's steady state; then make memory visible
    memory = measure_peak(call, dev)
    stats = timing_stats(timing.times)
    return {
        **noise_fields(timing.before, timing.after, stats["time_median_s"], stats["time_iqr_s"], len(timing.times)),
        **stats,
        "timed_calls": len(timing.times),
        "calls_per_sample": timing.per_sample,
        "peak_bytes": memory["peak_bytes"],
        "reserved_bytes": memory["reserved_bytes"],
        "memory_kind": memory["kind"],
        **facts,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
    }


def _kernel_name(attn, q, k, v, causal: bool, backward: bool) -> str | None:
    """Which kernel the variant dispatches to, where it can say (recorded with the row)."""
    try:
        return attn.kernel_name(q, k, v, causal=causal, backward=backward)
    except Exception as err:  # noqa: BLE001 — a diagnostic only; never costs the cell
        return f"unknown ({type(err).__name__})"


def _limit_cuda_memory(budget: int | None, dev: torch.device) -> None:
    """Make allocations past `budget` bytes fail inside the caching allocator (an `oom`), not hurt other processes."""
    if budget is None:
        return
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)


NVIDIA_SMI_FIELDS = (
    "uuid",
    "driver_version",
    "clocks.max.sm",
    "clocks.max.memory",
    "power.limit",
    "mig.mode.current",
    "persistence_mode",
    "compute_mode",
)


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
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
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
        "name": props.name,
        "total_bytes": total,
        "free_bytes": free,
        "cuda": torch.version.cuda,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "uuid": uuid,
        "driver": smi.get("driver_version"),
        "nvidia_smi": smi,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": triton,
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
    }
