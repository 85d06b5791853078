"""A sweep's result row, typed: one measured (or not measured) cell of `bench run`.

    row = Row.from_json(line_dict)     # unknown fields are kept in row.extra, missing ones get defaults
    row.to_json()                      # the dict written to results.jsonl (key "pass", not "pass_")

Which stored rows belong to a run (`belongs`, `run_rows`) is decided here too, from the run's
configuration alone: reading a run never imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from harness.store.storage import RESULTS, read_rows, warn

IDENTITY = (
    "batch",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "options",
)  # beyond the cell key, what changes a measurement
STATUSES = (
    "ok",
    "skipped",
    "incorrect",
    "oom",
    "timeout",
    "error",
)  # every row's status, and what each set of them means:
STOPPING = (
    "oom",
    "timeout",
)  # a series that hits one of these does not try larger N (a skip is decided for each N: a budget
# skip recurs at every larger N by its own prediction; a length a method refuses may be too short, not too long)
FAILED = ("oom", "timeout", "error")  # what --retry-failed measures again
NO_TIME = ("incorrect", *FAILED)  # tried and gave no time: bench advise excludes the variant from that N on


@dataclass(frozen=True)
class Row:
    """One cell of a sweep: what was asked (the key and identity), what happened (status, message) and,
    when it ran, what was measured. Times are seconds per call; memory is extra bytes beyond the inputs.
    Frozen: a row is made once, with everything it says (`dataclasses.replace` makes another)."""

    device: str
    variant: str
    pass_: str  # "fwd", "fwdbwd" or "decode"; stored as "pass"
    causal: bool
    n: int
    batch: int = 1
    heads: int = 8
    kv_heads: int | None = (
        None  # heads of k and v (grouped-query attention); None: heads (and every row from before it)
    )
    head_dim: int = 64
    dtype: str = "float32"
    options: dict = field(default_factory=dict)  # every option the variant ran with (defaults filled in)
    status: str | None = None  # one of STATUSES
    message: str = ""  # why a cell did not run (or what its check said)
    time_median_s: float | None = None
    time_min_s: float | None = None
    time_iqr_s: float | None = None
    timed_calls: int = 0
    calls_per_sample: int | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None  # CUDA: the caching allocator's reserved peak
    memory_kind: str | None = None  # "rss" (CPU) or "allocator" (CUDA)
    predicted_bytes: int | None = None
    state_bytes: int | None = None  # decode: the decoding state after N positions (what a step reads)
    state_kind: str | None = None  # decode: "kv", "window" or "recurrent"
    read_bytes: int | None = None  # decode: the bytes of the state one step reads (the variant's step_read_bytes)
    bandwidth_gbs: float | None = None  # decode: read_bytes / time_median_s
    flops: float | None = None  # useful FLOPs of one call
    gflops: float | None = None  # flops / time_median_s
    threads: int | None = None
    kernel: str | None = None
    softmax_error: float | None = (
        None  # ‖out − exact softmax attention‖ / ‖exact‖ on the gate's inputs (float64 exact, same scale)
    )
    device_name: str | None = None  # the CPU model or GPU name
    load_before: float | None = None
    load_after: float | None = None
    others_cores: float | None = None
    spread: float | None = None  # IQR / median
    noisy: bool | None = None
    noise: str | None = None
    wall_s: float | None = None
    finished: str | None = None  # ISO time
    extra: dict = field(default_factory=dict)  # fields this version does not know, kept as they were

    def to_json(self) -> dict:
        data = {
            ("pass" if f.name == "pass_" else f.name): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "extra"
        }
        return {**self.extra, **data}

    @classmethod
    def from_json(cls, data: dict) -> "Row":
        """A row from its stored dict; KeyError/TypeError/ValueError when the cell key is missing or malformed."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "pass_"}
        values = {key: value for key, value in data.items() if key in known}
        values.update(pass_=data["pass"], causal=bool(data["causal"]), n=int(data["n"]))
        extra = {key: value for key, value in data.items() if key not in known and key != "pass"}
        return cls(**values, extra=extra)


def key_of(device: str, variant: str, pass_: str, causal: bool, n: int, device_name: str | None) -> tuple:
    """The one cell key: (device, variant, pass, causal, N, device name), one cell on one hardware."""
    return (device, variant, pass_, bool(causal), int(n), device_name)


def cell_key(row: dict) -> tuple:
    """A stored row's cell key (`key_of`)."""
    return key_of(row["device"], row["variant"], row["pass"], row["causal"], row["n"], row.get("device_name"))


def device_label(device: str, device_name: str | None) -> str:
    """How tables, figures and progress name a device on one hardware: "cuda (NVIDIA H100 80GB HBM3)"."""
    return f"{device} ({device_name})" if device_name else device


def series_key(row: dict) -> tuple:
    """The cell key without N: the series a larger N continues."""
    device, variant, pass_, causal, _, name = cell_key(row)
    return (device, variant, pass_, causal, name)


def belongs(row: dict, config, device_names: dict | None = None) -> bool:
    """Whether a stored row measures a cell of this configuration (a `RunConfig`): its cell is in the
    plan, and its shape, dtype, options (and device name, where both are known) are the run's."""
    try:
        device, variant, pass_, causal, n, name = cell_key(row)
    except (KeyError, TypeError, ValueError):
        return False
    decoded = pass_ == "decode" and causal  # (decoding is causal, whatever modes the variant is measured in otherwise)
    if (
        device not in config.devices
        or variant not in config.variants
        or pass_ not in config.passes
        or not (causal in config.modes_of(variant) or decoded)
        or n not in config.lengths
    ):
        return False
    shape = {"batch": config.batch, "heads": config.heads, "head_dim": config.head_dim, "dtype": config.dtype}
    if any(row.get(key) != value for key, value in shape.items()):
        return False
    if (row.get("kv_heads") or row.get("heads")) != config.key_heads:
        return False
    options = row.get("options")
    expected = config.resolved(variant)
    if expected is not None:
        if options != expected:
            return False
    elif not isinstance(options, dict) or any(options.get(k, v) != v for k, v in config.options if k in options):
        return False  # a run from before options were resolved at its start: its explicit options must agree
    here = (device_names or {}).get(device)  # a name, or the names of a cluster's hardware
    if isinstance(here, (list, tuple)):
        return name in here
    return not (here and name and name != here)


def _named(row: dict, device_names: dict | None) -> dict:
    """A row from before rows recorded their hardware gets the run's name for its device (so its key matches)."""
    here = (device_names or {}).get(row["device"])
    if row.get("device_name") is None and isinstance(here, str):
        return {**row, "device_name": here}
    return row


def run_rows(run_dir: Path, config, device_names: dict | None = None, quiet: bool = False) -> list[dict]:
    """The rows of RUN_DIR that belong to `config`, one per cell (the latest where a cell repeats),
    with a one-line warning for what is left out."""
    rows = read_rows(run_dir, quiet=quiet)
    mine = [_named(row, device_names) for row in rows if belongs(row, config, device_names)]
    latest = {cell_key(row): row for row in mine}
    if not quiet and len(mine) < len(rows):
        warn(
            f"{Path(run_dir) / RESULTS}: {len(rows) - len(mine)} rows belong to another configuration "
            "(shape, dtype, options, device or plan) and are ignored"
        )
    if not quiet and len(latest) < len(mine):
        warn(
            f"{Path(run_dir) / RESULTS}: {len(mine) - len(latest)} cells appear more than once; the latest row of each is used"
        )
    kept = {id(row) for row in latest.values()}
    return [row for row in mine if id(row) in kept]
