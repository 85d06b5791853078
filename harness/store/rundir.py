"""A run directory's life, the same for `bench run` and `bench quality`.

run_dir = new_run_dir(out, prefix)          # refuses a directory that exists: a run never overwrites one
start(run_dir, "sweep", config_json, ...)   # created complete (metadata.json) or not at all
metadata = open_to_resume(run_dir, "sweep", imports_given)
with RunLock(run_dir): ...                  # one writer at a time (storage.RunLock)
"""

from __future__ import annotations

import socket
import sys
from datetime import datetime
from pathlib import Path

from harness.core import TIMING_CORE
from harness.core.machine import environment
from harness.options import ArgumentError
from harness.store.storage import create_run_dir, read_metadata, write_metadata

COMMANDS = {"sweep": "bench run", "quality": "bench quality", "lm": "bench lm"}


def default_out_dir(prefix: str = "") -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{prefix}{stamp}-{socket.gethostname()}"


def new_run_dir(out: Path | None, prefix: str = "") -> Path:
    """Where a new run goes: `out`, or results/<prefix><timestamp>-<host>; ArgumentError if it exists."""
    run_dir = out or default_out_dir(prefix)
    if run_dir.exists():
        raise ArgumentError(
            f"--out: {run_dir} already exists; a run never overwrites one (use --resume {run_dir} to finish it)"
        )
    return run_dir


def start(run_dir: Path, kind: str, config: dict, machine: dict | None = None, variants: dict | None = None) -> None:
    """Create RUN_DIR with its metadata: the kind, the configuration, the environment, the command and
    `variants`, the facts of the run's variants (`config.recorded_facts`) that readers use."""
    metadata = {
        "kind": kind,
        "config": config,
        "environment": environment(sys.argv),
        "argv": sys.argv,
        "timing_core": TIMING_CORE,
    }
    if variants is not None:
        metadata["variants"] = variants
    if machine is not None:
        metadata["machine"] = machine
    create_run_dir(run_dir, metadata)


def open_to_resume(run_dir: Path, kind: str, imports_given: list[str]) -> dict:
    """RUN_DIR's metadata, for resuming it as a run of `kind`. ArgumentError when it is another kind, when
    another measuring core timed it (`TIMING_CORE`), or when it was run with --import modules not named
    again (resuming runs their code)."""
    try:
        metadata = read_metadata(run_dir)
    except (FileNotFoundError, ValueError) as err:
        raise ArgumentError(f"--resume: {err}") from None
    if metadata["kind"] != kind:
        raise ArgumentError(
            f"--resume: {run_dir} is a {metadata['kind']} run; resume it with "
            f"{COMMANDS.get(metadata['kind'], 'the command that made it')} --resume {run_dir}"
        )
    core = metadata.get("timing_core", 1)
    if core != TIMING_CORE:
        raise ArgumentError(
            f"--resume: {run_dir} was timed by measuring core {core}"
            + (" (it records none: made before runs recorded it)" if "timing_core" not in metadata else "")
            + f"; this version's is {TIMING_CORE} (harness.core.TIMING_CORE), so resuming would put rows "
            f"timed two ways into one run; start a new run with --out instead"
        )
    stored = list(metadata["config"].get("imports") or [])
    missing = [module for module in stored if module not in imports_given]
    if missing:
        raise ArgumentError(
            f"--resume: {run_dir} was run with --import {' --import '.join(stored)}; resuming would run that "
            f"code, so name it again to allow it: --import {' --import '.join(missing)}"
        )
    return metadata


def report_asked(run_dir: Path, given: bool | None, resumed: bool) -> bool:
    """Whether the command ends by writing RUN_DIR/REPORT.md: --report/--no-report as given now, else as the run's
    first command said (a run started with --no-report resumes without a report). A new run records its answer."""
    if resumed:
        return given if given is not None else bool(read_metadata(run_dir).get("report", True))
    if given is False:
        write_metadata(run_dir, {**read_metadata(run_dir), "report": False})
    return given is not False


def resume_command(kind: str, run_dir: Path, imports: tuple[str, ...] | list[str] = ()) -> str:
    return f"{COMMANDS[kind]} --resume {run_dir}" + "".join(f" --import {module}" for module in imports)


def check_same_devices(stored: dict | None, current: dict, run_dir: Path) -> None:
    """ArgumentError when a device of the run is another model here (a resume would mix machines)."""
    for device, name in (stored or {}).items():
        if name and current.get(device) and current[device] != name:
            raise ArgumentError(
                f"--resume: {run_dir} was measured on {device} '{name}', this machine's {device} is "
                f"'{current[device]}'; start a new run here (bench compare can put the two side by side)"
            )
