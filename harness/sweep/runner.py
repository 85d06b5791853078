"""The sweep: decide each cell's fate, run it in its own process, append its row the moment it exists.

The parent never runs attention. For each cell it decides, in order:
  1. skipped by the variant's spec (device, causal, backward, dtype) or because its series already
     stopped (oom / timeout / skipped at a smaller N), or predicted above the memory budget;
  2. incorrect (or the check's own failure) when the variant disagrees with its dense definition
     at a small N on that device — checked once per (device, variant, causal), before any timing;
  3. otherwise measured in a child process: ok, oom, timeout or error.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import variants
from harness.core.isolation import Outcome, run_isolated
from harness.core.machine import cpu_info
from harness.fmt import fmt_bytes
from harness.policy import shape_only
from harness.store.rows import FAILED, STOPPING, Row, cell_key, device_label, run_rows, series_key
from harness.store.storage import SUPERSEDED, RowWriter, drop_torn_tail, read_rows, rewrite_rows
from harness.sweep import worker
from harness.sweep.config import BASELINE, Cell, RunConfig
from harness.sweep.executors import LocalExecutor
from harness.sweep.plan import plan

WORKER_LOG = "worker.log"  # what the cells' processes print (compiler warnings, tracebacks)
PREDICT_FROM_S = 0.1  # a series' time is extrapolated to a larger N only from calls at least this long


@dataclass
class SweepState:
    """What the parent knows while it sweeps: finished cells, stopped series, checked variants."""

    done: set = field(default_factory=set)
    stopped: dict = field(default_factory=dict)  # series -> (n, status)
    times: dict = field(default_factory=dict)  # series -> {n: seconds a call} of its ok cells
    checks: dict = field(
        default_factory=dict
    )  # (device, name, variant, causal) -> (status, message) or None when it passed
    softmax_errors: dict = field(
        default_factory=dict
    )  # the same key -> the gate's relative error against exact softmax
    check_locks: dict = field(default_factory=dict)  # one per check key: series sharing a check wait for the first
    lock: object = field(default_factory=threading.RLock)  # cells of several series may finish at once (--executor ray)

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "SweepState":
        state = cls()
        for row in sorted(rows, key=lambda r: int(r["n"])):
            state.record(row)
        return state

    def record(self, row: dict) -> None:
        with self.lock:
            self.done.add(cell_key(row))
            series = series_key(row)
            if row["status"] in STOPPING and series not in self.stopped:
                self.stopped[series] = (int(row["n"]), row["status"])
            if row["status"] == "ok" and row.get("time_median_s"):
                self.times.setdefault(series, {})[int(row["n"])] = float(row["time_median_s"])

    def predicted_time(self, cell: Cell) -> tuple[float, float, int, int] | None:
        """(seconds a call at cell.n, exponent, n1, n2): the series' time extrapolated from its two largest
        ok N below cell.n on their log-log slope (held to [1, 3]: no attention call is sublinear in N, and
        none of the menu grows faster than N^3); None with fewer than two, or when the larger took less
        than PREDICT_FROM_S a call (there fixed costs still shape the slope)."""
        with self.lock:
            below = sorted((n, t) for n, t in self.times.get(cell.series, {}).items() if n < cell.n)
        if len(below) < 2 or below[-1][1] < PREDICT_FROM_S:
            return None
        (n1, t1), (n2, t2) = below[-2:]
        exponent = min(3.0, max(1.0, math.log(t2 / t1) / math.log(n2 / n1)))
        return t2 * (cell.n / n2) ** exponent, exponent, n1, n2


# A cell is skipped when its fewest calls are predicted past 1/PREDICTION_MARGIN of --cell-timeout, not the whole:
# two points underestimate a series leaving its asymptotic regime (full_naive's causal forward+backward: 3.3 s a call
# at N=4096, predicted 11.6 s at 8192, killed at the 60 s timeout after 3 calls of over 20 s), and the call that
# measures memory (every allocation mapped afresh) can take 2.5 x a timed one (additive's causal forward at 8192:
# 12.6 s calls, 57 s for the cell). A cell that times out costs the whole timeout and still has no row.
PREDICTION_MARGIN = 2.0


def calls_per_cell(config: RunConfig) -> int:
    """The fewest calls a cell makes: its warm-up, `min_repeats` timed calls, and one for its memory."""
    return max(1, config.warmup) + config.min_repeats + 1


def static_skip_reason(config: RunConfig, cell: Cell, remote: bool = False) -> str | None:
    """Why the spec says this cell cannot run, or None. remote: the cell runs on a cluster's node, so
    what this machine has (a GPU, a library) does not decide; the hardware name says a node has the device."""
    cls = variants.variant_class(cell.variant)
    if remote:
        if cell.device_name is None:
            return f"unavailable: no node of the cluster has a {cell.device} device (with the cells' --ray-resources)"
        if cell.device not in cls.spec.devices:
            return f"unavailable: {cls.spec.name} runs on {', '.join(cls.spec.devices)}, not {cell.device}"
    else:
        reason = cls.unavailable_reason(cell.device)
        if reason:
            return f"unavailable: {reason}"
    reason = cls.mode_unsupported_reason(cell.causal)
    if reason:
        return reason
    if cell.pass_ == "fwdbwd":
        reason = cls.backward_unsupported_reason(cell.device)
        if reason:
            return reason
    if cell.pass_ == "decode":
        reason = cls.decode_unsupported_reason()
        if reason:
            return f"cannot decode: {reason}"
    return cls.dtype_unsupported_reason(cell.device, config.dtype)


def shape_only_variant(config: RunConfig, name: str):
    """The variant with the run's options on the meta device: what the parent plans cells from."""
    return shape_only(name, **config.variant_options(name))


