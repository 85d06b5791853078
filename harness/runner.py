"""The sweep: decide each cell's fate, run it in its own process, append its row the moment it exists.

The parent never runs attention. For each cell it decides, in order:
  1. skipped by the variant's spec (device, causal, backward, dtype) or because its series already
     stopped (oom / timeout / skipped at a smaller N), or predicted above the memory budget;
  2. incorrect (or the check's own failure) when the variant disagrees with its dense definition
     at a small N on that device — checked once per (device, variant, causal), before any timing;
  3. otherwise measured in a child process: ok, oom, timeout or error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from harness import worker
from harness.config import Cell, RunConfig, plan, shape_only
from harness.fmt import fmt_bytes
from harness.isolation import Outcome, run_isolated
from harness.rows import Row, cell_key, run_rows
from harness.storage import SUPERSEDED, RowWriter, drop_torn_tail, read_rows, rewrite_rows

STOPPING = ("oom", "timeout", "skipped")  # a series that hits one of these does not try larger N
FAILED = ("oom", "timeout", "error")  # what --retry-failed measures again
WORKER_LOG = "worker.log"  # what the cells' processes print (compiler warnings, tracebacks)


@dataclass
class SweepState:
    """What the parent knows while it sweeps: finished cells, stopped series, checked variants."""

    done: set = field(default_factory=set)
    stopped: dict = field(default_factory=dict)  # series -> (n, status)
    checks: dict = field(default_factory=dict)  # (device, variant, causal) -> (status, message) or None when it passed

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "SweepState":
        state = cls()
        for row in sorted(rows, key=lambda r: int(r["n"])):
            state.record(row)
        return state

    def record(self, row: dict) -> None:
        key = cell_key(row)
        self.done.add(key)
        series = key[:4]
        if row["status"] in STOPPING and series not in self.stopped:
            self.stopped[series] = (key[4], row["status"])


def static_skip_reason(config: RunConfig, cell: Cell) -> str | None:
    """Why the spec says this cell cannot run, or None."""
    import variants

    cls = variants.variant_class(cell.variant)
    reason = cls.unavailable_reason(cell.device)
    if reason:
        return f"unavailable: {reason}"
    if cell.causal and not cls.spec.supports_causal:
        return f"{cell.variant} does not support causal attention"
    if cell.pass_ == "fwdbwd":
        reason = cls.backward_unsupported_reason(cell.device)
        if reason:
            return reason
    return cls.dtype_unsupported_reason(cell.device, config.dtype)


def shape_only_variant(config: RunConfig, name: str):
    """The variant with the run's options on the meta device: what the parent plans cells from."""
    return shape_only(name, **config.variant_options(name))


def predicted_bytes(config: RunConfig, cell: Cell, attn) -> int:
    """Inputs (and their gradients) plus the variant's own estimate of its extra memory."""
    el = config.element_size
    backward = cell.pass_ == "fwdbwd"
    inputs = 3 * config.batch * config.heads * cell.n * config.head_dim * el * (3 if backward else 1)
    params = sum(p.numel() for p in attn.parameters()) * el * (3 if backward else 1)  # (+ gradients)
    inputs += params
    extra = attn.memory_estimate(config.batch, config.heads, cell.n, cell.n, config.head_dim, config.head_dim, el, cell.causal, backward)
    return int(inputs + extra)


def base_row(config: RunConfig, cell: Cell) -> Row:
    """The row of a cell before its fate is decided: its key and identity."""
    return Row(device=cell.device, variant=cell.variant, pass_=cell.pass_, causal=cell.causal, n=cell.n, batch=config.batch,
               heads=config.heads, head_dim=config.head_dim, dtype=config.dtype, options=config.options_of(cell.variant))


def useful_flops(config: RunConfig, cell: Cell, attn) -> float:
    d = config.head_dim
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


def run_cell(config: RunConfig, cell: Cell, state: SweepState, log_path: str | None = None) -> Row:
    row = base_row(config, cell)
    started = time.perf_counter()
    status, message, measured = decide(config, cell, state, row, log_path)
    row = Row.from_json({**row.to_json(), "status": status, "message": message, **(measured or {})})
    if status == "ok" and row.time_median_s:
        row.gflops = row.flops / row.time_median_s / 1e9
    row.wall_s = round(time.perf_counter() - started, 3)
    row.finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return row


