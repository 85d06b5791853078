"""The run's metadata: command, versions, git commit, CPU and GPU, and the measured matmul peaks."""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from pathlib import Path


def _version(dist: str) -> str | None:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def git_commit() -> dict:
    """HEAD of the checkout the harness runs from, and whether it has uncommitted changes."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def cpu_info() -> dict:
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            mem_total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    return {
        "model": model or platform.processor() or None,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_bytes": mem_total,
    }


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def environment(argv: list[str]) -> dict:
    import torch

    return {
        # as a shell reads it back: an empty or spaced argument quoted (`--long-lengths ''`)
        "command": shlex.join([Path(argv[0]).name, *argv[1:]]) if argv else "",
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {
            "attnbench": _version("attnbench"),
            "torch": torch.__version__,
            "xformers": _version("xformers"),
            "pandas": _version("pandas"),
        },
        "git": git_commit(),
        "cpu": cpu_info(),
    }
