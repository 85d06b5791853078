"""What a run records of its machines when it starts: the devices by name, the matmul peak and memory
bandwidth of each (every node's, on a cluster)."""

from __future__ import annotations

from harness.core.isolation import run_isolated
from harness.core.machine import cpu_info
from harness.store.rows import device_label
from harness.sweep import worker
from harness.core.measure import matmul_peak, memory_bandwidth
from harness.sweep.config import RunConfig


def current_device_names(devices: tuple[str, ...], gpu: dict | None = None) -> dict:
    """What each device of the run is on this machine: the CPU model, the GPU's name (from `gpu`, the
    `worker.cuda_info` record, when the caller has it; else read in a child)."""
    names = {}
    for device in devices:
        if device == "cpu":
            names["cpu"] = cpu_info()["model"]
        elif device == "cuda":
            if gpu is None:
                outcome = run_isolated(worker.cuda_info, (), timeout=120)
                gpu = outcome.value if outcome.kind == "result" else {}
            names["cuda"] = gpu.get("name")
    return names


def measure_machine(config: RunConfig, peak_seconds: float = 1.0) -> dict:
    """Matmul peaks per device (run's dtype, and float32; each timed for `peak_seconds`) and GPU details,
    each measured in a child."""
    info: dict = {
        "matmul_peak_gflops": {},
        "matmul_peak_precision": {},
        "matmul_peak_seconds": peak_seconds,
        "gpu": None,
    }
    for device in config.devices:
        if device == "cuda":
            outcome = run_isolated(worker.cuda_info, (), timeout=120)
            info["gpu"] = outcome.value if outcome.kind == "result" else {"error": outcome.describe()}
        for dtype in dict.fromkeys((config.dtype, "float32")):
            outcome = run_isolated(matmul_peak, (device, dtype, config.threads, peak_seconds), timeout=120)
            value = outcome.value if outcome.kind == "result" else {}
            info["matmul_peak_gflops"][f"{device}/{dtype}"] = value.get("gflops")
            info["matmul_peak_precision"][f"{device}/{dtype}"] = value.get("precision")
        if "decode" in config.passes:  # a decoding step's limit: the bandwidth of reading its state
            outcome = run_isolated(memory_bandwidth, (device, config.threads, peak_seconds), timeout=120)
            info.setdefault("memory_bandwidth_gbs", {})[device] = (
                outcome.value.get("gbs") if outcome.kind == "result" else None
            )
    info["device_names"] = current_device_names(config.devices, info["gpu"] or {})
    return info


def measure_cluster(config: RunConfig, cluster, peak_seconds: float = 1.0) -> dict:
    """What `measure_machine` records, for a cluster: every node's record, and the matmul peak of each
    hardware (run's dtype and float32), measured on one of its nodes as a cell is."""
    info: dict = {
        "executor": cluster.name,
        "nodes": cluster.node_records(),
        "matmul_peak_gflops": {},
        "matmul_peak_precision": {},
        "matmul_peak_seconds": peak_seconds,
        "gpu": None,
        "device_names": cluster.device_names(config.devices),
    }
    for device, names in info["device_names"].items():
        for index, name in enumerate(names):
            for dtype in dict.fromkeys((config.dtype, "float32")):
                job = cluster.submit(
                    matmul_peak,
                    (device, dtype, config.threads, peak_seconds),
                    device=device,
                    device_name=name,
                    timeout=120,
                )
                outcome, _ = cluster.outcome(job)
                value = outcome.value if outcome.kind == "result" else {}
                for label in [device_label(device, name)] + ([device] if index == 0 else []):
                    info["matmul_peak_gflops"][f"{label}/{dtype}"] = value.get("gflops")
                    info["matmul_peak_precision"][f"{label}/{dtype}"] = value.get("precision")
    return info
