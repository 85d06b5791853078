"""Ratios of a micro-benchmark run, per table: each variant's median time over `full`'s and over
FlexAttention's (the window's yardstick), and its peak extra memory where --bench-memory recorded it.

    pytest benchmarks/ --benchmark-only --bench-memory --benchmark-json=bench.json
    python benchmarks/ratios.py bench.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

FLEX = "flex_attention (torch)"


def ratios(report: dict) -> dict[str, list[dict]]:
    """{group: [{variant, median_s, vs_full, vs_flex, peak_mib}]} from a --benchmark-json file."""
    groups: dict[str, dict[str, dict]] = defaultdict(dict)
    for bench in report["benchmarks"]:
        info = bench.get("extra_info", {})
        groups[bench["group"]][info["variant"]] = {
            "median_s": bench["stats"]["median"],
            "peak_bytes": info.get("peak_bytes"),
        }
    table = {}
    for group, by_variant in groups.items():
        full = by_variant.get("full", {}).get("median_s")
        flex = by_variant.get(FLEX, {}).get("median_s")
        table[group] = [
            {
                "variant": name,
                "median_s": row["median_s"],
                "vs_full": row["median_s"] / full if full else None,
                "vs_flex": row["median_s"] / flex if flex else None,
                "peak_mib": None if row["peak_bytes"] is None else row["peak_bytes"] / 2**20,
            }
            for name, row in sorted(by_variant.items())
        ]
    return table


def main(path: str) -> None:
    with open(path) as f:
        table = ratios(json.load(f))

    def num(value, fmt):
        width = int(fmt.split(".")[0])
        return f"{'—':>{width}s}" if value is None else format(value, fmt)

    for group in sorted(table, key=lambda g: (g.split()[0], int(g.split()[1].removeprefix("N=")), g)):
        print(f"\n{group}")
        print(f"  {'variant':24s} {'median':>10s} {'/ full':>8s} {'/ flex':>8s} {'peak MiB':>9s}")
        for row in table[group]:
            print(
                f"  {row['variant']:24s} {row['median_s'] * 1e3:8.2f}ms {num(row['vs_full'], '8.3f')} "
                f"{num(row['vs_flex'], '8.3f')} {num(row['peak_mib'], '9.1f')}"
            )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
