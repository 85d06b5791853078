"""The checks every run's planning shares (`bench run`, `bench quality`, `bench lm`): which variants
`--variants` names, their options, the devices, and how much memory a cell or a training may use."""

from __future__ import annotations

import importlib

import torch

import variants
from harness.core.machine import available_memory_bytes
from harness.options import ArgumentError, parse_list, parse_size


def import_modules(modules: list[str]) -> None:
    """Import the --import modules (they may register variants); ArgumentError naming one that fails."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ArgumentError(f"--import: cannot import {module!r} ({err})") from None


def resolve_variants(text: str, devices: tuple[str, ...], here: bool = True) -> tuple[str, ...]:
    """'all' = every registered variant available on at least one of the devices (here: on this machine;
    else, for a cluster, every variant whose spec lists one of them); else the named ones."""
    registered = variants.available()
    if text.strip() == "all":

        def runs(name: str, device: str) -> bool:
            cls = variants.variant_class(name)
            return cls.unavailable_reason(device) is None if here else device in cls.spec.devices

        return tuple(name for name in registered if any(runs(name, device) for device in devices))
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in registered]
    if unknown or not names:
        raise ArgumentError(
            f"--variants: unknown variant(s) {', '.join(unknown) or repr(text)}; available: all, {', '.join(registered)}"
        )
    return names


def recorded_facts(names: tuple[str, ...]) -> dict[str, dict]:
    """What a run records of its variants at its start (`VariantSpec.facts`: equivalences, reach, the
    options that change the function, labels), so readers take them from the run, not from code."""
    return {name: variants.variant_class(name).spec.facts() for name in names}


def resolve_devices(text: str, cluster: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """'auto' = the CPU, plus CUDA when present; else the named devices, each of which must exist.

    cluster: the device kinds a cluster's nodes have (--executor ray): 'auto' means those, and a kind
    the cluster lacks is accepted (its cells are skipped with the reason), as nodes may join later."""
    if text.strip() == "auto":
        if cluster is not None:
            return tuple(kind for kind in ("cpu", "cuda") if kind in cluster) or ("cpu",)
        return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    devices = parse_list(text, "--devices", ("cpu", "cuda"))
    if "cuda" in devices and cluster is None:
        require_cuda("--devices")
    return devices


def require_cuda(option: str) -> None:
    """ArgumentError naming `option` when CUDA was asked for and torch sees no CUDA device."""
    if not torch.cuda.is_available():
        raise ArgumentError(
            f"{option}: cuda was asked for, but no CUDA device is available (torch.cuda.is_available() is False)"
        )


CPU_BUDGET_FRACTION = 0.6  # of the available RAM, for a CPU cell
GPU_BUDGET_FRACTION = 0.9  # of the free GPU memory, for a CUDA cell


def memory_budgets(text: str, devices: tuple[str, ...], machine: dict) -> tuple[tuple[str, int], ...]:
    """Bytes a cell may use per device: a size for every device, or auto (60% of the available RAM for
    CPU cells, 90% of the free GPU memory, from `machine["gpu"]`, for CUDA cells)."""
    if text.strip() != "auto":
        size = parse_size(text)
        if size <= 0:
            raise ArgumentError(f"--memory-budget: {text!r} must be more than 0 bytes")
        return tuple((device, size) for device in devices)
    nodes = machine.get("nodes")  # a cluster (--executor ray): what its smallest node of each kind has free
    if nodes:
        cpu = min((n["memory_available"] for n in nodes if n.get("cpus") and n.get("memory_available")), default=None)
        gpu = min((n["gpu_free_bytes"] for n in nodes if n.get("gpus") and n.get("gpu_free_bytes")), default=None)
    else:
        cpu, gpu = available_memory_bytes(), (machine.get("gpu") or {}).get("free_bytes")
    budgets = []
    for device in devices:
        free, fraction = (cpu, CPU_BUDGET_FRACTION) if device == "cpu" else (gpu, GPU_BUDGET_FRACTION)
        if free:
            budgets.append((device, int(free * fraction)))
    return tuple(budgets)
