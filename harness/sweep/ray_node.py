"""What runs on a Ray node: its record (host, CPU, GPUs, torch and CUDA versions), and a cell run there as the
local executor runs it, in a fresh child of the node's fork server, its log's tail sent back."""

from __future__ import annotations

import os
import socket
import sys
import tempfile

from harness.core.isolation import run_isolated
from harness.core.machine import available_memory_bytes, cpu_info

RAY_EXTRA = "pip install -e '.[ray]'"
LOG_TAIL = 20_000  # characters of a cell's log sent back to the driver's worker.log


def ray_module():
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--executor ray needs the ray package, which is not installed: {RAY_EXTRA}") from None
    return ray


# -- what runs on a node ----------------------------------------------------------------------------------


def node_record() -> dict:
    """Where this process runs: host, Ray node, CPU model and cores, GPUs, torch and CUDA versions.
    (Read without importing torch here: the node's Ray workers stay light; the cells' children import it.)"""
    from importlib.metadata import version

    ray = ray_module()
    context = ray.get_runtime_context()
    gpus = context.get_accelerator_ids().get("GPU", [])
    gpu = {}
    if gpus:  # read in a child (the GPU Ray gave this probe is visible there)
        env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
        outcome = run_isolated(_with_environment, (env, [], "harness.sweep.worker", "cuda_info"), timeout=120)
        gpu = outcome.value if outcome.kind == "result" else {}
    cpu = cpu_info()
    return {
        "node_id": context.get_node_id(),
        "host": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),
        "cpu_model": cpu["model"],
        "cpu_cores": cpu["cores"],
        "memory_available": available_memory_bytes(),
        "gpu_name": gpu.get("name"),
        "gpu_free_bytes": gpu.get("free_bytes"),
        "gpus": len(gpus),
        "torch": version("torch"),
        "cuda": gpu.get("cuda"),
        "python": sys.version.split()[0],
    }


def _add_paths(paths: list) -> None:
    for path in reversed(paths):
        if path not in sys.path and os.path.isdir(path):
            sys.path.insert(0, path)


def _with_environment(env: dict, paths: list, module: str, name: str, *args):
    """In the cell's child: the GPU Ray gave this task (the fork server was started with another task's
    environment) and the driver's import paths, then the cell's function, found by name."""
    import importlib

    os.environ.update(env)
    _add_paths(paths)
    return getattr(importlib.import_module(module), name)(*args)


def run_on_node(function: tuple, args: tuple, timeout: float, imports: tuple, paths: list, record: dict) -> tuple:
    """The Ray task: the cell (`function` = (module, name), e.g. harness.sweep.worker.measure_cell) in an isolated
    child of this node's fork server. Returns (outcome, node, log). Named, not pickled: this Ray worker
    never imports torch; only the children do."""
    _add_paths(paths)  # before the fork server starts, so its children import what the driver can
    env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    with tempfile.NamedTemporaryFile("r", suffix=".log", prefix="attnbench-cell-") as log:
        outcome = run_isolated(
            _with_environment, (env, paths, *function, *args), timeout=timeout, imports=imports, log_path=log.name
        )
        text = log.read()[-LOG_TAIL:]
    return outcome, record, text
