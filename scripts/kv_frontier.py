"""The memory/quality frontier of a KV sweep with other lm runs' attentions on the passkey panels (issue 64).

    python scripts/kv_frontier.py results/lm-smollm2-kv --with results/lm-smollm2-linearized \\
        --out results/lm-smollm2-kv/frontier.png

The sweep's policies at every ratio and its full cache are measured on the same prompts; another run's points
(hollow diamonds) are its passkey rows at the sweep's length. The legend says whether they are the sweep's prompts
(the same depths and keys) or the run's own, with their trial counts: they sit on the same axes, never pooled with
the sweep's cells. The model's own `sdpa` is the sweep's full cache and is left out; a zero-shot setting measured
on the sweep's prompts by several runs is drawn once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.readers.lm.frames import lm_frame
from harness.readers.lm.kv import draw_kv_frontier, kv_rows, other_points, sweep_prompts


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
    prompts = sweep_prompts(df, length)
    points, drawn = [], set()
    for other in args.others:
        for point in other_points(lm_frame(other), length, other.name, prompts):
            once = point["shared"] and " + " not in point["setting"]  # zero-shot: the same cell in every run
            if once and point["setting"] in drawn:
                continue
            drawn |= {point["setting"]} if once else set()
            points.append(point)
    print(draw_kv_frontier(df, args.out, points))


if __name__ == "__main__":
    main()
