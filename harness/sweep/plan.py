"""Planning a sweep: its configuration from checked command-line values, and its cells."""

from __future__ import annotations

import variants as registry
from harness.options import ArgumentError, as_argument_error, check_number, parse_list
from harness.policy import resolve_devices, resolve_variants
from harness.sweep.config import PASSES, Cell, RunConfig


def names_of(device_names: dict | None, device: str) -> list:
    """The hardware names a run measures `device` on: a list (a cluster's), one name, or [None] (unknown)."""
    names = (device_names or {}).get(device)
    if isinstance(names, (list, tuple)):
        return list(names) or [None]
    return [names]


def plan(config: RunConfig, device_names: dict | None = None) -> list[Cell]:
    """Every cell of the sweep, grouped by series and increasing N within a series; each device kind
    once per hardware name in `device_names` ({kind: name or [names]})."""
    return [
        Cell(device, name, pass_, causal, n, device_name)
        for device in config.devices
        for device_name in names_of(device_names, device)
        for name in config.variants
        for causal, pass_ in series(config, name)
        for n in config.lengths
    ]


def series(config: RunConfig, name: str) -> list[tuple[bool, str]]:
    """(causal, pass) of each series variant `name` is measured in: its modes times the passes, decoding causal
    only; a variant measured bidirectionally only still gets its causal decode series, so that a method that
    cannot decode (linformer, nystrom) is recorded as skipped with its reason, not left out without a word."""
    modes = config.modes_of(name)
    out = [(causal, pass_) for causal in modes for pass_ in config.passes if causal or pass_ != "decode"]
    if "decode" in config.passes and True not in modes:
        out.append((True, "decode"))
    return out


def causal_modes(names: tuple[str, ...], passes: tuple[str, ...]) -> dict[str, tuple[bool, ...]]:
    """What --causal auto means for these variants and passes, per variant (False: bidirectional).

    A sweep of methods that all run bidirectionally, with no decode pass, stays bidirectional, as an encoder
    comparison was before. Once one method is causal only (the gated recurrences, MoBA) or a pass decodes
    (decoding is causal), the sweep compares decoders: every method that runs causally is measured causal
    only, and a bidirectional-only method (Linformer, Nyström) bidirectionally, with the baseline `full` in
    that mode too, so each method has its baseline beside it and nothing is measured twice (`--causal both`
    measures every method in both modes: twice the cells)."""
    specs = {name: registry.variant_class(name).spec for name in names}
    if all(spec.supports_non_causal for spec in specs.values()) and "decode" not in passes:
        return {name: (False,) for name in names}
    modes = {name: (True,) if spec.supports_causal else (False,) for name, spec in specs.items()}
    base = registry.baseline()
    if base in modes and any(mode == (False,) for mode in modes.values()):
        modes[base] = (False, True)
    return modes


def build_run_config(
    *,
    variants: str,
    lengths: tuple[int, ...],
    devices: str,
    passes: str,
    causal: tuple[bool, ...] | None,
    options: dict,
    imports: list[str],
    min_time: float,
    cell_timeout: float,
    warmup_time: float = 0.25,
    cluster: tuple[str, ...] | None = None,
    **settings,
) -> RunConfig:
    """A sweep's configuration from checked command-line values (`settings`: batch, heads, head_dim,
    dtype, repeats, warmup, threads, check_len); every variant's options are checked and fixed. causal None:
    --causal auto (`causal_modes`).
    cluster: the device kinds of a cluster's nodes, when the cells run there (--executor ray)."""
    check_number("--min-time", min_time, 0, 3600, "seconds")
    check_number("--warmup-time", warmup_time, 0, 3600, "seconds")
    check_number("--cell-timeout", cell_timeout, 1e-3, 86400, "seconds", low_inclusive=False)
    if settings.get("min_repeats", 1) > settings.get("repeats", 10):
        raise ArgumentError(
            f"--min-repeats {settings['min_repeats']}: at most --repeats ({settings['repeats']}), "
            "the most timed calls a cell makes"
        )
    heads, kv_heads = settings.get("heads", 8), settings.get("kv_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ArgumentError(
            f"--kv-heads {kv_heads}: must divide --heads {heads} (grouped-query attention: each K/V head "
            f"serves H / Hkv query heads)"
        )
    device_list = resolve_devices(devices, cluster)
    names = resolve_variants(variants, device_list, here=cluster is None)
    if not names:
        raise ArgumentError(f"--variants {variants}: no registered variant runs on {', '.join(device_list)}")
    with as_argument_error():
        registry.check_options(options, names, heads, settings.get("head_dim", RunConfig.head_dim))
    pass_list = parse_list(passes, "--passes", PASSES)
    per_variant: dict[str, tuple[bool, ...]] = {}
    if causal is None:
        per_variant = causal_modes(names, pass_list)
        causal = tuple(mode for mode in (False, True) if any(mode in modes for modes in per_variant.values()))
    if "decode" in pass_list and True not in causal:
        raise ArgumentError(
            "--passes decode: decoding is causal (one new position against the ones before it); "
            "use --causal yes or both"
        )
    config = RunConfig(
        variants=names,
        lengths=lengths,
        devices=device_list,
        passes=pass_list,
        causal=causal,
        modes=_differing(per_variant, causal),
        options=tuple(sorted(options.items())),
        min_time=min_time,
        cell_timeout=cell_timeout,
        warmup_time=warmup_time,
        imports=tuple(imports),
        **settings,
    )
    return config.with_resolved_options()


def _differing(
    per_variant: dict[str, tuple[bool, ...]], causal: tuple[bool, ...]
) -> tuple[tuple[str, tuple[bool, ...]], ...]:
    """The per-variant modes that differ from the run's `causal` (what RunConfig.modes stores)."""
    return tuple((name, modes) for name, modes in per_variant.items() if modes != causal)
