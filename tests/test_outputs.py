"""What every command prints and writes on the committed runs stays what it was: the REPORT.md and figures of
every run under results/, the trade-off report, and the text of `bench advise`, `compare`, `list` and each
`--help`, against tests/golden/ (written by the code before issue 51 split its modules).

After a change that means to alter an output: ATTNBENCH_WRITE_GOLDEN=1 python -m pytest tests/test_outputs.py
rewrites tests/golden/, and the diff shows what changed.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import bench, selected
from redraw_worker import overlapping_labels

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


@pytest.fixture(scope="module")
def redrawn(request, tmp_path_factory) -> tuple[Path, dict, dict]:
    """The runs this session checks, copied with their REPORT.md and figures deleted, then drawn again by
    `bench report` in two worker processes side by side (tests/redraw_worker.py; the largest first):
    (the copies' root, each run's deleted files, each run's answer)."""
    wanted = sorted(
        {params["run"] for params in selected(request, "test_every_committed_run_redraws_byte_identical")},
        key=lambda run: -sum(p.stat().st_size for p in _written(ROOT / run) if p.is_file()),
    )
    root = tmp_path_factory.mktemp("redrawn")
    shutil.copytree(ROOT / "results", root / "results")
    drawn = {run: [p for p in _written(root / run) if p.suffix in (".md", ".png", ".svg")] for run in wanted}
    for path in itertools.chain(*drawn.values()):
        path.unlink()
    jobs, answers = queue.SimpleQueue(), {}
    for run in wanted:
        jobs.put(run)

    def worker(log: Path) -> None:
        with open(log, "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "redraw_worker.py")],
                **dict(cwd=root, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=stderr, text=True),
                **dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE),
            )
            while True:
                try:  # (empty() then get() could leave one worker waiting on the other's last run)
                    run = jobs.get_nowait()
                except queue.Empty:
                    break
                proc.stdin.write(f"{run}\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                answers[run] = json.loads(line) if line else {"exit_code": None, "output": log.read_text()[-3000:]}
            proc.stdin.close()
            proc.wait()

    threads = [threading.Thread(target=worker, args=(root / f"worker-{i}.log",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return root, drawn, answers


@pytest.mark.parametrize("run", RUNS, ids=str)
def test_every_committed_run_redraws_byte_identical(redrawn, run):
    """... and no two labels of its figures overlap (issue 69: the main command's had 15 "faster from" labels)."""
    root, drawn, answers = redrawn
    answer = answers[run]
    assert answer["exit_code"] == 0, answer["output"]
    for path in drawn[run]:  # (figures/ may hold more than the report draws: bench viz's, a script's)
        if path.exists() or path.name == "REPORT.md":
            assert path.read_bytes() == (ROOT / path.relative_to(root)).read_bytes(), f"{run}: {path.name}"
    overlaps = answer["overlaps"]
    assert not any(overlaps.values()), {name: found for name, found in overlaps.items() if found}


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


def test_the_overlap_check_sees_two_labels_drawn_over_each_other():
    from harness.readers.plots import matplotlib_rc

    matplotlib_rc()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.annotate("faster from 2k", (0.5, 0.5))
    ax.annotate("faster from 4k", (0.5, 0.5), xytext=(3, 2), textcoords="offset points")
    ax.annotate("apart", (0.05, 0.95))
    fig.canvas.draw()
    assert [(a, b) for _, a, b in overlapping_labels(fig)] == [("faster from 2k", "faster from 4k")]
    plt.close(fig)


def test_a_crowded_panel_is_drawn_as_one_panel_a_kind_each_beside_the_baseline():
    import pandas as pd

    from harness.readers.speed.plots import SMALL_MULTIPLE, _axes_plan

    kinds = ["exact", "recurrent", "recurrent", "kernel", "kernel", "kernel", "recurrent"]
    names = ["full"] + [f"v{i}" for i in range(len(kinds) - 1)]
    facts = {n: {"kind": k, "baseline": n == "full"} for n, k in zip(names, kinds)}
    rows = pd.DataFrame(
        [{"device": "cpu", "pass": "fwd", "causal": True, "variant": n, "status": "ok", "n": 64} for n in names]
    )
    assert len(names) > SMALL_MULTIPLE
    plan = _axes_plan(rows, {"variants": facts})
    assert [(kind, members) for _, kind, members in plan] == [
        ("recurrent", ["full", "v0", "v1", "v5"]),
        ("kernel", ["full", "v2", "v3", "v4"]),
    ]
    assert [members for _, _, members in _axes_plan(rows.head(SMALL_MULTIPLE), {"variants": facts})] == [
        names[:SMALL_MULTIPLE]
    ]
