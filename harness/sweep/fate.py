"""A cell's fate before it runs: skipped by its spec or its series, predicted past the timeout or the memory
budget (from the series' measured cells), refused by the correctness check (once per device, variant and
causal mode), or run; and the row every cell starts from."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import variants
from harness.core.isolation import Outcome
from harness.fmt import fmt_bytes
from harness.store.rows import STOPPING, cell_key, series_key
from harness.sweep import worker
from harness.sweep.config import Cell, RunConfig
from harness.sweep.executors import LocalExecutor

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
    return variants.build(name, device="meta", **config.variant_options(name))


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


def base_row(config: RunConfig, cell: Cell) -> dict:
    """A cell's row before its fate is decided, as stored: its key and identity (Row.from_json fills the rest)."""
    return {
        "device": cell.device,
        "variant": cell.variant,
        "pass": cell.pass_,
        "causal": cell.causal,
        "n": cell.n,
        "batch": config.batch,
        "heads": config.heads,
        "kv_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "dtype": config.dtype,
        "options": config.options_of(cell.variant),
    }


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
        n = cell.n + 1 if cell.pass_ == "decode" else cell.n  # a decode cell steps to position N + 1
        reason = attn.length_unsupported_reason(n, n)
        if reason:
            return "skipped", f"{cell.variant} at N={n}: {reason}", None, None
        planned["flops"] = useful_flops(config, cell, attn)
        planned["predicted_bytes"] = predicted = predicted_bytes(config, cell, attn)
    except Exception as err:  # noqa: BLE001 — a plug-in variant's fault costs its cells, not the sweep
        return "error", f"cannot plan the cell: {type(err).__name__}: {err}"[:1000], None, None
    budget = config.budget(cell.device)
    if budget is not None and predicted > budget:
        return "skipped", f"predicted {fmt_bytes(predicted)} > memory budget {fmt_bytes(budget)}", None, None
    # the baseline is never skipped by prediction: every other variant's speed-up needs its cell (a noisy slope
    # overestimates), and one past the timeout costs the series one timeout
    guess = None if cell.variant == variants.baseline() else state.predicted_time(cell)
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
