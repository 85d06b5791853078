"""Where a run lives on disk: `results.jsonl` (one row per finished cell) and `metadata.json`.

Rows are appended and flushed to disk the moment a cell finishes, one `write` per line, so a
killed run loses only the cell in flight; a torn last line (kill mid-write) is dropped on resume.
pandas reads the file directly: `pandas.read_json(path, lines=True)`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS = "results.jsonl"
METADATA = "metadata.json"


def write_metadata(run_dir: Path, metadata: dict) -> None:
    tmp = run_dir / (METADATA + ".tmp")
    tmp.write_text(json.dumps(metadata, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, run_dir / METADATA)


def read_metadata(run_dir: Path) -> dict:
    path = Path(run_dir) / METADATA
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no {METADATA}")
    return json.loads(path.read_text())


def read_rows(run_dir: Path, name: str = RESULTS) -> list[dict]:
    """Every complete row of RUN_DIR/name; a torn last line is ignored."""
    path = Path(run_dir) / name
    if not path.is_file():
        return []
    rows = []
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # torn by a kill mid-write
            rows.append(json.loads(line))
    return rows


def drop_torn_tail(run_dir: Path, name: str = RESULTS) -> None:
    """Cut a partial last line so appended rows start on a line of their own."""
    path = Path(run_dir) / name
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


class RowWriter:
    """Appends rows to results.jsonl, each durable before `append` returns."""

    def __init__(self, run_dir: Path, name: str = RESULTS):
        self.path = Path(run_dir) / name
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, row: dict) -> None:
        line = (json.dumps(row, sort_keys=True, default=str) + "\n").encode()
        os.write(self._fd, line)
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_frame(run_dir: Path):
    """The run's rows as a pandas DataFrame (empty with the right columns if no row yet)."""
    import pandas as pd

    rows = read_rows(run_dir)
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=["device", "variant", "pass", "causal", "n", "status"])
