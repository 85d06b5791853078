"""Run code in kvpress's own environment and read back what it writes: kvpress pins transformers < 5.3, so the
KV-policy peer checks (scripts/kvpress_agreement.py, scripts/kvpress_end_to_end.py) hand it their inputs as
JSON files and a script, then compare its answers with ours."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_side(python: str, code: str, inputs: dict[str, object], args: list[str]) -> dict | None:
    """Run `code` with `python`: its argv are `args`, where "{name}" stands for the JSON file of inputs[name] and
    "{out}" for the file it must write its JSON to. Returns that JSON, or None (its stderr printed) on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {name: Path(tmp) / f"{name}.json" for name in inputs}
        for name, value in inputs.items():
            files[name].write_text(json.dumps(value))
        out, script = Path(tmp) / "out.json", Path(tmp) / "side.py"
        script.write_text(code)
        given = [str(out) if a == "{out}" else str(files[a[1:-1]]) if a[1:-1] in files else a for a in args]
        done = subprocess.run([python, str(script), *given], capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return None
        return json.loads(out.read_text())
