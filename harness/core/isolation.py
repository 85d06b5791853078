"""Run one function in a child process of its own, with a timeout, and say how it ended.

Children come from a fork server: a clean process started once, which imports torch and the
variants and then only forks. Forking it is cheap (no re-import per cell) and safe — unlike forking
the caller, whose OpenMP thread pool (after any torch computation) would hang the child, and whose
CUDA context does not survive a fork. Variants registered at run time must live in an importable
module, named in `imports`, since the children import them anew.
The child asks the kernel to pick it first when memory runs out (oom_score_adj) and to kill it if
the parent dies (PR_SET_PDEATHSIG), so a killed `bench run` leaves nothing running behind.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing as mp
import os
import signal
import sys
import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    kind: str  # "result", "exception", "killed", "exited", "timeout"
    value: object = None  # the result dict; or (type name, message, is_oom) for an exception
    signal: int | None = None  # for "killed"

    def describe(self) -> str:
        if self.kind == "killed":
            name = (
                signal.Signals(self.signal).name
                if self.signal in signal.Signals._value2member_map_
                else str(self.signal)
            )
            return f"the cell's process was killed by {name}"
        if self.kind == "exited":
            return f"the cell's process exited with code {self.value} before reporting a result"
        if self.kind == "exception":
            type_name, message, _ = self.value
            return f"{type_name}: {message}"
        return self.kind


OOM_MARKERS = (
    "out of memory",
    "not enough memory",
    "can't allocate memory",
    "cannot allocate memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cufft_internal_error: out of memory",
)


def is_oom(err: BaseException) -> bool:
    """Whether `err` says the device ran out of memory (MemoryError, CUDA's OutOfMemoryError, or a message saying so)."""
    torch = sys.modules.get("torch")  # not imported here: while torch is not loaded, no torch error can be raised
    if isinstance(err, MemoryError) or (torch is not None and isinstance(err, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in OOM_MARKERS)


def _prepare_child() -> None:
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # the kernel's OOM killer takes this child, not the parent
    except OSError:
        pass
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def _child(conn, imports, fn, args, log_path) -> None:
    _prepare_child()
    # the parent may be drawing a progress bar: never write to its terminal, nor through its stream wrappers
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    try:
        import importlib

        for module in imports:
            importlib.import_module(module)
        result = ("result", fn(*args))
    except BaseException as err:  # noqa: BLE001 — everything is reported to the parent
        # the whole traceback goes to the log; the row keeps every line of the message (the reason
        # of an Inductor or xformers failure is on the later lines), folded into one
        what = ", ".join(a.label() for a in args if hasattr(a, "label")) or ", ".join(repr(a)[:80] for a in args[1:])
        print(f"--- {getattr(fn, '__name__', fn)}({what}) failed in process {os.getpid()} ---", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        result = ("exception", (type(err).__name__, error_message(err), is_oom(err)))
    try:
        conn.send(result)
    finally:
        conn.close()


MESSAGE_LIMIT = 2000  # characters of an error message kept in a row


def error_message(err: BaseException) -> str:
    """The exception's message on one line (its lines joined by ' | '), at most MESSAGE_LIMIT characters."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    message = " | ".join(lines) if lines else traceback.format_exception_only(type(err), err)[-1].strip()
    return message if len(message) <= MESSAGE_LIMIT else message[: MESSAGE_LIMIT - 3] + "..."


# what the fork server imports once. The sweep's cell module is named here, as a string, not imported:
# wherever a fork server starts (a Ray node's first task included) its children must find it
# loaded, since a cell's memory limit is set from the process's size once the cell runs (tests/test_ray.py's test_hog
# failed to allocate 8 MiB of its 64 MiB in half the runs when the children imported it themselves)
PRELOAD = ["torch", "variants", "harness.sweep.worker", "harness.core.isolation"]


@functools.lru_cache(maxsize=1)
def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Start the fork server now, without waiting: it imports torch and the variants (PRELOAD) while the
    caller does its own start-up (the first cell then finds it ready). Safe to call more than once."""
    _context()
    from multiprocessing import forkserver

    forkserver.ensure_running()


def fork_server_pid() -> int | None:
    """The fork server's process id once started (its CPU time is this run's, not another process's)."""
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def run_isolated(
    fn, args: tuple, *, timeout: float, imports: tuple[str, ...] = (), log_path: str | None = None
) -> Outcome:
    """fn(*args) in a child process (fn a module-level function; args and result picklable).

    imports: modules the child imports first; log_path: where the child's stdout and stderr go.
    """
    ctx = _context()
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child_conn, imports, fn, args, log_path), daemon=True)
    proc.start()
    child_conn.close()
    try:
        if parent_conn.poll(timeout):
            try:
                kind, value = parent_conn.recv()
            except EOFError:  # died while sending
                kind, value = None, None
            proc.join(timeout=30)
            if kind is not None:
                return Outcome(kind, value)
        else:
            proc.join(timeout=0.1)
            if proc.exitcode is None:
                _kill(proc)
                return Outcome("timeout")
        proc.join(timeout=30)
        code = proc.exitcode
        if code is not None and code >= 0:
            return Outcome("exited", value=code)
        return Outcome("killed", signal=-code if code is not None else signal.SIGKILL)
    finally:
        if proc.is_alive():
            _kill(proc)
        parent_conn.close()


def _kill(proc) -> None:
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.join(timeout=10)