def predicted_bytes(config: RunConfig, cell: Cell, attn) -> int:
    """Inputs (and their gradients) plus the variant's own estimate of its extra memory."""
    el = config.element_size
    if cell.pass_ == "decode":  # the prompt's q, k, v and its KV cache, at most, twice (a step's copy beside the state)
        kv = 2 * config.batch * config.key_heads * cell.n * config.head_dim * el
        return int(3 * kv / 2 + 2 * kv)
    backward = cell.pass_ == "fwdbwd"
    inputs = (
        (config.heads + 2 * config.key_heads) * config.batch * cell.n * config.head_dim * el * (3 if backward else 1)
    )
    params = sum(p.numel() for p in attn.parameters()) * el * (3 if backward else 1)  # (+ gradients)
    inputs += params
    extra = attn.memory_estimate(
        config.batch, config.heads, cell.n, cell.n, config.head_dim, config.head_dim, el, cell.causal, backward
    )
    return int(inputs + extra)


def base_row(config: RunConfig, cell: Cell) -> Row:
    """The row of a cell before its fate is decided: its key and identity."""
    return Row(
        device=cell.device,
        variant=cell.variant,
        pass_=cell.pass_,
        causal=cell.causal,
        n=cell.n,
        batch=config.batch,
        heads=config.heads,
        kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        dtype=config.dtype,
        options=config.options_of(cell.variant),
    )


def useful_flops(config: RunConfig, cell: Cell, attn) -> float | None:
    d = config.head_dim
    if cell.pass_ == "decode":  # memory-bound: its figure is the bandwidth of reading the state (bandwidth_gbs)
        return None
    per_head = attn.flops(cell.n, cell.n, d, d, cell.causal)
    if cell.pass_ == "fwdbwd":
        per_head *= attn.backward_flops_factor
    return per_head * config.batch * config.heads


def outcome_status(outcome: Outcome) -> tuple[str, str]:
    """(status, message) for a child that did not return a result normally."""
    if outcome.kind == "timeout":
        return "timeout", "killed after --cell-timeout"
    if outcome.kind == "exception":
        _, _, oom = outcome.value
        return ("oom" if oom else "error"), outcome.describe()
    if outcome.kind == "killed":
        import signal

        if outcome.signal == signal.SIGKILL:
            return "oom", outcome.describe() + " (most likely the kernel's out-of-memory killer)"
        return "error", outcome.describe()
    return "error", outcome.describe()


