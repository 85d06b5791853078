"""What a sweep is: its configuration, its cells, and the parsing of the command line's values."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import torch

import variants

PASSES = ("fwd", "fwdbwd")


@dataclass(frozen=True)
class RunConfig:
    """Everything a sweep needs; stored in metadata.json so `--resume` repeats it exactly."""

    variants: tuple[str, ...]  # registered names, in the order they run
    lengths: tuple[int, ...]  # sequence lengths N, increasing
    devices: tuple[str, ...]  # "cpu", "cuda"
    passes: tuple[str, ...]  # "fwd", "fwdbwd"
    causal: tuple[bool, ...]  # (False,), (True,) or (False, True)
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    options: tuple[tuple[str, object], ...] = ()  # variant options, passed to the variants that take them
    repeats: int = 10  # at most this many timed calls per cell
    warmup: int = 1  # untimed calls before timing
    min_time: float = 1.0  # stop timing after 3 calls once this many seconds were timed
    cell_timeout: float = 300.0  # seconds a cell (warm-up, timing and memory) may take before it is killed
    memory_budget: tuple[tuple[str, int], ...] = ()  # per device: bytes a cell may use (predicted, and enforced on CPU)
    threads: int = 0  # CPU threads (0: all cores)
    check_len: int = 320  # N of the correctness check against the dense reference
    imports: tuple[str, ...] = ()  # modules imported first (they may register extra variants)

    def variant_options(self, name: str) -> dict:
        """The options this variant accepts, plus the shape hints every variant takes."""
        opts = variants.options_taken(name, dict(self.options))
        opts.update(num_heads=self.heads, head_dim=self.head_dim)
        return opts

    def budget(self, device: str) -> int | None:
        return dict(self.memory_budget).get(device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_json(self) -> dict:
        data = asdict(self)
        data["options"] = dict(self.options)
        data["memory_budget"] = dict(self.memory_budget)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "RunConfig":
        data = dict(data)
        data["options"] = tuple(sorted(data.get("options", {}).items()))
        data["memory_budget"] = tuple(sorted(data.get("memory_budget", {}).items()))
        for key in ("variants", "lengths", "devices", "passes", "causal", "imports"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


@dataclass(frozen=True, order=True)
class Cell:
    """One measurement: a variant on a device, one pass, causal or not, at one length."""

    device: str
    variant: str
    pass_: str
    causal: bool
    n: int

    @property
    def series(self) -> tuple:
        return (self.device, self.variant, self.pass_, self.causal)

    @property
    def key(self) -> tuple:
        return (self.device, self.variant, self.pass_, self.causal, self.n)

    def label(self) -> str:
        return f"{self.device} {self.variant} {self.pass_}{' causal' if self.causal else ''} N={self.n}"


def plan(config: RunConfig) -> list[Cell]:
    """Every cell of the sweep, grouped by series and increasing N within a series."""
    return [
        Cell(device, name, pass_, causal, n)
        for device in config.devices
        for name in config.variants
        for causal in config.causal
        for pass_ in config.passes
        for n in config.lengths
    ]


# -- parsing command-line values --------------------------------------------------------------------

class ArgumentError(ValueError):
    """A command-line value that is not allowed; the message names the option, the value and what is allowed."""


def check_number(option: str, value: float, low: float, high: float, unit: str = "", low_inclusive: bool = True) -> None:
    """ArgumentError unless `value` is a finite number within [low, high] (or (low, high])."""
    import math

    ok = isinstance(value, (int, float)) and math.isfinite(value) and value <= high and (value >= low if low_inclusive else value > low)
    if not ok:
        lower = f">= {low:g}" if low_inclusive else f"> {low:g}"
        raise ArgumentError(f"{option}: {value!r} is not allowed; use a finite number {lower} and <= {high:g}{' ' + unit if unit else ''}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str, option: str = "--memory-budget") -> int:
    """'512MiB', '2GiB', '1.5G', '800M', '1048576' -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise ArgumentError(f"{option}: {text!r} is not a size; use e.g. 512MiB, 2GiB, 1.5G or a number of bytes")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def parse_lengths(text: str) -> tuple[int, ...]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ArgumentError(f"--lengths: {text!r} is not a comma-separated list of integers (e.g. 1000,3000,10000)") from None
    if not values or any(v < 1 for v in values):
        raise ArgumentError(f"--lengths: {text!r} must list integers >= 1")
    return tuple(sorted(set(values)))


