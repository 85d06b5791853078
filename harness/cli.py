"""The `bench` command line.

    bench list                                   # variants, what they support, where they run
    bench run --variants all --max-len 16384     # the sweep: time, memory, FLOP/s per cell
    bench run --resume results/<run>             # finish an interrupted run
"""

from __future__ import annotations

import importlib
import socket
import sys
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

import variants
from harness.config import PASSES, ArgumentError, RunConfig, check_number, check_options, check_variant_options, parse_lengths, parse_list, parse_option, parse_size, powers_of_two, resolve_variants

app = typer.Typer(
    help="attnbench: which attention should I use at my sequence length, on my hardware? Measure it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class CausalMode(str, Enum):
    no = "no"
    yes = "yes"
    both = "both"


class DType(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float64 = "float64"


def _console() -> Console:
    return Console(stderr=False, highlight=False)


def _import_modules(modules: list[str]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ArgumentError(f"--import: cannot import {module!r} ({err})") from None


@app.command("list")
def list_variants(
    import_: Annotated[Optional[list[str]], typer.Option("--import", help="Module to import first (it may register more variants).")] = None,
) -> None:
    """List the registered attention variants: what each computes, what it supports, where it runs.

    Availability is checked per device; an unavailable variant shows why (for example, xformers is
    CUDA-only, or not installed).
    """
    try:
        _import_modules(import_ or [])
    except ArgumentError as err:
        raise typer.BadParameter(str(err)) from None
    from rich.table import Table

    console = _console()
    table = Table(title="attnbench variants", title_justify="left")
    for col in ("variant", "time", "extra memory", "causal", "cross", "padding", "cpu", "cuda"):
        table.add_column(col)
    unavailable = []
    for name in variants.available():
        cls = variants.variant_class(name)
        spec = cls.spec

        def where(device: str) -> str:
            reason = cls.unavailable_reason(device)
            if reason:
                unavailable.append(f"{name} on {device}: {reason}")
                return "[red]no[/]"
            return "[green]fwd only[/]" if cls.backward_unsupported_reason(device) else "[green]yes[/]"

        flags = ["yes" if f else "no" for f in (spec.supports_causal, spec.supports_cross_attention, spec.supports_key_padding_mask)]
        table.add_row(name, spec.time_complexity, spec.memory_complexity, *flags, where("cpu"), where("cuda"))
    console.print(table)
    console.print("\n[bold]Methods[/]")
    for name in variants.available():
        spec = variants.variant_class(name).spec
        console.print(f"  [bold]{name}[/]: {spec.summary}. [dim]{spec.reference}[/]" + (f" Note: {spec.notes}." if spec.notes else ""))
    if unavailable:
        console.print("\n[bold]Unavailable here[/]")
        for line in unavailable:
            console.print(f"  {line}")


def _default_out_dir(prefix: str = "") -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{prefix}{stamp}-{socket.gethostname()}"


def _progress(console: Console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console)


def _devices(text: str) -> tuple[str, ...]:
    import torch

    if text.strip() == "auto":
        return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    devices = parse_list(text, "--devices", ("cpu", "cuda"))
    if "cuda" in devices and not torch.cuda.is_available():
        raise ArgumentError("--devices: cuda was asked for, but no CUDA device is available (torch.cuda.is_available() is False)")
    return devices


def _budgets(text: str, devices: tuple[str, ...], machine: dict) -> tuple[tuple[str, int], ...]:
    """auto: 60% of the available RAM for CPU cells, 90% of the free GPU memory for CUDA cells."""
    from harness.machine import available_memory_bytes

    if text.strip() != "auto":
        size = parse_size(text)
        if size <= 0:
            raise ArgumentError(f"--memory-budget: {text!r} must be more than 0 bytes")
        return tuple((device, size) for device in devices)
    budgets = []
    for device in devices:
        if device == "cpu":
            avail = available_memory_bytes()
            if avail:
                budgets.append(("cpu", int(avail * 0.6)))
        else:
            free = (machine.get("gpu") or {}).get("free_bytes")
            if free:
                budgets.append(("cuda", int(free * 0.9)))
    return tuple(budgets)


def build_config(
    variants_: str, min_len: int, max_len: int, lengths: str | None, devices: str, passes: str, causal: CausalMode,
    batch: int, heads: int, head_dim: int, dtype: DType, window: int | None, compression: int | None, option: list[str],
    repeats: int, warmup: int, min_time: float, cell_timeout: float, threads: int, check_len: int, imports: list[str],
) -> RunConfig:
    for name, value, low in (("--batch", batch, 1), ("--heads", heads, 1), ("--head-dim", head_dim, 1), ("--repeats", repeats, 1),
                             ("--warmup", warmup, 0), ("--threads", threads, 0), ("--check-len", check_len, 1)):
        if value < low:
            raise ArgumentError(f"{name}: {value} is not allowed; it must be >= {low}")
    check_number("--min-time", min_time, 0, 3600, "seconds")
    check_number("--cell-timeout", cell_timeout, 1e-3, 86400, "seconds", low_inclusive=False)
    device_list = _devices(devices)
    names = resolve_variants(variants_, device_list)
    if not names:
        raise ArgumentError(f"--variants {variants_}: no registered variant runs on {', '.join(device_list)}")
    options = dict(parse_option(text) for text in option)
    if window is not None:
        options["window"] = window
    if compression is not None:
        options["compression"] = compression
    check_options(options, names)
    return RunConfig(
        variants=names,
        lengths=parse_lengths(lengths) if lengths else powers_of_two(min_len, max_len),
        devices=device_list,
        passes=parse_list(passes, "--passes", PASSES),
        causal={"no": (False,), "yes": (True,), "both": (False, True)}[causal.value],
        batch=batch, heads=heads, head_dim=head_dim, dtype=dtype.value, options=tuple(sorted(options.items())),
        repeats=repeats, warmup=warmup, min_time=min_time, cell_timeout=cell_timeout, threads=threads,
        check_len=check_len, imports=tuple(imports),
    )


@app.command()
def run(
    variants_: Annotated[str, typer.Option("--variants", help="'all' (every variant available on the devices) or names, comma-separated.")] = "all",
    min_len: Annotated[int, typer.Option(help="Smallest N; lengths are the powers of two from --min-len to --max-len.")] = 256,
    max_len: Annotated[int, typer.Option(help="Largest N.")] = 4096,
    lengths: Annotated[Optional[str], typer.Option(help="Explicit lengths instead, e.g. 1000,3000,10000.")] = None,
    devices: Annotated[str, typer.Option(help="auto (cpu, plus cuda when present), cpu, cuda, or cpu,cuda.")] = "auto",
    passes: Annotated[str, typer.Option(help="fwd (forward only), fwdbwd (forward + backward), or both: fwd,fwdbwd.")] = "fwd,fwdbwd",
    causal: Annotated[CausalMode, typer.Option(help="Causal masking: no, yes, or both.")] = CausalMode.no,
    batch: Annotated[int, typer.Option(help="Batch size B.")] = 1,
    heads: Annotated[int, typer.Option(help="Heads H.")] = 8,
    head_dim: Annotated[int, typer.Option(help="Head dimension D.")] = 64,
    dtype: Annotated[DType, typer.Option(help="Data type of q, k, v.")] = DType.float32,
    window: Annotated[Optional[int], typer.Option(help="Sliding-window width w (variants that take 'window'; default 256).")] = None,
    compression: Annotated[Optional[int], typer.Option(help="Memory-compressed stride c (default 3).")] = None,
    option: Annotated[Optional[list[str]], typer.Option(help="Any variant option as name=value, e.g. global_tokens=16; repeatable.")] = None,
    repeats: Annotated[int, typer.Option(help="At most this many timed calls per cell.")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed calls before timing.")] = 1,
    min_time: Annotated[float, typer.Option(help="Stop timing a cell after 3 calls once this many seconds were timed.")] = 1.0,
    cell_timeout: Annotated[float, typer.Option(help="Seconds a cell may take (check, warm-up, timing, memory) before it is killed.")] = 300.0,
    memory_budget: Annotated[str, typer.Option(help="Memory a cell may use: auto (60% of free RAM, 90% of free GPU memory) or a size like 8GiB.")] = "auto",
    threads: Annotated[int, typer.Option(help="CPU threads per cell (0: torch's default, all cores).")] = 0,
    check_len: Annotated[int, typer.Option(help="N of the correctness gate against the dense reference (raised per variant where its sparse paths need a longer N, never past the longest N of the run).")] = 320,
    out: Annotated[Optional[Path], typer.Option(help="Run directory to create (default results/<timestamp>-<host>); never overwritten.")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Finish this run: only its missing cells, with its original options.")] = None,
    import_: Annotated[Optional[list[str]], typer.Option("--import", help="Module to import first (it may register more variants). With --resume, a run's modules must be named again: resuming runs their code.")] = None,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="With --resume: measure again the cells that ended in oom, timeout or error (and what their series skipped); their old rows move to superseded.jsonl.")] = False,
) -> None:
    """Sweep variants x sequence length x device x pass: time, peak memory and FLOP/s of every cell.

    Every cell runs in a process of its own, after the variant was checked against its dense
    definition on that device; each finished cell is written to RUN_DIR/results.jsonl at once, so
    an out-of-memory kill, a crash, a timeout or Ctrl-C loses nothing that finished
    (continue with --resume RUN_DIR). Example:

        bench run --variants full,sliding_window,linear --max-len 16384 --passes fwd
    """
    console = _console()
    from harness import runner
    from harness.machine import environment
    from harness.storage import RunDirBusy, RunLock, create_run_dir, read_metadata

    try:
        if resume is not None:
            metadata = read_metadata(resume)
            if metadata["kind"] != "sweep":
                raise ArgumentError(f"--resume: {resume} is a {metadata['kind']} run; resume it with bench {metadata['kind']} --resume")
            config = RunConfig.from_json(metadata["config"])
            _require_imports(config.imports, import_ or [], resume)
            _import_modules(list(config.imports))
            run_dir = resume
            device_names = (metadata.get("machine") or {}).get("device_names")
            _check_same_devices(device_names, runner.current_device_names(config.devices), resume)
        else:
            _import_modules(import_ or [])
            config = build_config(
                variants_, min_len, max_len, lengths, devices, passes, causal, batch, heads, head_dim, dtype, window,
                compression, option or [], repeats, warmup, min_time, cell_timeout, threads, check_len, import_ or [],
            )
            run_dir = out or _default_out_dir()
            if run_dir.exists():
                raise ArgumentError(f"--out: {run_dir} already exists; a run never overwrites one (use --resume {run_dir} to finish it)")
    except (ArgumentError, FileNotFoundError, ValueError) as err:
        raise typer.BadParameter(str(err)) from None
    if retry_failed and resume is None:
        raise typer.BadParameter("--retry-failed goes with --resume RUN_DIR")
    _warn_if_busy(console)

    if resume is None:  # nothing is written until every value is known: an interrupted start-up leaves no directory
        with console.status("measuring the machine's matmul peak"):
            machine = runner.measure_machine(config)
        try:
            budgets = _budgets(memory_budget, config.devices, machine)
        except ArgumentError as err:
            raise typer.BadParameter(str(err)) from None
        config = RunConfig.from_json({**config.to_json(), "memory_budget": dict(budgets)})
        device_names = machine["device_names"]
        create_run_dir(run_dir, {"kind": "sweep", "config": config.to_json(), "environment": environment(sys.argv),
                                 "machine": machine, "argv": sys.argv})
    else:
        console.print(f"resuming {run_dir} with its original options (other options given now are ignored)")
    try:
        with RunLock(run_dir):
            if retry_failed:
                moved = runner.retry_failed(run_dir, config, device_names)
                console.print(f"--retry-failed: {moved} rows of failed cells set aside in {run_dir / 'superseded.jsonl'}; measuring them again")
            _sweep_with_progress(config, run_dir, console, device_names)
    except RunDirBusy as err:
        raise typer.BadParameter(str(err)) from None


def _require_imports(stored: tuple[str, ...], given: list[str], run_dir: Path) -> None:
    """Resuming imports the run's modules in this process and every cell: only those named again here."""
    missing = [module for module in stored if module not in given]
    if missing:
        raise ArgumentError(f"--resume: {run_dir} was run with --import {' --import '.join(stored)}; resuming would run that "
                            f"code, so name it again to allow it: --import {' --import '.join(missing)}")


def _check_same_devices(stored: dict | None, current: dict, run_dir: Path) -> None:
    for device, name in (stored or {}).items():
        if name and current.get(device) and current[device] != name:
            raise ArgumentError(f"--resume: {run_dir} was measured on {device} '{name}', this machine's {device} is "
                                f"'{current[device]}'; start a new run here (bench compare can put the two side by side)")


def _warn_if_busy(console: Console) -> None:
    from harness.noise import machine_busy

    busy = machine_busy()
    if busy:
        console.print(f"[yellow]warning[/]: {busy}; the benchmark result may be unstable (cells measured now are flagged)")


def _sweep_with_progress(config: RunConfig, run_dir: Path, console: Console, device_names: dict | None) -> None:
    from harness import runner
    from harness.summary import render_summary, summarize

    todo = runner.todo_cells(config, run_dir, device_names)
    progress = _progress(console)
    counts: dict[str, int] = {}

    def on_row(cell, row):
        if row is None:
            progress.update(task, description=f"[cyan]{cell.label()}[/]")
            return
        counts[row["status"]] = counts.get(row["status"], 0) + 1
        progress.advance(task)

    try:
        with progress:
            task = progress.add_task("starting", total=len(todo))
            rows = runner.sweep(config, run_dir, on_row=on_row, device_names=device_names)
    except KeyboardInterrupt:
        kept = len(runner.run_rows(run_dir, config, device_names, quiet=True))
        console.print(f"\n[yellow]interrupted[/]: {kept} finished cells are kept in {run_dir / 'results.jsonl'}")
        again = "".join(f" --import {m}" for m in config.imports)
        console.print(f"resume with: [bold]bench run --resume {run_dir}{again}[/]")
        raise typer.Exit(130) from None
    render_summary(summarize(rows), console)
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    console.print(f"results: {run_dir / 'results.jsonl'}  (this session: {statuses or 'nothing left to run'})")
    console.print(f"metadata: {run_dir / 'metadata.json'}")
    if rows and not any(row["status"] == "ok" for row in rows):
        console.print("[red]no cell ran successfully[/]; see the messages in results.jsonl and worker.log")
        raise typer.Exit(1)


class Format(str, Enum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


def _run_dir(path: Path) -> Path:
    from harness.storage import read_metadata

    try:
        read_metadata(path)
    except (FileNotFoundError, ValueError) as err:
        raise typer.BadParameter(str(err)) from None
    return path


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by bench run.")],
    format: Annotated[Format, typer.Option("--format", help="Image format.")] = Format.png,
    out: Annotated[Optional[Path], typer.Option(help="Where to write the figures (default RUN_DIR/figures).")] = None,
) -> None:
    """Draw the run's figures: time and memory vs N (log-log, fitted exponents), speed-up over full, fraction of the matmul peak.

    Reads the run directory only (works on partial runs); the same run gives byte-identical files.
    """
    from harness.plots import plot_run

    try:
        paths = plot_run(_run_dir(run_dir), out, format.value)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    for path in paths:
        _console().print(f"wrote {path}")


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by bench run.")],
) -> None:
    """Write RUN_DIR/REPORT.md: command and environment, figures, per-panel tables, exponents, crossovers, cells that did not run."""
    from harness.plots import plot_quality, plot_run
    from harness.report import write_report
    from harness.storage import read_rows

    run_dir = _run_dir(run_dir)
    figures = plot_run(run_dir) if read_rows(run_dir) else []
    quality_figures = plot_quality(run_dir)
    if not figures and not quality_figures:
        raise typer.BadParameter(f"{run_dir} has no results yet")
    path = write_report(run_dir, figures, quality_figures)
    _console().print(f"wrote {path} and {len(figures) + len(quality_figures)} figures in {run_dir / 'figures'}")


def _percent(text: str) -> float:
    import math

    raw = text.strip().removesuffix("%")
    try:
        value = float(raw) / 100
    except ValueError:
        raise typer.BadParameter(f"--fail-if-slower: {text!r} is not a percentage (e.g. 10%)") from None
    if not math.isfinite(value) or value <= 0:
        raise typer.BadParameter(f"--fail-if-slower: {text!r} must be a finite percentage above 0% (e.g. 10%)")
    return value


@app.command()
def compare(
    run_a: Annotated[Path, typer.Argument(help="The reference run (A).")],
    run_b: Annotated[Path, typer.Argument(help="The run to compare with it (B).")],
    fail_if_slower: Annotated[Optional[str], typer.Option(help="A percentage, e.g. 10% (or 10): exit 1 when a variant's geometric-mean time ratio B/A exceeds 1 + 10%, or when any cell ok in A is not ok in B.")] = None,
) -> None:
    """Match the cells of two runs and print time and memory ratios B/A, with a geometric mean per variant.

    For catching regressions between commits or machines: `bench compare results/old results/new --fail-if-slower 10%`.
    """
    from rich.table import Table

    from harness.report import KEY as KEY_COLUMNS
    from harness.report import compare_runs
    from harness.runner import fmt_time
    from harness.summary import NOISE_NOTE

    threshold = _percent(fail_if_slower) if fail_if_slower is not None else None
    cells, per_variant, broken = compare_runs(_run_dir(run_a), _run_dir(run_b))
    console = _console()
    if not broken.empty:  # a cell that ran in A and not in B is a regression, whatever its speed
        console.print(f"[red]{len(broken)} cells ok in A are not ok in B[/]:")
        for r in broken.sort_values(KEY_COLUMNS).to_dict("records"):
            console.print(f"  {r['device']} {r['variant']} {r['pass']}{' causal' if r['causal'] else ''} N={r['n']}: "
                          f"{r['status']} — {str(r['message'])[:200]}")
    if cells.empty:
        console.print("[yellow]no matching ok cells[/] (same device, variant, pass, causal, N, B, H, D and dtype)")
        raise typer.Exit(1 if threshold is not None else 0)
    noisy = int((cells["noisy_a"] | cells["noisy_b"]).sum())
    table = Table(title=f"B/A per cell  (A = {run_a}, B = {run_b})", title_justify="left")
    for col in ("device", "variant", "pass", "causal", "N", "time A", "time B", "time B/A", "mem B/A"):
        table.add_column(col, justify="right" if col not in ("device", "variant", "pass") else "left")
    for r in cells.sort_values(["device", "variant", "pass", "causal", "n"]).to_dict("records"):
        table.add_row(r["device"], r["variant"], r["pass"], "yes" if r["causal"] else "no", str(r["n"]),
                      fmt_time(r["time_median_s_a"]), fmt_time(r["time_median_s_b"]),
                      f"{r['time_ratio']:.3f}" + (" ~" if r["noisy_a"] or r["noisy_b"] else ""),
                      "—" if r["mem_ratio"] != r["mem_ratio"] else f"{r['mem_ratio']:.3f}")
    console.print(table)
    if noisy:
        console.print(f"[yellow]~ {noisy} cells were noisy in A or B[/]: {NOISE_NOTE}")
    summary = Table(title="geometric mean per variant", title_justify="left")
    for col in ("device", "variant", "pass", "causal", "cells", "time B/A", "mem B/A", "verdict"):
        summary.add_column(col)
    failed = []
    for r in per_variant.to_dict("records"):
        slower = threshold is not None and r["time_geomean"] > 1 + threshold
        if slower:
            failed.append(f"{r['variant']} ({r['device']}, {r['pass']}{', causal' if r['causal'] else ''})")
        verdict = "[red]slower[/]" if slower else ("ok" if threshold is not None else "")
        summary.add_row(r["device"], r["variant"], r["pass"], "yes" if r["causal"] else "no", str(r["cells"]),
                        f"{r['time_geomean']:.3f}", "—" if r["mem_geomean"] != r["mem_geomean"] else f"{r['mem_geomean']:.3f}", verdict)
    console.print(summary)
    if failed:
        console.print(f"[red]slower by more than {threshold:.0%}[/]: {', '.join(failed)}")
    if threshold is not None and (failed or not broken.empty):
        raise typer.Exit(1)


@app.command()
def viz(
    variants_: Annotated[str, typer.Option("--variants", help="'all' or names, comma-separated.")] = "all",
    n: Annotated[int, typer.Option("--n", help="Sequence length of the picture.")] = 64,
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="Draw the causal pattern.")] = False,
    window: Annotated[int, typer.Option(help="Sliding window w for the picture (small, so the band shows).")] = 6,
    global_tokens: Annotated[int, typer.Option(help="Global tokens for the sliding-window variants.")] = 2,
    compression: Annotated[int, typer.Option(help="Memory-compressed stride c.")] = 4,
    out: Annotated[Path, typer.Option(help="Image to write (.png, .svg or .pdf).")] = Path("attention_patterns.png"),
    import_: Annotated[Optional[list[str]], typer.Option("--import", help="Module to import first (it may register more variants).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
) -> None:
    """Heat-maps, side by side, of the attention weights each variant applies to one random input.

    Softmax variants show their weights, linear its normalized kernel matrix, memory_compressed the
    weight each query gives each original position. The weights are read off the variant itself
    (called with v = identity), so the picture is also a visual check of causality and of the window.
    """
    from harness.viz import attention_patterns, draw_patterns

    try:
        _import_modules(import_ or [])
        names = tuple(variants.available()) if variants_.strip() == "all" else resolve_variants(variants_, ("cpu",))
    except ArgumentError as err:
        raise typer.BadParameter(str(err)) from None
    if n < 1 or n > 2048:
        raise typer.BadParameter(f"--n: {n} is not allowed; use 1 <= n <= 2048 (the picture holds an N x N matrix)")
    if out.suffix.lstrip(".") not in ("png", "svg", "pdf"):
        raise typer.BadParameter(f"--out: {out} must end in .png, .svg or .pdf")
    if out.exists() and not force:
        raise typer.BadParameter(f"--out: {out} already exists; pass --force to overwrite it")
    result = attention_patterns(list(names), n, causal, {"window": window, "global_tokens": global_tokens, "compression": compression})
    path = draw_patterns(result, out, n, causal)
    console = _console()
    for name, reason in result["skipped"].items():
        console.print(f"skipped {name}: {reason}")
    console.print(f"wrote {path}")


class Task(str, Enum):
    copy = "copy"
    recall = "recall"
    all = "all"


@app.command()
def quality(
    task: Annotated[Task, typer.Option(help="copy, recall, or all.")] = Task.all,
    variants_: Annotated[str, typer.Option("--variants", help="'all' (one variant per attention function that trains on the CPU: full_naive, the same function as full, is left out) or names, comma-separated.")] = "all",
    lengths: Annotated[str, typer.Option(help="Task lengths L: the copied string's length / the recall sequence's length.")] = "32,64",
    steps: Annotated[int, typer.Option(help="Training steps, the same for every variant.")] = 1500,
    d_model: Annotated[int, typer.Option(help="Model width.")] = 64,
    layers: Annotated[int, typer.Option(help="Transformer blocks.")] = 2,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    batch: Annotated[int, typer.Option(help="Training batch size.")] = 32,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW, linear warm-up then cosine decay).")] = 3e-3,
    label_smoothing: Annotated[float, typer.Option(help="Label smoothing of the training loss.")] = 0.0,
    window: Annotated[int, typer.Option(help="Sliding-window width w (narrower than the copy distance on purpose: that is what local attention gives up).")] = 16,
    compression: Annotated[int, typer.Option(help="Memory-compressed stride c.")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the model, the training data and the held-out set.")] = 0,
    out: Annotated[Optional[Path], typer.Option(help="Run directory to create (default results/quality-<timestamp>-<host>).")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Finish this quality run with its original options.")] = None,
) -> None:
    """Train the same small decoder with each attention variant on copy and associative recall; report held-out accuracy.

    Only the attention differs between variants: same model size, steps, learning rate and data.
    Rows are appended to RUN_DIR/quality.jsonl as they exist; `bench report RUN_DIR` draws the figures.
    The defaults took 10 min 44 s on a 2-core CPU (results/quality-reference).
    """
    from dataclasses import asdict

    from harness.machine import environment
    from harness.quality import TrainConfig, trainable_variants
    from harness.storage import RunDirBusy, RunLock, create_run_dir, read_metadata

    console = _console()
    if resume is not None:
        try:
            metadata = read_metadata(resume)
            if metadata["kind"] != "quality":
                raise ArgumentError(f"--resume: {resume} is a {metadata['kind']} run; resume it with bench run --resume")
        except (ArgumentError, FileNotFoundError, ValueError) as err:
            raise typer.BadParameter(str(err)) from None
        cfg_json = metadata["config"]
        run_dir = resume
        console.print(f"resuming {run_dir} with its original options (other options given now are ignored)")
    else:
        try:  # every value, and every variant with its options, is checked before anything is written
            tasks = ["copy", "recall"] if task == Task.all else [task.value]
            names = trainable_variants("cpu") if variants_.strip() == "all" else list(resolve_variants(variants_, ("cpu",)))
            length_list = list(parse_lengths(lengths))
            for name, value, low in (("--steps", steps, 1), ("--d-model", d_model, 1), ("--layers", layers, 1), ("--heads", heads, 1),
                                     ("--batch", batch, 1), ("--seed", seed, 0)):
                if value < low:
                    raise ArgumentError(f"{name}: {value} is not allowed; it must be >= {low}")
            check_number("--lr", lr, 0, 10, low_inclusive=False)
            check_number("--label-smoothing", label_smoothing, 0, 0.999)
            if d_model % heads:
                raise ArgumentError(f"--d-model {d_model} must be divisible by --heads {heads}")
            options = {"window": window, "compression": compression}
            for name in names:
                cls = variants.variant_class(name)
                reason = cls.backward_unsupported_reason("cpu") or cls.unavailable_reason("cpu")
                if reason:
                    raise ArgumentError(f"--variants: {name} cannot be trained here: {reason}")
                check_variant_options(name, variants.options_taken(name, options), name, heads, d_model // heads)
            from harness.tasks import make_task

            for t in tasks:
                for n in length_list:
                    make_task(t, n)
        except (ArgumentError, ValueError) as err:
            raise typer.BadParameter(str(err)) from None
        train = TrainConfig(d_model=d_model, layers=layers, heads=heads, steps=steps, batch=batch, lr=lr, label_smoothing=label_smoothing, seed=seed)
        cfg_json = {**asdict(train), "tasks": tasks, "variants": names, "lengths": length_list, "options": options}
        run_dir = out or _default_out_dir("quality-")
        if run_dir.exists():
            raise typer.BadParameter(f"--out: {run_dir} already exists; a run never overwrites one (use --resume {run_dir})")
        create_run_dir(run_dir, {"kind": "quality", "config": cfg_json, "environment": environment(sys.argv), "argv": sys.argv})
    try:
        with RunLock(run_dir):
            _quality_with_progress(run_dir, cfg_json, console)
    except RunDirBusy as err:
        raise typer.BadParameter(str(err)) from None


def _quality_with_progress(run_dir: Path, cfg_json: dict, console: Console) -> None:
    from harness.quality import TrainConfig, TrainingDiverged, keep_finished_runs, sweep_quality

    train = TrainConfig(**{k: cfg_json[k] for k in TrainConfig.__dataclass_fields__})
    total = len(cfg_json["tasks"]) * len(cfg_json["variants"]) * len(cfg_json["lengths"]) * train.steps
    progress = _progress(console)
    last_step = {"step": 0}

    def on_start(task_name, length, name):
        last_step["step"] = 0
        progress.update(bar, description=f"[cyan]{task_name} L={length} {name}[/]")

    def on_eval(row):
        progress.advance(bar, row["step"] - last_step["step"])
        last_step["step"] = row["step"]
        progress.update(bar, description=f"[cyan]{row['task']} L={row['length']} {row['variant']}[/] "
                                         f"loss {row['train_loss']:.3f} acc {row['eval_accuracy']:.1%}")

    finished = keep_finished_runs(run_dir)
    try:
        with progress:
            bar = progress.add_task("starting", total=total, completed=len(finished) * train.steps)
            rows = sweep_quality(run_dir, cfg_json["tasks"], cfg_json["variants"], cfg_json["lengths"], cfg_json["options"],
                                 train, on_eval=on_eval, on_start=on_start, finished=finished)
    except KeyboardInterrupt:
        console.print(f"\n[yellow]interrupted[/]: finished trainings are kept in {run_dir / 'quality.jsonl'}")
        console.print(f"resume with: [bold]bench quality --resume {run_dir}[/]")
        raise typer.Exit(130) from None
    except TrainingDiverged as err:
        console.print(f"[red]training diverged[/]: {err}")
        raise typer.Exit(1) from None
    from rich.table import Table

    from harness.report import final_accuracy_grid

    columns, grid = final_accuracy_grid(rows)
    table = Table(title="held-out token accuracy after training", title_justify="left")
    table.add_column("variant")
    for t, n in columns:
        table.add_column(f"{t} L={n}", justify="right")
    for name, cells in grid:
        table.add_row(name, *["" if r is None else f"{r['eval_accuracy']:.1%}" for r in cells])
    console.print(table)
    console.print(f"results: {run_dir / 'quality.jsonl'}; figures and REPORT.md: bench report {run_dir}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
