"""Numbers as people read them: sizes in KiB/MiB/GiB, durations in ms/s, fractions in %. No torch, no pandas."""

from __future__ import annotations


def fmt_bytes(n: float | None) -> str:
    if n is None or n != n:
        return "?"
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def fmt_time(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "?"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def significant(x: float, digits: int = 4) -> float:
    """x rounded to `digits` significant digits: a measured figure printed with the digits it carries, so the same
    measurement prints the same on every CPU (a libm's last bits never reach the text)."""
    return float(f"{x:.{digits}g}")


def fmt_percent(fraction: float) -> str:
    """90%, 85.5%: a fraction as a percentage, one decimal where it has one."""
    return f"{fraction:.1%}".replace(".0%", "%")
