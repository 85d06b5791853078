"""What every command shares: option types and checks, the console, progress bars, and how a run's
faults read (a usage error, or what was kept and how to resume)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import textwrap
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from harness.options import ArgumentError
from harness.readers.report import make_report
from harness.store.storage import RunDirBusy, read_metadata


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


def make_console() -> Console:
    return Console(stderr=False, highlight=False)


def at_least(low: int):
    """Typer callback: the value must be >= low (the message names the option, the value and the bound)."""

    def check(value: int) -> int:
        if value is not None and value < low:
            raise typer.BadParameter(f"{value} is not allowed; it must be >= {low}")
        return value

    return check


def within(low: int, high: int):
    def check(value: int) -> int:
        if value is not None and not low <= value <= high:
            raise typer.BadParameter(f"{value} is not allowed; use {low} <= value <= {high}")
        return value

    return check


@contextmanager
def checked():
    """Turn a value the harness refuses (ArgumentError, a missing or corrupt run directory) into typer's
    usage error: exit 2, the message naming the option, the value and what is allowed."""
    try:
        yield
    except (ArgumentError, FileNotFoundError, ValueError) as err:
        raise typer.BadParameter(str(err)) from None


def say(console: Console):
    """How a session speaks: one console line each, paths left whole to copy."""
    return lambda text: console.print(text, soft_wrap=True)


@contextmanager
def interruptible(console: Console, kept: Callable[[], str], resume: str):
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


@functools.cache
def option_defaults(option: str) -> dict[str, object]:
    """{method file: default} of `option` in the __init__ signatures of variants/methods/, read from the source so
    that a help text never restates a number and `--help` never loads torch (once a process: typer reads the
    help texts again at every command it builds)."""
    found = {}
    for path in sorted((Path(importlib.util.find_spec("variants").origin).parent / "methods").glob("*.py")):
        text = path.read_text()
        if f"{option}:" not in text:  # (parsing every method file took 0.2 s)
            continue
        tree = ast.parse(text)
        constants = {  # the file's NAME = literal, which a default may name
            target.id: node.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults):
                    if arg.arg == option and default is not None:
                        found[path.stem] = ast.literal_eval(constants.get(getattr(default, "id", None), default))
    return found


def usual_default(option: str) -> object:
    """The methods' most common default of `option`."""
    values = list(option_defaults(option).values())
    return max(values, key=values.count)


def defaults_text(option: str) -> str:
    """The methods' most common default of `option`, then the others': "default 256; window_linear 64"."""
    usual = usual_default(option)
    others = [f"{stem} {value}" for stem, value in option_defaults(option).items() if value != usual]
    return f"default {usual}" + "".join(f"; {other}" for other in others)


def compression_option(default: str) -> object:
    """--compression, shared by bench run and bench quality; `default`: what an unset option means there."""
    return Annotated[Optional[int], typer.Option(help=f"Memory-compressed stride c ({default}).")]


def out_option(prefix: str) -> object:
    """--out, shared by the commands that make a run; `prefix`: their directories' (results/<prefix>...)."""
    return Annotated[
        Optional[Path],
        typer.Option(help=f"Run directory to create (default results/{prefix}<timestamp>-<host>); never overwritten."),
    ]


def resume_option(run: str) -> object:
    """--resume, shared by the commands that make a run; `run`: what they call theirs ("run", "lm run")."""
    return Annotated[
        Optional[Path], typer.Option(help=f"Finish this {run}: only what is missing, with its original options.")
    ]


RunImportOption = Annotated[  # (--import of the commands that make a run, which --resume repeats)
    Optional[list[str]],
    typer.Option(
        "--import",
        help="Module to import first (it may register more variants). With --resume, a run's modules must be named again: resuming runs their code.",
    ),
]


ReportOption = Annotated[
    Optional[bool],
    typer.Option(
        "--report/--no-report",
        help="At the end, write RUN_DIR/REPORT.md and its figures. Default: yes; with --resume, as the run began.",
    ),
]


def progress_bar(console: Console):
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


def existing_run(path: Path) -> Path:
    with checked():
        read_metadata(path)
    return path


class Task(str, Enum):
    copy = "copy"
    recall = "recall"
    mqar = "mqar"
    all = "all"


class OneTask(str, Enum):
    copy = "copy"
    recall = "recall"
    mqar = "mqar"


class Pass(str, Enum):
    fwd = "fwd"
    fwdbwd = "fwdbwd"
    decode = "decode"


def print_wrapped(console: Console, head: str, text: str) -> None:
    """`head` + `text` wrapped to the console's width, later lines indented under the text."""
    indent = " " * min(len(head), 12)
    for line in textwrap.wrap(text, width=max(40, console.width), initial_indent=head, subsequent_indent=indent) or [
        head
    ]:
        console.print(escape(line), soft_wrap=True)


def write_report(run_dir: Path, console: Console) -> None:
    with console.status("drawing the figures and writing REPORT.md"):
        path, figures = make_report(run_dir)
    console.print(f"report: {path}", soft_wrap=True)  # paths stay whole, to copy
    for figure in figures:
        console.print(f"  figure: {figure}", soft_wrap=True)
