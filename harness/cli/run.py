"""`bench run`: the sweep of variant x N x device x pass, with a progress bar, then its REPORT.md."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

from harness import options as opts
from harness.options import MAX_CHECK_LEN
from harness.readers.speed.summary import render_summary, summarize
from harness.store import rundir
from harness.store.storage import METADATA, RESULTS, baseline_of, variant_facts

from .common import (
    out_option,
    resume_option,
    RunImportOption,
    compression_option,
    defaults_text,
    CAUSAL,
    CausalMode,
    DType,
    ExecutorName,
    OptionOption,
    at_least,
    checked,
    interruptible,
    make_console,
    progress_bar,
    say,
    within,
    write_report,
)


VariantsOption = Annotated[
    str, typer.Option("--variants", help="'all' (every variant available on the devices) or names, comma-separated.")
]
MinLenOption = Annotated[
    int,
    typer.Option(callback=at_least(1), help="Smallest N; lengths are the powers of two from --min-len to --max-len."),
]
LengthsOption = Annotated[Optional[str], typer.Option(help="Explicit lengths instead, e.g. 1000,3000,10000.")]
DevicesOption = Annotated[str, typer.Option(help="auto (cpu, plus cuda when present), cpu, cuda, or cpu,cuda.")]
PassesOption = Annotated[
    str,
    typer.Option(
        help="fwd (forward only), fwdbwd (forward + backward), decode (one step of one new token after N positions: the state from the variant's prefill, untimed; causal only), comma-separated: fwd,fwdbwd,decode."
    ),
]
CausalOption = Annotated[
    CausalMode,
    typer.Option(
        help="no, yes, both, or auto: no unless a variant is causal-only or --passes has decode, then each variant in one mode, causal where it runs so, full in both."
    ),
]
BatchOption = Annotated[int, typer.Option(callback=at_least(1), help="Batch size B.")]
KvHeadsOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(1),
        help="K/V heads (grouped-query attention, a divisor of --heads; SmolLM2: 9 on 3). Default: --heads.",
    ),
]
HeadDimOption = Annotated[int, typer.Option(callback=at_least(1), help="Head dimension D.")]
WindowOption = Annotated[
    Optional[int],
    typer.Option(help=f"Sliding-window width w (variants that take 'window'; {defaults_text('window')})."),
]
RepeatsOption = Annotated[int, typer.Option(callback=at_least(1), help="At most this many timed calls per cell.")]
WarmupOption = Annotated[
    int, typer.Option(callback=at_least(0), help="Untimed calls before timing (at least; see --warmup-time).")
]
WarmupTimeOption = Annotated[
    float,
    typer.Option(
        help="Untimed calls go on until they lasted this many seconds: a fresh process runs its first calls slower."
    ),
]
MinTimeOption = Annotated[
    float, typer.Option(help="Stop timing a cell after --min-repeats calls once this many seconds were timed.")
]
MinRepeatsOption = Annotated[
    int,
    typer.Option(
        callback=at_least(1),
        help="At least this many timed calls a cell (more until --min-time seconds, at most --repeats). 1 times a call that alone lasts --min-time once (pyperf's calibration).",
    ),
]
CellTimeoutOption = Annotated[
    float,
    typer.Option(
        help="Seconds a cell may take before it is killed; a cell predicted to need over half of it is skipped (never full's). The correctness check gets max(this, 300 s). docs/measuring.md."
    ),
]
MemoryBudgetOption = Annotated[
    str, typer.Option(help="Memory a cell may use: auto (60% of free RAM, 90% of free GPU memory) or a size like 8GiB.")
]
ThreadsOption = Annotated[
    int, typer.Option(callback=at_least(0), help="CPU threads per cell (0: every core this process may use).")
]
PeakTimeOption = Annotated[
    float,
    typer.Option(
        help="Seconds spent measuring the machine's matmul peak (the 100% of the efficiency figure) before the sweep."
    ),
]
CheckLenOption = Annotated[
    int,
    typer.Option(
        callback=within(1, MAX_CHECK_LEN),
        help=f"N of the correctness check against the dense reference (raised per variant where its sparse paths need more, never past the run's longest N). At most {MAX_CHECK_LEN}.",
    ),
]
OutOption = out_option("")
ResumeOption = resume_option("run")
RetryFailedOption = Annotated[
    bool,
    typer.Option(
        "--retry-failed",
        help="With --resume: measure again the cells that ended in oom, timeout or error (and what their series skipped); their old rows move to superseded.jsonl.",
    ),
]
ReportOption = Annotated[
    Optional[bool],
    typer.Option(
        "--report/--no-report",
        help="At the end, write RUN_DIR/REPORT.md and its figures (what bench report RUN_DIR does). Default: yes; with --resume, as the run began.",
    ),
]
ExecutorOption = Annotated[
    ExecutorName,
    typer.Option(
        help="Where cells run: local (this machine, one at a time) or ray (each cell a Ray task on a node of a cluster, series in parallel; needs the ray extra)."
    ),
]
RayAddressOption = Annotated[
    Optional[str],
    typer.Option(
        help="With --executor ray: auto (the cluster this machine is part of), host:port or ray://host:port. Without it, a local Ray instance is started."
    ),
]
RayResourcesOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--ray-resources",
        help="With --executor ray: a Ray resource every cell needs, NAME=AMOUNT (e.g. accelerator_type:H100=0.001); repeatable. Nodes without it are not used.",
    ),
]


def run(
    variants_: VariantsOption = "all",
    min_len: MinLenOption = 256,
    max_len: Annotated[int, typer.Option(callback=at_least(1), help="Largest N.")] = 4096,
    lengths: LengthsOption = None,
    devices: DevicesOption = "auto",
    passes: PassesOption = "fwd,fwdbwd",
    causal: CausalOption = CausalMode.auto,
    batch: BatchOption = 1,
    heads: Annotated[int, typer.Option(callback=at_least(1), help="Heads H.")] = 8,
    kv_heads: KvHeadsOption = None,
    head_dim: HeadDimOption = 64,
    dtype: Annotated[DType, typer.Option(help="Data type of q, k, v.")] = DType.float32,
    window: WindowOption = None,
    compression: compression_option(defaults_text("compression")) = None,
    option: OptionOption = None,
    repeats: RepeatsOption = 10,
    warmup: WarmupOption = 1,
    warmup_time: WarmupTimeOption = 0.25,
    min_time: MinTimeOption = 1.0,
    min_repeats: MinRepeatsOption = 1,
    cell_timeout: CellTimeoutOption = 60.0,
    memory_budget: MemoryBudgetOption = "auto",
    threads: ThreadsOption = 0,
    peak_time: PeakTimeOption = 1.0,
    check_len: CheckLenOption = 320,
    out: OutOption = None,
    resume: ResumeOption = None,
    import_: RunImportOption = None,
    retry_failed: RetryFailedOption = False,
    report: ReportOption = None,
    executor: ExecutorOption = ExecutorName.local,
    ray_address: RayAddressOption = None,
    ray_resources: RayResourcesOption = None,
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

    console = make_console()
    with checked():
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
        session = open_sweep(request, say(console), console.status)
    report = rundir.report_asked(session.run_dir, report, resume is not None)  # (recorded before a Ctrl-C can come)
    with session, interruptible(console, session.kept, session.resume_command):
        rows = _sweep_with_progress(session, console)
    if report and any(row["status"] == "ok" for row in rows):
        write_report(session.run_dir, console)
    if rows and not any(row["status"] == "ok" for row in rows):
        console.print("[red]no cell ran successfully[/]; see the messages in results.jsonl and worker.log")
        raise typer.Exit(1)


def _sweep_with_progress(session, console: Console) -> list[dict]:
    progress = progress_bar(console)
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
    render_summary(summarize(rows, baseline_of(variant_facts(session.run_dir))), console)
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    console.print(
        f"results: {session.run_dir / RESULTS}  (this session: {statuses or 'nothing left to run'})", soft_wrap=True
    )
    console.print(f"metadata: {session.run_dir / METADATA}", soft_wrap=True)
    return rows
