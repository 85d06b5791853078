"""The corridor of an option: the project files a value crosses from the command line to the kernel, and the
forms it takes on the way (an int, a dict entry, (name, value) pairs, a configuration's field, JSON text).

    python scripts/corridor.py      # bench run --window 77, then a cell's child's half in this process

Each time the method is built, a profile hook reads the stack above it: every project function whose
arguments or locals hold the marker 77 (alone, a dict's or a pair's value, a dataclass's field, a JSON text)
is a step of the corridor; a from_json handed what a to_json made is a round trip. The cell runs in a child process the hook cannot enter, so the child's half (the
variant built from the run's stored configuration, as the child builds it) is replayed here.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = 77
sys.path.insert(0, str(ROOT))


def form(value, depth: int = 0) -> str | None:
    """How `value` holds the marker, or None."""
    if type(value) is int and value == MARK:
        return "int"
    if isinstance(value, str) and f": {MARK}" in value and value.lstrip().startswith("{"):
        return "JSON text"
    if depth < 3 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "config field" if any(form(v, depth + 1) for v in vars(value).values()) else None
    if depth < 3 and isinstance(value, dict) and any(form(v, depth + 1) for v in value.values()):
        return "dict"
    if depth < 3 and isinstance(value, (tuple, list)) and len(value) < 64:
        if len(value) == 2 and isinstance(value[0], str) and form(value[1], depth + 1):
            return "pairs"
        if any(form(v, depth + 1) for v in value):
            return "pairs"
    return None


def walk(kernel: str = "variants/methods/sliding_window.py") -> tuple[list, list[str]]:
    """Each build of the kernel: the stack of project calls holding the marker, outermost first, as
    (file, function, form); and the callers of every from_json that rebuilt a configuration holding the
    marker inside the command's process (the stored run, read back by a child, is another process's)."""
    chains: list[list[tuple[str, str, str]]] = []
    trips: list[str] = []
    made: list = []  # the containers every to_json returned

    def hook(frame, event, arg):
        mine = frame.f_code.co_filename.startswith(str(ROOT))
        if event == "return" and mine and frame.f_code.co_name == "to_json" and isinstance(arg, dict):
            made.extend(v for v in arg.values() if isinstance(v, (dict, list, tuple)) and v)  # (kept alive: ids stay)
        if event == "call" and mine and frame.f_code.co_name == "from_json":
            data = frame.f_locals.get("data")
            ids = {id(v) for v in made}
            if isinstance(data, dict) and form(data) and any(id(v) in ids for v in data.values()):
                back = frame.f_back.f_code  # a configuration rebuilt from its own JSON form, in this process
                trips.append(f"{Path(back.co_filename).relative_to(ROOT)}:{back.co_name}")
        if event != "call" or frame.f_code.co_name != "__init__" or not frame.f_code.co_filename.endswith(kernel):
            return
        chain = []
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(str(ROOT)) and "/scripts/" not in name:
                kinds = {form(v) for k, v in frame.f_locals.items() if k != "self"} - {None}
                if kinds:
                    chain.append((str(Path(name).relative_to(ROOT)), frame.f_code.co_name, ", ".join(sorted(kinds))))
            frame = frame.f_back
        chains.append(chain[::-1])

    from typer.testing import CliRunner

    from harness.cli import app
    from harness.sweep.config import RunConfig
    from harness.sweep.worker import build_variant

    out = Path(tempfile.mkdtemp()) / "run"
    args = ["run", "--variants", "sliding_window", "--window", str(MARK), "--lengths", "128", "--passes", "fwd"]
    args += ["--min-time", "0", "--repeats", "1", "--no-report", "--out", str(out)]
    sys.setprofile(hook)
    try:
        result = CliRunner().invoke(app, args)
        in_process = list(trips)
        config = RunConfig.from_json(json.loads((out / "metadata.json").read_text())["config"])
        import torch

        build_variant(config, "sliding_window", torch.device("cpu"))
    finally:
        sys.setprofile(None)
    if result.exit_code:
        raise SystemExit(result.output)
    return chains, in_process


if __name__ == "__main__":
    files: set[str] = set()
    chains, rebuilt = walk()
    trips = len(rebuilt)
    for chain in chains:
        print("a build of the kernel, from the command line down:")
        for file, function, kinds in chain:
            print(f"  {file:40} {function:24} {kinds}")
        files |= {file for file, _, _ in chain}
        trips += sum("JSON" in kinds for _, _, kinds in chain)
    print("from_json inside the command's process: " + (", ".join(rebuilt) or "none"))
    print(f"--window crosses {len(files)} files to the kernel; {trips} JSON round trips inside the process")
