"""Where a run lives on disk: `results.jsonl` (one row per finished cell) and `metadata.json`.

Rows are appended and flushed to disk the moment a cell finishes, one `write` per line, so a
killed run loses only the cell in flight; a torn last line (kill mid-write) is dropped on resume.
pandas reads the file directly: `pandas.read_json(path, lines=True)`.

One writer per run directory: `bench run` and `bench quality` hold `RunLock` (an advisory `flock`
on RUN_DIR/.lock) for their whole life; a second writer is refused with the holder's PID. The file
stays when the writer exits, cleanly or not (the kernel drops the flock; deleting the file would let a
writer that had just opened it lock an orphan while a third creates a new one), so a leftover .lock
with a stale PID is harmless and never needs removing (it is gitignored). Readers
(report, plot, compare) take no lock and read whatever complete rows exist. Reading is tolerant
and loud: a line that does not parse is skipped with a warning naming the file and line.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path

RESULTS = "results.jsonl"  # a sweep's rows
QUALITY_RESULTS = "quality.jsonl"  # a quality run's rows
LM_RESULTS = "lm.jsonl"  # a bench lm run's rows
TRAIN_COST = "train_cost.jsonl"  # a quality run's training-step costs, one row per (task, variant, length)
SUPERSEDED = "superseded.jsonl"  # rows set aside by --retry-failed
METADATA = "metadata.json"
LOCK = ".lock"
SCHEMA_VERSION = 2  # of metadata.json: 2 adds "schema" and "kind" ("sweep" or "quality")


def warn(message: str) -> None:
    """A one-line warning on stderr (readers keep going; the user sees what was skipped and why)."""
    print(f"warning: {message}", file=sys.stderr)


class RunDirBusy(RuntimeError):
    """Another process is writing the run directory."""


class RunLock:
    """Exclusive, advisory lock on a run directory for the life of one writer (released when it exits,
    however it exits: the kernel drops a flock with the process)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(
                f"{self.path.parent} is being written by another process (PID {holder}); "
                "wait for it to finish or stop it, then resume"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


def write_metadata(run_dir: Path, metadata: dict) -> None:
    tmp = run_dir / (METADATA + ".tmp")
    text = json.dumps({**metadata, "schema": SCHEMA_VERSION}, indent=2, sort_keys=True, default=str, allow_nan=False)
    tmp.write_text(text + "\n")
    os.replace(tmp, run_dir / METADATA)


def create_run_dir(run_dir: Path, metadata: dict) -> None:
    """Create RUN_DIR with its metadata in one step: built beside it under a temporary name and renamed,
    so an interruption leaves either no directory or a complete one. FileExistsError if it exists."""
    run_dir = Path(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = run_dir.with_name(f".{run_dir.name}.creating-{os.getpid()}")
    tmp.mkdir()
    try:
        write_metadata(tmp, metadata)
        os.rename(tmp, run_dir)  # fails if run_dir appeared meanwhile (a non-empty directory)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_metadata(run_dir: Path) -> dict:
    """RUN_DIR/metadata.json; FileNotFoundError or ValueError naming the file when absent or corrupt.
    Unknown fields are kept; files from before schema 2 read as kind "sweep" (or "quality")."""
    path = Path(run_dir) / METADATA
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no {METADATA}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is corrupt ({err}); a run directory needs a readable {METADATA}") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise ValueError(f"{path} has no 'config' object; it was not written by bench run or bench quality")
    data.setdefault("schema", 1)
    data.setdefault("kind", "quality" if "tasks" in data["config"] else "sweep")
    return data


def variant_facts(*run_dirs: Path) -> dict[str, dict]:
    """{variant: facts} as the runs recorded them at their start (`VariantSpec.facts`: same_function_as,
    reach_option, function_options, ...); the later run wins where two name one variant. Runs made before
    facts were recorded give none (add them with scripts/record_variant_facts.py)."""
    facts: dict[str, dict] = {}
    for run_dir in run_dirs:
        facts.update(read_metadata(run_dir).get("variants") or {})
    return facts


def baseline_of(facts: dict[str, dict]) -> str | None:
    """The variant the runs' recorded facts name as the baseline (`VariantSpec.baseline`); None where none does
    (a run without it, or made before the fact was recorded: scripts/record_variant_facts.py adds it)."""
    return next((name for name, fact in facts.items() if fact.get("baseline")), None)


def _parse(line: bytes):
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) else None


def read_rows(run_dir: Path, name: str = RESULTS, quiet: bool = False) -> list[dict]:
    """Every complete row of RUN_DIR/name, in file order.

    A line that does not parse is skipped with a warning naming the file and the line (resume then
    measures that cell again); a last line without its newline is kept when it parses (only a
    genuinely torn tail, cut by a kill mid-write, is dropped).
    """
    path = Path(run_dir) / name
    if not path.is_file():
        return []
    rows = []
    lines = path.read_bytes().split(b"\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        row = _parse(line)
        if row is not None:
            rows.append(row)
        elif not quiet and number < len(lines):  # the last piece has no newline: a torn tail, dropped silently
            warn(f"{path}:{number}: not a JSON object; line skipped")
    return rows


def drop_torn_tail(run_dir: Path, name: str = RESULTS) -> None:
    """Make the file end on a newline so appended rows start on a line of their own: a complete last row
    without its newline gets one; a torn one (it does not parse) is cut."""
    path = Path(run_dir) / name
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        start = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            if _parse(data[start:]) is not None:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
            else:
                f.truncate(start)


def rewrite_rows(run_dir: Path, rows: list[dict], name: str = RESULTS) -> None:
    """Replace RUN_DIR/name by `rows`, atomically (written beside it, then renamed). Writers only, under RunLock."""
    path = Path(run_dir) / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row, sort_keys=True, default=str) + "\n" for row in rows))
    os.replace(tmp, path)


class RowWriter:
    """Appends rows to results.jsonl, each durable before `append` returns."""

    def __init__(self, run_dir: Path, name: str = RESULTS):
        self.path = Path(run_dir) / name
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, row) -> None:
        """Append one row (a dict, or a `rows.Row`) and fsync it."""
        data = row.to_json() if hasattr(row, "to_json") else row
        line = (json.dumps(data, sort_keys=True, default=str) + "\n").encode()
        os.write(self._fd, line)
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