def run_cell(config: RunConfig, cell: Cell, state: SweepState, log_path: str | None = None, executor=None) -> Row:
    started = time.perf_counter()
    planned: dict = {}
    status, message, measured, node = decide(config, cell, state, planned, log_path, executor or LocalExecutor())
    values = {
        **base_row(config, cell).to_json(),
        "device_name": cell.device_name,
        **planned,
        "status": status,
        "message": message,
        **(measured or {}),
    }
    if node:  # where an executor ran it on a cluster (a node of the cell's hardware, device_name)
        values["node"] = node
    median = values.get("time_median_s")
    if status == "ok" and median:
        if values.get("flops") is not None:
            values["gflops"] = values["flops"] / median / 1e9
        if values.get("read_bytes") is not None:  # decode: what a step reads of its state, once
            values["bandwidth_gbs"] = values["read_bytes"] / median / 1e9
    values["wall_s"] = round(time.perf_counter() - started, 3)
    values["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return Row.from_json(values)


def decide(config: RunConfig, cell: Cell, state: SweepState, planned: dict, log_path: str | None, executor):
    """(status, message, measured values or None, node record or None) of one cell; what the parent
    planned of it (flops, predicted_bytes, softmax_error) goes into `planned`."""
    reason = static_skip_reason(config, cell, remote=getattr(executor, "remote", False))
    if reason:
        return "skipped", reason, None, None
    with state.lock:
        stopped = state.stopped.get(cell.series)
    if stopped:
        return "skipped", f"series stopped at N={stopped[0]} ({stopped[1]})", None, None
    try:  # what the parent needs of the variant: its FLOPs and memory estimate, from a shape-only instance
        attn = shape_only_variant(config, cell.variant)
        reason = attn.length_unsupported_reason(cell.n, cell.n)
        if reason:
            return "skipped", f"{cell.variant} at N={cell.n}: {reason}", None, None
        planned["flops"] = useful_flops(config, cell, attn)
        planned["predicted_bytes"] = predicted = predicted_bytes(config, cell, attn)
    except Exception as err:  # noqa: BLE001 — a plug-in variant's fault costs its cells, not the sweep
        return "error", f"cannot plan the cell: {type(err).__name__}: {err}"[:1000], None, None
    budget = config.budget(cell.device)
    if budget is not None and predicted > budget:
        return "skipped", f"predicted {fmt_bytes(predicted)} > memory budget {fmt_bytes(budget)}", None, None
    # the baseline is never skipped by prediction: every other variant's speed-up needs its cell (a noisy slope
    # overestimates), and one past the timeout costs the series one timeout
    guess = None if cell.variant == BASELINE else state.predicted_time(cell)
    if guess is not None and guess[0] * calls_per_cell(config) * PREDICTION_MARGIN > config.cell_timeout:
        seconds, exponent, n1, n2 = guess
        return (
            "skipped",
            f"predicted {seconds:.3g} s a call (~N^{exponent:.2f} from N={n1} and {n2}): its "
            f"{calls_per_cell(config)} calls would pass {config.cell_timeout / PREDICTION_MARGIN:g} s, "
            f"1/{PREDICTION_MARGIN:g} of --cell-timeout {config.cell_timeout:g} s (the prediction's margin)",
            None,
            None,
        )
    check = ensure_checked(config, cell, state, log_path, executor)
    if check is not None:
        return check[0], check[1], None, None
    planned["softmax_error"] = state.softmax_errors.get((cell.device, cell.device_name, cell.variant, cell.causal))
    job = executor.submit(
        worker.measure_cell,
        (config, cell),
        device=cell.device,
        device_name=cell.device_name,
        timeout=config.cell_timeout,
        imports=config.imports,
        log_path=log_path,
    )
    outcome, node = executor.outcome(job)
    if outcome.kind == "result":
        return "ok", "", outcome.value, node
    return (*outcome_status(outcome), None, node)


CHECK_TIMEOUT_S = 300.0  # the least a correctness check may take: a compiled variant's first call compiles (cold cache)


def check_timeout(config: RunConfig) -> float:
    """Seconds the correctness check may take: --cell-timeout, or CHECK_TIMEOUT_S where that is shorter (a
    check that times out costs every cell of its variant and mode; its compile warms the cells' cache)."""
    return max(config.cell_timeout, CHECK_TIMEOUT_S)


def ensure_checked(config: RunConfig, cell: Cell, state: SweepState, log_path: str | None = None, executor=None):
    """None when the variant matches its dense definition on this device; else (status, message) for its cells.

    Checked once per (device, hardware, variant, causal); series that share a check wait for the first."""
    executor = executor or LocalExecutor()
    key = (cell.device, cell.device_name, cell.variant, cell.causal)
    with state.lock:
        lock = state.check_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in state.checks:
            job = executor.submit(
                worker.check_variant,
                (config, cell.device, cell.variant, cell.causal),
                device=cell.device,
                device_name=cell.device_name,
                timeout=check_timeout(config),
                imports=config.imports,
                log_path=log_path,
            )
            outcome, _ = executor.outcome(job)
            if outcome.kind == "result":
                result = outcome.value
                state.checks[key] = None if result["ok"] else ("incorrect", result["message"])
                state.softmax_errors[key] = result.get("softmax_error")
            else:
                status, message = outcome_status(outcome)
                state.checks[key] = (status, f"correctness check failed: {message}")
    return state.checks[key]


def retry_failed(run_dir: Path, config: RunConfig, device_names: dict | None = None) -> int:
    """Set aside the rows of cells that ended in oom, timeout or error, and of the cells their series
    skipped after them, so the sweep measures them again. They move to RUN_DIR/superseded.jsonl
    (nothing is deleted); results.jsonl is rewritten atomically. Call only under the run's lock.
    Returns how many rows were set aside."""
    rows = run_rows(run_dir, config, device_names, quiet=True)
    first_failure = {}  # series -> smallest N that failed
    for row in rows:
        if row["status"] in FAILED:
            series, n = series_key(row), int(row["n"])
            first_failure[series] = min(n, first_failure.get(series, n))

    def retried(row: dict) -> bool:
        start = first_failure.get(series_key(row))
        return (
            start is not None
            and int(row["n"]) >= start
            and (row["status"] in FAILED or "series stopped" in row.get("message", ""))
        )

    moved = [row for row in rows if retried(row)]
    if moved:
        with RowWriter(run_dir, SUPERSEDED) as writer:
            for row in moved:
                writer.append(row)
        # every other line stays, rows of other configurations too
        rewrite_rows(run_dir, [row for row in read_rows(run_dir, quiet=True) if not retried(row)])
    return len(moved)


def sweep(
    config: RunConfig,
    run_dir: Path,
    on_row: Callable[[Cell, dict | None], None] | None = None,
    device_names: dict | None = None,
    executor=None,
) -> list[dict]:
    """Run every cell of the plan that has no row yet; returns all rows of the run. Call under the run's lock.

    With the local executor the cells run one after the other. An executor that runs cells in parallel
    (Ray) gets each series (the cells of one device, hardware, variant, pass and causal mode, by
    increasing N) in a thread of its own, as many at once as the hardware has slots; within a series
    the order is kept, so an oom or timeout still stops the larger N. Rows are appended as cells finish."""
    executor = executor or LocalExecutor(device_names)
    drop_torn_tail(run_dir)
    rows = run_rows(run_dir, config, device_names)
    state = SweepState.from_rows(rows)
    todo = [cell for cell in plan(config, device_names) if cell.key not in state.done]
    log_path = str(Path(run_dir) / WORKER_LOG)
    written = threading.Lock()
    with RowWriter(run_dir) as writer:

        def one(cell: Cell) -> None:
            if on_row:
                with written:
                    on_row(cell, None)
            row = run_cell(config, cell, state, log_path, executor)
            data = row.to_json()
            with written:
                writer.append(row)
                state.record(data)
                rows.append(data)
                if on_row:
                    on_row(cell, data)

        if not executor.parallel:
            for cell in todo:
                one(cell)
        else:
            _in_parallel(todo, one, executor)
    return rows


def _in_parallel(todo: list[Cell], one: Callable[[Cell], None], executor) -> None:
    """Each series in a thread, as many threads per hardware as it has slots; Ctrl-C cancels what runs."""
    from concurrent.futures import ThreadPoolExecutor

    series: dict[tuple, list[Cell]] = {}
    for cell in todo:
        series.setdefault(cell.series, []).append(cell)
    stop = threading.Event()

    def run_series(cells: list[Cell]) -> None:
        for cell in cells:
            if stop.is_set():
                return
            one(cell)

    slots: dict[tuple, int] = {}
    for cell in todo:
        slots[(cell.device, cell.device_name)] = max(1, executor.devices(cell.device).get(cell.device_name, 1))
    pools = {
        group: ThreadPoolExecutor(max_workers=count, thread_name_prefix=f"cells-{group[0]}")
        for group, count in slots.items()
    }
    futures = [pools[(cells[0].device, cells[0].device_name)].submit(run_series, cells) for cells in series.values()]
    try:
        for future in futures:
            while True:
                try:
                    future.result(timeout=0.5)  # short waits, so Ctrl-C reaches this thread
                    break
                except TimeoutError:
                    continue
    except BaseException:
        stop.set()
        for future in futures:
            future.cancel()
        executor.cancel_all()
        raise
    finally:
        for pool in pools.values():
            pool.shutdown(wait=not stop.is_set(), cancel_futures=True)


def todo_cells(config: RunConfig, run_dir: Path, device_names: dict | None = None) -> list[Cell]:
    done = {cell_key(row) for row in run_rows(run_dir, config, device_names, quiet=True)}
    return [cell for cell in plan(config, device_names) if cell.key not in done]


def current_device_names(devices: tuple[str, ...], gpu: dict | None = None) -> dict:
    """What each device of the run is on this machine: the CPU model, the GPU's name (from `gpu`, the
    `worker.cuda_info` record, when the caller has it; else read in a child)."""
    names = {}
    for device in devices:
        if device == "cpu":
            names["cpu"] = cpu_info()["model"]
        elif device == "cuda":
            if gpu is None:
                outcome = run_isolated(worker.cuda_info, (), timeout=120)
                gpu = outcome.value if outcome.kind == "result" else {}
            names["cuda"] = gpu.get("name")
    return names


def measure_machine(config: RunConfig, peak_seconds: float = 1.0) -> dict:
    """Matmul peaks per device (run's dtype, and float32; each timed for `peak_seconds`) and GPU details,
    each measured in a child."""
    info: dict = {
        "matmul_peak_gflops": {},
        "matmul_peak_precision": {},
        "matmul_peak_seconds": peak_seconds,
        "gpu": None,
    }
    for device in config.devices:
        if device == "cuda":
            outcome = run_isolated(worker.cuda_info, (), timeout=120)
            info["gpu"] = outcome.value if outcome.kind == "result" else {"error": outcome.describe()}
        for dtype in dict.fromkeys((config.dtype, "float32")):
            outcome = run_isolated(worker.matmul_peak, (device, dtype, config.threads, peak_seconds), timeout=120)
            value = outcome.value if outcome.kind == "result" else {}
            info["matmul_peak_gflops"][f"{device}/{dtype}"] = value.get("gflops")
            info["matmul_peak_precision"][f"{device}/{dtype}"] = value.get("precision")
        if "decode" in config.passes:  # a decoding step's limit: the bandwidth of reading its state
            outcome = run_isolated(worker.memory_bandwidth, (device, config.threads, peak_seconds), timeout=120)
            info.setdefault("memory_bandwidth_gbs", {})[device] = (
                outcome.value.get("gbs") if outcome.kind == "result" else None
            )
    info["device_names"] = current_device_names(config.devices, info["gpu"] or {})
    return info


def measure_cluster(config: RunConfig, cluster, peak_seconds: float = 1.0) -> dict:
    """What `measure_machine` records, for a cluster: every node's record, and the matmul peak of each
    hardware (run's dtype and float32), measured on one of its nodes as a cell is."""
    info: dict = {
        "executor": cluster.name,
        "nodes": cluster.node_records(),
        "matmul_peak_gflops": {},
        "matmul_peak_precision": {},
        "matmul_peak_seconds": peak_seconds,
        "gpu": None,
        "device_names": cluster.device_names(config.devices),
    }
    for device, names in info["device_names"].items():
        for index, name in enumerate(names):
            for dtype in dict.fromkeys((config.dtype, "float32")):
                job = cluster.submit(
                    worker.matmul_peak,
                    (device, dtype, config.threads, peak_seconds),
                    device=device,
                    device_name=name,
                    timeout=120,
                )
                outcome, _ = cluster.outcome(job)
                value = outcome.value if outcome.kind == "result" else {}
                for label in [device_label(device, name)] + ([device] if index == 0 else []):
                    info["matmul_peak_gflops"][f"{label}/{dtype}"] = value.get("gflops")
                    info["matmul_peak_precision"][f"{label}/{dtype}"] = value.get("precision")
    return info
