"""The sweep: decide each cell's fate, run it in its own process, append its row the moment it exists.

The parent never runs attention. For each cell it decides, in order:
  1. skipped by the variant's spec (device, causal, backward, dtype) or because its series already
     stopped (oom / timeout / skipped at a smaller N), or predicted above the memory budget;
  2. incorrect (or the check's own failure) when the variant disagrees with its dense definition
     at a small N on that device — checked once per (device, variant, causal), before any timing;
  3. otherwise measured in a child process: ok, oom, timeout or error.

The decisions before a cell runs: fate.py; what a run records of its machines: machines.py.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from harness.store.rows import FAILED, Row, cell_key, run_rows, series_key
from harness.store.storage import SUPERSEDED, RowWriter, drop_torn_tail, read_rows, rewrite_rows
from harness.sweep.config import Cell, RunConfig
from harness.sweep.executors import LocalExecutor
from harness.sweep.fate import SweepState, base_row, decide
from harness.sweep.plan import plan


WORKER_LOG = "worker.log"  # what the cells' processes print (compiler warnings, tracebacks)


def run_cell(config: RunConfig, cell: Cell, state: SweepState, log_path: str | None = None, executor=None) -> Row:
    started = time.perf_counter()
    planned: dict = {}
    status, message, measured, node = decide(config, cell, state, planned, log_path, executor or LocalExecutor())
    values = {
        **base_row(config, cell),
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
