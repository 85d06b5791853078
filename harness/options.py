"""Command-line values: the one place they are parsed and bounded. Each error names the option, the
value and what is allowed (`ArgumentError`); nothing here imports torch or the variants."""

from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from pathlib import Path

SHAPE_HINTS = (
    "num_heads",
    "head_dim",
    "num_kv_heads",
)  # options every variant takes, set from the run's shape (not stored as its options)


class ArgumentError(ValueError):
    """A command-line value that is not allowed; the message names the option, the value and what is allowed."""


@contextmanager
def as_argument_error():
    """A ValueError raised inside (the variants' refusal of an option, whose message names it) becomes the command
    line's ArgumentError, with the same message."""
    try:
        yield
    except ArgumentError:
        raise
    except ValueError as err:
        raise ArgumentError(str(err)) from None


def read_text_file(path: str, option: str) -> str:
    """The text of the file an option names; ArgumentError when there is no such file or it holds only blanks."""
    file = Path(path)
    if not file.is_file():
        raise ArgumentError(f"{option} {path}: no such file")
    content = file.read_text(errors="replace")
    if not content.strip():
        raise ArgumentError(f"{option} {path}: the file is empty")
    return content


def check_number(
    option: str, value: float, low: float, high: float, unit: str = "", low_inclusive: bool = True
) -> None:
    """ArgumentError unless `value` is a finite number within [low, high] (or (low, high])."""
    ok = (
        isinstance(value, (int, float))
        and math.isfinite(value)
        and value <= high
        and (value >= low if low_inclusive else value > low)
    )
    if not ok:
        lower = f">= {low:g}" if low_inclusive else f"> {low:g}"
        raise ArgumentError(
            f"{option}: {value!r} is not allowed; use a finite number {lower} and <= {high:g}{' ' + unit if unit else ''}"
        )


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str, option: str = "--memory-budget") -> int:
    """'512MiB', '2GiB', '1.5G', '800M', '1048576' -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise ArgumentError(f"{option}: {text!r} is not a size; use e.g. 512MiB, 2GiB, 1.5G or a number of bytes")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


# the longest correctness check: its dense float64 reference holds B x H x N x N scores (2 x 8 x 4096² x 8 bytes = 2 GiB)
MAX_CHECK_LEN = 4096

# the longest sequence any command takes: at N = 2^31 the inputs alone hold 24 GiB even at B = H = D = 1 (float32)
MAX_LENGTH = 2**31


def parse_lengths(text: str) -> tuple[int, ...]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ArgumentError(
            f"--lengths: {text!r} is not a comma-separated list of integers (e.g. 1000,3000,10000)"
        ) from None
    if not values or any(not 1 <= v <= MAX_LENGTH for v in values):
        raise ArgumentError(f"--lengths: {text!r} must list integers from 1 to {MAX_LENGTH} (2^31)")
    return tuple(sorted(set(values)))


def parse_axis(text: str | float | int, option: str, kind: type, low: float, high: float) -> tuple:
    """'64,128' -> (64, 128) for a sweep axis (one value: a run without that axis); ArgumentError naming the option,
    the value and what is allowed: numbers of `kind` in (low, high], comma-separated, each once."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    try:
        values = tuple(dict.fromkeys(kind(float(part)) if kind is float else kind(part) for part in parts))
    except ValueError:
        values = ()
    if not values or any(not (low < v <= high and math.isfinite(v)) for v in values):
        what = "whole numbers" if kind is int else "numbers"
        raise ArgumentError(
            f"{option}: {text!r} is not allowed; give {what} above {low:g} up to {high:g}, comma-separated"
        )
    return values


def powers_of_two(min_len: int, max_len: int) -> tuple[int, ...]:
    if min_len < 1 or max_len < min_len or max_len > MAX_LENGTH:
        raise ArgumentError(
            f"--min-len {min_len} / --max-len {max_len}: need 1 <= min-len <= max-len <= {MAX_LENGTH} (2^31)"
        )
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
    """'window=128' -> ('window', 128), 'linformer.max_len=65536' -> ('linformer.max_len', 65536); values are read as JSON where they can be (ints, floats, true, null).
    NaN and infinities are refused: no option takes them, and they cannot be stored as standard JSON."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip() or not re.fullmatch(r"([A-Za-z_]\w*\.)?[A-Za-z_]\w*", name.strip()):
        raise ArgumentError(
            f"--option: {text!r} must look like name=value (e.g. window=128), or variant.name=value "
            "for one variant only (e.g. linformer.max_len=65536)"
        )
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


def parse_resources(texts: list[str]) -> dict[str, float]:
    """--ray-resources NAME=AMOUNT texts -> {name: amount}; ArgumentError naming the bad one."""
    resources = {}
    for text in texts:
        name, sep, amount = text.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or not (value > 0 and math.isfinite(value)):
            raise ArgumentError(
                f"--ray-resources: {text!r} is not NAME=AMOUNT with a positive amount "
                f"(e.g. accelerator_type:H100=0.001, or a custom resource your nodes declare)"
            )
        resources[name.strip()] = value
    return resources


def merge_options(option: list[str], **named) -> dict:
    """--option name=value texts, plus the options with flags of their own (--window, ...) where given."""
    options = dict(parse_option(text) for text in option)
    options.update({key: value for key, value in named.items() if value is not None})
    return options
