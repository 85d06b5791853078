"""Add the variants' facts to run directories made before runs recorded them at their start.

    python scripts/record_variant_facts.py results/cpu-reference results/quality-long

`bench run` and `bench quality` write `metadata.json["variants"]` (each variant's `VariantSpec.facts`:
which variant computes the same function, its reach option, the options that change its function)
when a run starts; readers (`bench report`, `bench advise`, the figures) take equivalences and
windows from there, never from code. For an older run this writes the facts of the variants as they
are registered now, and says so in `metadata.json["variants_recorded_by"]`; for a run whose facts lack
a field VariantSpec gained since (`style`), it adds that field and says so in `variants_completed_by`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import variants
from harness.policy import recorded_facts
from harness.store.storage import read_metadata, write_metadata


def record(run_dir: Path) -> str:
    metadata = read_metadata(run_dir)
    names = [name for name in metadata["config"].get("variants", []) if name in variants.available()]
    unknown = sorted(set(metadata["config"].get("variants", [])) - set(names))
    now = recorded_facts(tuple(names))
    if not names:
        return f"{run_dir}: names no registered variant (an lm run names attentions, not variants)"
    if not metadata.get("variants"):
        metadata["variants"] = now
        metadata["variants_recorded_by"] = (
            "scripts/record_variant_facts.py, after the run: the facts of the variants as registered then"
        )
        write_metadata(run_dir, metadata)
        return f"{run_dir}: recorded {', '.join(names)}" + (
            f" (not registered, left without facts: {', '.join(unknown)})" if unknown else ""
        )
    # facts VariantSpec gained after the run started (its `style`, ...): added, the recorded ones left as they are
    recorded = metadata["variants"]
    added = sorted({key for name in now for key in now[name] if key not in recorded.get(name, {})})
    if not added:
        return f"{run_dir}: has its facts already"
    for name, facts in now.items():
        recorded.setdefault(name, {}).update(
            {key: value for key, value in facts.items() if key not in recorded.get(name, {})}
        )
    note = (
        f"scripts/record_variant_facts.py, after the run: {', '.join(added)} (facts added to "
        f"VariantSpec later), as registered then"
    )
    earlier = metadata.get("variants_completed_by")
    metadata["variants_completed_by"] = f"{earlier}; then {note}" if earlier else note
    write_metadata(run_dir, metadata)
    return f"{run_dir}: added {', '.join(added)}"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        print(record(Path(path)))
