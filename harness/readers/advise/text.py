"""`bench advise`'s answer shown: a table, a glance, JSON, and the one-sentence recommendation."""

from __future__ import annotations

import math
from dataclasses import asdict

import pandas as pd

from harness.fmt import fmt_bytes, fmt_percent, fmt_time, significant
from harness.readers.advise.cost import Answer


def recommendation(answers: list[Answer], context: dict) -> str:
    """One sentence: the pick and why, or why there is none."""
    ranked = sorted((a for a in answers if a.rank), key=lambda a: a.rank)
    need = []
    if context.get("memory") is not None:
        need.append(f"fits in {fmt_bytes(context['memory'])}")
    if context.get("min_accuracy") is not None:
        need.append(f"keeps >= {fmt_percent(context['min_accuracy'])} on {context['task']}")
    what = "fastest" + (" that " + " and ".join(need) if need else "")
    if not ranked:
        return (
            f"No variant {' and '.join(need) if need else 'has a time'} at N={context['n']}: "
            f"see the reasons in the table."
        )
    best = ranked[0]
    extra = f", {best.how}" if best.how != "measured" else ""
    acc = f", accuracy {best.accuracy:.1%} at L={best.quality_length}" if best.accuracy is not None else ""
    return f"Use {best.label or best.variant}: the {what} at N={context['n']} ({fmt_time(best.time_s)} per call{extra}{acc})."


def advise_table(answers: list[Answer]) -> pd.DataFrame:
    """The answers as rows of text, ranked ones first (for the CLI and the report)."""
    out = []
    for a in sorted(answers, key=lambda a: (a.rank is None, a.rank or 0, a.label or a.variant)):
        acc = ""
        if a.accuracy is not None:
            acc = f"{a.accuracy:.1%}"
            low, high = (f"{x:.0%}" for x in a.accuracy_range or (a.accuracy, a.accuracy))
            if low != high:  # the seeds' range, where it shows at this precision
                acc += f" ({low}-{high})"
            acc += f" at L={a.quality_length}"
        out.append(
            {
                "rank": str(a.rank) if a.rank else "-",
                "variant": a.label or a.variant,
                "time": fmt_time(a.time_s) if a.time_s is not None and math.isfinite(a.time_s) else "",
                "memory": fmt_bytes(a.peak_bytes) if a.peak_bytes is not None and math.isfinite(a.peak_bytes) else "",
                "how": a.how,
                "accuracy": acc,
                "notes": "; ".join([*([a.excluded] if a.excluded and a.excluded != a.how else []), *a.quality_note]),
            }
        )
    return pd.DataFrame(out)


def glance(answers: list[Answer], context: dict) -> tuple[str, pd.DataFrame, list[str], list[str]]:
    """The answers for an 80-column terminal: (title, a table of short columns — rank, variant, time,
    memory, accuracy, note —, the numbered notes the note column points to, and the notes every variant
    shares, said once). How a figure was obtained (interpolated, extrapolated: time marked ~), why a
    variant is not ranked and what its accuracy means go into the notes; the trained length goes into the
    title when every accuracy shares it."""
    kind = "causal" if context["causal"] else "non-causal"
    lengths = sorted({a.quality_length for a in answers if a.accuracy is not None})
    one_length = context["quality_runs"] and len(lengths) <= 1
    title = f"N={context['n']}, {context['device']}, {context['pass']}, {kind}"
    if context["quality_runs"]:
        title += f", accuracy on {context['task']}" + (f" at L={lengths[0]}" if len(lengths) == 1 else "")
    ordered = sorted(answers, key=lambda a: (a.rank is None, a.rank or 0, a.label or a.variant))

    def timing(a: Answer) -> tuple[bool, bool]:  # (has a time, that time is interpolated or extrapolated)
        timed = a.time_s is not None and math.isfinite(a.time_s)
        return timed, timed and not a.how.startswith("measured")

    def said_of(a: Answer) -> list[str]:
        timed, estimated = timing(a)
        return [
            *([a.excluded] if a.excluded and a.excluded != a.how else []),
            *([a.how] if estimated or not timed else []),
            *a.quality_note,
        ]

    said = {id(a): said_of(a) for a in ordered}
    scored = [a for a in ordered if a.accuracy is not None]  # what every variant with an accuracy shares is said once
    common = set.intersection(*(set(said[id(a)]) for a in scored)) if len(scored) > 1 else set()
    shared = [part for part in said[id(scored[0])] if part in common] if common else []
    rows, notes = [], []
    for a in ordered:
        timed, estimated = timing(a)
        acc = ""
        if a.accuracy is not None:
            acc = f"{a.accuracy:.1%}"
            low, high = (f"{x * 100:.0f}" for x in a.accuracy_range or (a.accuracy, a.accuracy))
            if low != high:
                acc += f" ({low}-{high})"
            if not one_length:
                acc += f" L={a.quality_length}"
        own = [part for part in said[id(a)] if a.accuracy is None or part not in common]
        ref = ""
        if own:
            notes.append(f"{a.label or a.variant}: {'; '.join(own)}")
            ref = f"[{len(notes)}]"
        rows.append(
            {
                "rank": str(a.rank) if a.rank else "-",
                "variant": a.label or a.variant,
                "time": (fmt_time(a.time_s) + ("~" if estimated else "")) if timed else "",
                "memory": fmt_bytes(a.peak_bytes) if a.peak_bytes is not None and math.isfinite(a.peak_bytes) else "",
                "accuracy": acc,
                "note": ref,
            }
        )
    return title, pd.DataFrame(rows, columns=["rank", "variant", "time", "memory", "accuracy", "note"]), notes, shared


def answers_json(answers: list[Answer], context: dict) -> dict:
    """The answers and their context as plain JSON (`bench advise --format json`): bytes as integers, every other
    measured or fitted figure to 4 significant digits (what a median of a few calls carries), non-finite as null."""

    def clean(key: str, value):
        if isinstance(value, (list, tuple)):
            return [clean(key, v) for v in value]
        if not isinstance(value, float):
            return value
        if not math.isfinite(value):
            return None
        return round(value) if key.endswith("bytes") or key == "memory" else significant(value)

    return {
        "context": {k: clean(k, v) for k, v in context.items()},
        "answers": [
            {k: clean(k, v) for k, v in asdict(a).items()}
            for a in sorted(answers, key=lambda a: (a.rank is None, a.rank or 0))
        ],
        "recommendation": recommendation(answers, context),
    }