def powers_of_two(min_len: int, max_len: int) -> tuple[int, ...]:
    if min_len < 1 or max_len < min_len:
        raise ArgumentError(f"--min-len {min_len} / --max-len {max_len}: need 1 <= min-len <= max-len")
    lengths, n = [], 1
    while n <= max_len:
        if n >= min_len:
            lengths.append(n)
        n *= 2
    if min_len not in lengths:
        lengths.insert(0, min_len)
    if max_len not in lengths:
        lengths.append(max_len)
    return tuple(lengths)


def parse_option(text: str) -> tuple[str, object]:
    """'window=128' -> ('window', 128); values are read as JSON where they can be (ints, floats, true, null).
    NaN and infinities are refused: no option takes them, and they cannot be stored as standard JSON."""
    import math

    name, sep, raw = text.partition("=")
    if not sep or not name.strip() or not re.fullmatch(r"[A-Za-z_]\w*", name.strip()):
        raise ArgumentError(f"--option: {text!r} must look like name=value (e.g. window=128)")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    # json reads NaN and Infinity as floats; "inf" and "nan" would pass on as strings
    if (isinstance(value, float) and not math.isfinite(value)) or raw.strip().lower() in ("nan", "inf", "-inf"):
        raise ArgumentError(f"--option: {text!r}: {raw.strip()} is not allowed; option values must be finite")
    return name.strip(), value


def parse_list(text: str, option: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [item for item in items if item not in allowed]
    if bad or not items:
        raise ArgumentError(f"{option}: {text!r} is not allowed; choose from {', '.join(allowed)} (comma-separated)")
    return items


def resolve_variants(text: str, devices: tuple[str, ...]) -> tuple[str, ...]:
    """'all' = every registered variant available on at least one of the devices; else the named ones."""
    registered = variants.available()
    if text.strip() == "all":
        return tuple(
            name for name in registered
            if any(variants.variant_class(name).unavailable_reason(device) is None for device in devices)
        )
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in registered]
    if unknown or not names:
        raise ArgumentError(f"--variants: unknown variant(s) {', '.join(unknown) or repr(text)}; available: all, {', '.join(registered)}")
    return names


def shape_only(name: str, **options) -> variants.AttentionVariant:
    """Variant `name` built on the meta device: parameters have shapes but no storage, nothing is
    computed and no device is touched (so a huge option costs no memory, and CUDA stays uninitialized)."""
    with torch.device("meta"):
        return variants.variant_class(name)(**options)


def check_variant_options(name: str, options: dict, label: str, num_heads: int = 1, head_dim: int = 1) -> None:
    """ArgumentError (prefixed by `label`) unless variant `name` accepts `options` with these shape hints."""
    try:
        shape_only(name, **options, num_heads=num_heads, head_dim=head_dim)
    except (TypeError, ValueError) as err:
        raise ArgumentError(f"{label}: {err}") from None


def check_options(options: dict, names: tuple[str, ...]) -> None:
    """Every option must be taken by at least one of the selected variants, and valid for each that takes it."""
    for key, value in options.items():
        takers = [name for name in names if key in variants.option_names(name)]
        if not takers:
            raise ArgumentError(f"option {key}={value!r} is taken by none of the selected variants ({', '.join(names)})")
        for name in takers:
            check_variant_options(name, {key: value}, f"option {key}={value!r}")

