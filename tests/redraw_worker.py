"""A worker process of tests/test_outputs.py: `bench report` each run directory named on a line of stdin (paths
relative to the working directory, a copy of results/), and answer each with one JSON line on stdout: the
exit code, what the command printed, and for every figure it saved the labels drawn over each other.

Two of these redraw the committed runs side by side (each drawing is one core's work)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure
from typer.testing import CliRunner

from harness.cli import app


def overlapping_labels(fig) -> list[tuple[str, str, str]]:
    """(panel, label, label) for every two texts (annotations, the legend's box) drawn over each other."""
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts if t.get_visible() and t.get_text()]
        if ax.get_legend() is not None:
            boxes.append(("the legend", ax.get_legend().get_window_extent(renderer)))
        found += [
            (ax.get_title(), a, b)
            for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
            if box_a.overlaps(box_b)
        ]
    return found


def main() -> None:
    overlaps: dict[str, list] = {}
    save = Figure.savefig

    def checked(fig, path, *args, **kwargs):  # every figure a report draws, as it was saved
        saved = save(fig, path, *args, **kwargs)
        overlaps[Path(path).name] = overlapping_labels(fig)
        return saved

    Figure.savefig = checked
    for line in sys.stdin:
        overlaps.clear()
        result = CliRunner().invoke(app, ["report", line.strip()], env={"COLUMNS": "200"})
        answer = {"exit_code": result.exit_code, "output": result.output, "overlaps": overlaps}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
