"""The harness's wings import only downward: no cycle, no import beside or above, readers free of torch
and of the variants, project imports at the top of files (scripts/imports.py reads the code)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wings_import_only_downward():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "imports.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 cycles, 0 imports against the wings' order" in out.stdout, out.stdout


def test_the_run_packages_stand_at_most_a_few_floors_tall():
    """A package's chain of imports inside itself: lm/ is four floors (config → model → linearize → run);
    sweep/ and quality/ five. A sixth floor is a corridor to shorten, not a budget to raise."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import imports
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    heights = imports.floors(imports.problems()[0])
    assert heights["harness.lm"] <= 4, heights
    assert max(h for package, h in heights.items() if package.startswith("harness")) <= 5, heights


def test_the_check_fails_on_an_upward_import_a_cycle_and_a_local_import(tmp_path):
    """The check itself can fail: a copy of the tree with one import of each forbidden kind."""
    import shutil

    for package in ("variants", "harness", "scripts"):  # (the copy has no tests/ but the one written below)
        shutil.copytree(ROOT / package, tmp_path / package)
    storage = tmp_path / "harness" / "store" / "storage.py"
    storage.write_text(
        storage.read_text()
        + "\nfrom harness.readers.speed.summary import summarize  # upward\nfrom harness.store.rows import Row  # rows imports storage\n"
    )
    rows = tmp_path / "harness" / "store" / "rows.py"
    rows.write_text(
        rows.read_text() + "\n\ndef _late():\n    from harness.store import storage  # local, and loads no torch\n"
    )
    advise = tmp_path / "harness" / "readers" / "advise" / "answer.py"
    advise.write_text(advise.read_text() + "\nimport variants  # a reader importing the variants\n")
    runner = tmp_path / "harness" / "sweep" / "runner.py"  # a module passing on a name it imports, and a caller
    runner.write_text(runner.read_text() + '\n__all__ = ["RunConfig"]\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "from harness.sweep.runner import RunConfig\nfrom harness.sweep import runner as r\n\nr.RunConfig\n"
    )
    out = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "imports.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stdout
    assert "harness.store.storage imports harness.readers.speed.summary, a wing above its own" in out.stdout
    cycle = [line for line in out.stdout.splitlines() if line.startswith("import cycle:")]
    assert cycle and "harness.store.rows" in cycle[0] and "harness.store.storage" in cycle[0], out.stdout
    assert "harness.store.rows imports harness.store.storage inside a function" in out.stdout
    assert "the reader harness.readers.advise.answer imports variants" in out.stdout
    assert "harness/sweep/runner.py: __all__ passes on RunConfig, defined in harness.sweep.config" in out.stdout
    assert "tests/test_x.py:1: imports RunConfig from harness.sweep.runner, which imports it from" in out.stdout
    assert "tests/test_x.py:4: reaches RunConfig through harness.sweep.runner, which imports it from" in out.stdout


def test_window_reaches_the_kernel_without_a_json_round_trip_across_at_most_8_files():
    """scripts/corridor.py follows `bench run --window 77` to sliding_window's constructor: no configuration is
    rebuilt from its own JSON form inside the process (the child process reading the stored run is another),
    and the value crosses at most 8 files (issue 69; 9 before the option checks moved into the registry)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "corridor.py")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "from_json inside the command's process: none" in out.stdout, out.stdout
    assert "variants/methods/sliding_window.py" in out.stdout and "harness/sweep/worker.py" in out.stdout
    crossed = int(out.stdout.split("--window crosses ")[1].split()[0])
    assert crossed <= 8, out.stdout