def decide(config: RunConfig, cell: Cell, state: SweepState, row: Row, log_path: str | None = None):
    reason = static_skip_reason(config, cell)
    if reason:
        return "skipped", reason, None
    if cell.series in state.stopped:
        n, status = state.stopped[cell.series]
        return "skipped", f"series stopped at N={n} ({status})", None
    try:  # what the parent needs of the variant: its FLOPs and memory estimate, from a shape-only instance
        attn = shape_only_variant(config, cell.variant)
        row.flops = useful_flops(config, cell, attn)
        row.predicted_bytes = predicted = predicted_bytes(config, cell, attn)
    except Exception as err:  # noqa: BLE001 — a plug-in variant's fault costs its cells, not the sweep
        return "error", f"cannot plan the cell: {type(err).__name__}: {err}"[:1000], None
    budget = config.budget(cell.device)
    if budget is not None and predicted > budget:
        return "skipped", f"predicted {fmt_bytes(predicted)} > memory budget {fmt_bytes(budget)}", None
    check = ensure_checked(config, cell, state, log_path)
    if check is not None:
        return check[0], check[1], None
    outcome = run_isolated(worker.measure_cell, (config, cell), timeout=config.cell_timeout,
                           imports=config.imports, log_path=log_path)
    if outcome.kind == "result":
        return "ok", "", outcome.value
    return (*outcome_status(outcome), None)


def ensure_checked(config: RunConfig, cell: Cell, state: SweepState, log_path: str | None = None):
    """None when the variant matches its dense definition on this device; else (status, message) for its cells."""
    key = (cell.device, cell.variant, cell.causal)
    if key not in state.checks:
        outcome = run_isolated(worker.check_variant, (config, cell.device, cell.variant, cell.causal),
                               timeout=config.cell_timeout, imports=config.imports, log_path=log_path)
        if outcome.kind == "result":
            result = outcome.value
            state.checks[key] = None if result["ok"] else ("incorrect", result["message"])
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
            series, n = cell_key(row)[:4], int(row["n"])
            first_failure[series] = min(n, first_failure.get(series, n))

    def retried(row: dict) -> bool:
        start = first_failure.get(cell_key(row)[:4])
        return (start is not None and int(row["n"]) >= start
                and (row["status"] in FAILED or "series stopped" in row.get("message", "")))

    moved = [row for row in rows if retried(row)]
    if moved:
        with RowWriter(run_dir, SUPERSEDED) as writer:
            for row in moved:
                writer.append(row)
        # every other line stays, rows of other configurations too
        rewrite_rows(run_dir, [row for row in read_rows(run_dir, quiet=True) if not retried(row)])
    return len(moved)


def sweep(config: RunConfig, run_dir: Path, on_row: Callable[[Cell, dict | None], None] | None = None,
          device_names: dict | None = None) -> list[dict]:
    """Run every cell of the plan that has no row yet; returns all rows of the run. Call under the run's lock."""
    drop_torn_tail(run_dir)
    rows = run_rows(run_dir, config, device_names)
    state = SweepState.from_rows(rows)
    todo = [cell for cell in plan(config) if cell.key not in state.done]
    log_path = str(Path(run_dir) / WORKER_LOG)
    with RowWriter(run_dir) as writer:
        for cell in todo:
            if on_row:
                on_row(cell, None)
            row = run_cell(config, cell, state, log_path)
            row.device_name = (device_names or {}).get(cell.device)
            writer.append(row)
            data = row.to_json()
            state.record(data)
            rows.append(data)
            if on_row:
                on_row(cell, data)
    return rows


def todo_cells(config: RunConfig, run_dir: Path, device_names: dict | None = None) -> list[Cell]:
    done = {cell_key(row) for row in run_rows(run_dir, config, device_names, quiet=True)}
    return [cell for cell in plan(config) if cell.key not in done]


def current_device_names(devices: tuple[str, ...], gpu: dict | None = None) -> dict:
    """What each device of the run is on this machine: the CPU model, the GPU's name (from `gpu`, the
    `worker.cuda_info` record, when the caller has it; else read in a child)."""
    from harness.machine import cpu_info

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
    info: dict = {"matmul_peak_gflops": {}, "matmul_peak_precision": {}, "matmul_peak_seconds": peak_seconds, "gpu": None}
    for device in config.devices:
        if device == "cuda":
            outcome = run_isolated(worker.cuda_info, (), timeout=120)
            info["gpu"] = outcome.value if outcome.kind == "result" else {"error": outcome.describe()}
        for dtype in dict.fromkeys((config.dtype, "float32")):
            outcome = run_isolated(worker.matmul_peak, (device, dtype, config.threads, peak_seconds), timeout=120)
            value = outcome.value if outcome.kind == "result" else {}
            info["matmul_peak_gflops"][f"{device}/{dtype}"] = value.get("gflops")
            info["matmul_peak_precision"][f"{device}/{dtype}"] = value.get("precision")
    info["device_names"] = current_device_names(config.devices, info["gpu"] or {})
    return info
