"""What every command prints and writes on the committed runs stays what it was: the REPORT.md and figures of
every run under results/, the trade-off report, and the text of `bench advise`, `compare`, `list` and each
`--help`, against tests/golden/ (written by the code before issue 51 split its modules).

After a change that means to alter an output: ATTNBENCH_WRITE_GOLDEN=1 python -m pytest tests/test_outputs.py
rewrites tests/golden/, and the diff shows what changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import bench

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
RUNS = sorted(
    p.parent.relative_to(ROOT) for p in (ROOT / "results").rglob("metadata.json") if (p.parent / "REPORT.md").exists()
)

# (golden file, the command's arguments): the readers' printed answers on committed runs
PRINTED = [
    ("advise-8192.txt", ["advise", "--len", "8192", "results/cpu-reference", "results/quality-long"]),
    (
        "advise-1024-budget.txt",
        ["advise", "--len", "1024", "--memory", "1GiB", "results/cpu-reference", "results/quality-long"],
    ),
    (
        "advise-json.txt",
        ["advise", "--len", "4096", "--format", "json", "results/cpu-reference", "results/quality-long"],
    ),
    ("compare-executors.txt", ["compare", "results/executor-cpu/local", "results/executor-cpu/local-2"]),
    ("compare-machines.txt", ["compare", "results/cpu-main", "results/cpu-reference"]),
    *[(f"help-{name}.txt", [name, "--help"]) for name in ("list", "run", "plot", "report", "advise", "compare")],
    *[(f"help-{name}.txt", [name, "--help"]) for name in ("viz", "lm", "quality")],
    ("help.txt", ["--help"]),
]


def _written(run: Path) -> list[Path]:
    return (
        [run / "REPORT.md", *sorted((run / "figures").glob("*"))] if (run / "figures").is_dir() else [run / "REPORT.md"]
    )


@pytest.mark.parametrize("run", RUNS, ids=str)
def test_every_committed_run_redraws_byte_identical(tmp_path, monkeypatch, run):
    copy = tmp_path / run
    shutil.copytree(ROOT / run, copy)
    drawn = [p for p in _written(copy) if p.suffix in (".md", ".png", ".svg")]
    for path in drawn:
        path.unlink()
    monkeypatch.chdir(tmp_path)
    result = bench("report", str(run))
    assert result.exit_code == 0, result.output
    for path in drawn:  # (figures/ may hold more than the report draws: bench viz's, a script's)
        if path.exists() or path.name == "REPORT.md":
            assert path.read_bytes() == (ROOT / run / path.relative_to(copy)).read_bytes(), f"{run}: {path.name}"


def test_the_trade_off_report_redraws_byte_identical(tmp_path, monkeypatch):
    for run in ("cpu-reference", "quality-long"):
        shutil.copytree(ROOT / "results" / run, tmp_path / "results" / run)
    monkeypatch.chdir(tmp_path)
    result = bench("report", "results/cpu-reference", "results/quality-long", "--out", "results/tradeoff-cpu")
    assert result.exit_code == 0, result.output
    for name in ("REPORT.md", "figures/tradeoff.png"):
        got = (tmp_path / "results" / "tradeoff-cpu" / name).read_bytes()
        assert got == (ROOT / "results" / "tradeoff-cpu" / name).read_bytes(), name


@pytest.mark.parametrize("golden, args", PRINTED, ids=[name for name, _ in PRINTED])
def test_printed_answers_stay_what_they_were(monkeypatch, golden, args):
    monkeypatch.chdir(ROOT)
    result = bench(*args, columns=80)
    text = f"{result.output}exit {result.exit_code}\n"
    if os.environ.get("ATTNBENCH_WRITE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        (GOLDEN / golden).write_text(text)
    assert text == (GOLDEN / golden).read_text(), f"bench {' '.join(args)} prints otherwise than tests/golden/{golden}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="bench list says where each variant runs: this machine's CUDA")
def test_the_menu_stays_what_it_was():
    # in a process of its own: a test before this one may have registered a variant of its own in this one
    env = {**os.environ, "COLUMNS": "100"}
    result = subprocess.run(
        [sys.executable, "-m", "harness.cli", "list"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    text = f"{result.stdout}exit {result.returncode}\n"
    if os.environ.get("ATTNBENCH_WRITE_GOLDEN"):
        (GOLDEN / "list.txt").write_text(text)
    assert text == (GOLDEN / "list.txt").read_text()


def test_advise_json_prints_bytes_as_integers_and_figures_to_the_digits_they_carry(monkeypatch):
    # a golden of printed floats failed on another CPU (libm's last bits: 11711576443 vs ...446): bytes are whole
    # numbers and a median of a few calls carries 4 significant digits, so no machine's last bits reach the text
    import json

    monkeypatch.chdir(ROOT)
    result = bench("advise", "--len", "4096", "--format", "json", "results/cpu-reference", "results/quality-long")
    assert result.exit_code == 0, result.output
    answers = json.loads(result.output)["answers"]
    extrapolated = [a for a in answers if a["how"].startswith("extrapolated")]
    assert extrapolated, "the committed runs extrapolate some variant to N=4096: the case that differed across CPUs"
    for a in answers:
        assert a["peak_bytes"] is None or isinstance(a["peak_bytes"], int), a
        for key in ("time_s", "accuracy"):
            if isinstance(a[key], float):
                assert len(f"{a[key]:.12g}".lstrip("0.").replace(".", "").rstrip("0")) <= 4, (key, a[key])
