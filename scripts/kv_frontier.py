"""The memory/quality frontier of a KV sweep with other lm runs' attentions on the passkey panels (issue 64).

    python scripts/kv_frontier.py results/lm-smollm2-kv --with results/lm-smollm2-linearized \\
        --out results/lm-smollm2-kv/frontier.png

The sweep's policies at every ratio and its full cache are measured on the same prompts; another run's points
(hollow diamonds) come from that run's own passkey prompts at the sweep's length, and the legend says so with
their trial counts: they sit on the same axes, never pooled with the sweep's cells.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.readers.lm.frames import lm_frame
from harness.readers.lm.kv import draw_kv_frontier, kv_rows, other_points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="an lm run with a KV sweep (bench lm --kv-policy)")
    parser.add_argument("--with", dest="others", type=Path, action="append", default=[], help="another lm run")
    parser.add_argument("--out", type=Path, required=True, help="the figure to write (.png)")
    args = parser.parse_args()
    df = lm_frame(args.run)
    if kv_rows(df).empty:
        raise SystemExit(f"{args.run}: no KV sweep rows (bench lm --kv-policy)")
    length = int(kv_rows(df)["length"].max())
    points = [p for other in args.others for p in other_points(lm_frame(other), length, other.name)]
    print(draw_kv_frontier(df, args.out, points))


if __name__ == "__main__":
    main()
