"""Perplexity of one lm run's attentions against another run's `sdpa` on the same windows: the paired ratio and its
95% bootstrap interval, exactly as `bench report` gives it within one run. For a conversion run made without `sdpa`
(it would only repeat the model's rows) after the run that measured the model.

    python scripts/lm_paired.py results/lm-smollm2-linearized-length results/lm-smollm2-linearized-offsets

Refuses runs of different models, scored texts, seeds or window recipes; a window whose start or scored tokens
differ between the runs is left out of the pairing (`paired_ratio_table` checks each).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from harness.lm.config import OWN
from harness.readers.lm.frames import lm_frame, paired_ratio_table
from harness.store.storage import read_metadata

SAME = (  # what makes two runs' windows the same text, scored the same way
    ("machine", "model", "sha256"),
    ("machine", "corpus", "sha256"),
    ("config", "seed"),
    ("config", "windows"),
    ("config", "scored_from"),
    ("config", "scored_tokens"),
)


def refusal(base: dict, run: dict) -> str | None:
    """Why the two runs' windows cannot be paired (the first field that differs), or None."""
    for path in SAME:
        a, b = base, run
        for key in path:
            a, b = (a or {}).get(key), (b or {}).get(key)
        if a != b:
            return f"{'.'.join(path)} differs: {a!r} against {b!r}"
    return None


def main(base_dir: str, run_dir: str) -> None:
    why = refusal(read_metadata(Path(base_dir)), read_metadata(Path(run_dir)))
    if why:
        sys.exit(f"lm_paired: {run_dir} cannot be paired with {base_dir}: {why}")
    base, run = lm_frame(Path(base_dir)), lm_frame(Path(run_dir))
    own = base[(base["task"] == "perplexity") & (base["setting"] == OWN)]
    table = paired_ratio_table(pd.concat([own, run[run["setting"] != OWN]], ignore_index=True))
    print(f"perplexity / {OWN}'s of {base_dir} on the same windows, 95% paired bootstrap interval")
    for r in table.itertuples():
        print(f"{r.setting:60s} {int(r.length):6d}  {r.ratio:8.3f} [{r.low:.3f}–{r.high:.3f}]  {r.windows} windows")


if __name__ == "__main__":
    main(*sys.argv[1:])
