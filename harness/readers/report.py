"""A run's REPORT.md: the command and machine, then the speed part (readers/speed/report.py) and the
quality part (readers/quality/report.py), or an lm run's (readers/lm/report.py). Reads run directories only."""

from __future__ import annotations

from pathlib import Path

from harness.fmt import fmt_bytes
from harness.readers.speed.frames import load_frame
from harness.readers.lm.report import write_lm_report
from harness.readers.quality.plots import plot_quality
from harness.readers.quality.report import quality_section
from harness.readers.speed.plots import plot_run
from harness.readers.speed.report import nodes_section, speed_section
from harness.readers.tables import code_span, md_text
from harness.store.storage import read_metadata, read_rows


def make_report(run_dir: Path) -> tuple[Path, list[Path]]:
    """Draw the run's figures and write REPORT.md (what `bench report` does and `bench run` does at its end).
    Returns (REPORT.md, figures); ValueError when the run has no row yet."""
    if read_metadata(run_dir).get("kind") == "lm":
        return write_lm_report(run_dir)
    figures = plot_run(run_dir) if read_rows(run_dir, quiet=True) else []
    quality_figures = plot_quality(run_dir)
    if not figures and not quality_figures:
        raise ValueError(f"{run_dir} has no results yet")
    return write_report(run_dir, figures, quality_figures), [*figures, *quality_figures]


def write_report(run_dir: Path, figures: list[Path], quality_figures: list[Path] = ()) -> Path:
    """RUN_DIR/REPORT.md: command and environment, then the speed part (figures, tables, exponents,
    crossovers, cells that did not run) and the quality part, for whichever the run holds."""
    run_dir = Path(run_dir)
    meta = read_metadata(run_dir)
    env, cfg, machine = meta.get("environment", {}), meta.get("config", {}), meta.get("machine", {}) or {}
    cpu, git = env.get("cpu", {}), env.get("git", {})
    lines = [
        f"# attnbench report: {run_dir.name}",
        "",
        f"Command: {code_span(env.get('command', '?'))}",
        "",
        f"- Machine: {md_text(cpu.get('model'))}, {cpu.get('usable_cores')} usable cores, {fmt_bytes(cpu.get('memory_bytes'))} RAM"
        + (
            f"; GPU {md_text(machine['gpu'].get('name'))} (driver {md_text(machine['gpu'].get('driver'))})"
            if (machine.get("gpu") or {}).get("name")
            else ""
        ),
        f"- Software: Python {env.get('python')}, torch {env.get('versions', {}).get('torch')}, "
        f"xformers {env.get('versions', {}).get('xformers') or 'not installed'}, attnbench {env.get('versions', {}).get('attnbench')} "
        f"(git {md_text(str(git.get('commit'))[:10])}{' + local changes' if git.get('dirty') else ''})",
        f"- Started {md_text(env.get('started'))}.",
        "",
        "Regenerate this report and its figures with `bench report " + str(run_dir) + "`.",
        "",
    ]
    df = load_frame(run_dir)
    if machine.get("nodes"):
        lines += nodes_section(machine["nodes"], df)
    if not df.empty:
        lines += speed_section(run_dir, df, cfg, machine, figures)
    quality = quality_section(run_dir, cfg, quality_figures)
    lines += quality
    path = run_dir / "REPORT.md"
    path.write_text("\n".join(lines))
    return path
