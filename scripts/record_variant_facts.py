"""Add the variants' facts to run directories made before runs recorded them at their start.

    python scripts/record_variant_facts.py results/cpu-reference results/quality-long

`bench run` and `bench quality` write `metadata.json["variants"]` (each variant's `VariantSpec.facts`:
which variant computes the same function, its reach option, the options that change its function)
when a run starts; readers (`bench report`, `bench advise`, the figures) take equivalences and
windows from there, never from code. For an older run this writes the facts of the variants as they
are registered now, and says so in `metadata.json["variants_recorded_by"]`. A run that has them is left alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import variants
from harness.config import recorded_facts
from harness.storage import read_metadata, write_metadata


def record(run_dir: Path) -> str:
    metadata = read_metadata(run_dir)
    if metadata.get("variants"):
        return f"{run_dir}: has its facts already"
    names = [name for name in metadata["config"].get("variants", []) if name in variants.available()]
    unknown = sorted(set(metadata["config"].get("variants", [])) - set(names))
    metadata["variants"] = recorded_facts(tuple(names))
    metadata["variants_recorded_by"] = "scripts/record_variant_facts.py, after the run: the facts of the variants as registered then"
    write_metadata(run_dir, metadata)
    return f"{run_dir}: recorded {', '.join(names)}" + (f" (not registered, left without facts: {', '.join(unknown)})" if unknown else "")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        print(record(Path(path)))
