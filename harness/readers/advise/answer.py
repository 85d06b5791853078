"""`bench advise`: join measured cost (speed runs) and measured loss (quality runs) into one answer
for a sequence length N, a memory budget and an accuracy need. Reads run directories only.

Per variant: time and peak memory at N — measured at N, or interpolated / extrapolated on the
log-log line of the nearest measured lengths (the fitted exponent), and marked so; held-out accuracy
on the task at the trained length L nearest to N (marked when L < N: the model never saw N), with
what accuracy by distance says at that L; then a ranking: the fastest variant that fits the budget
and keeps the accuracy asked for.

The cost side: cost.py; the answer as a table, a glance, JSON or a sentence: text.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.fmt import fmt_bytes, fmt_percent
from harness.options import ArgumentError
from harness.quality.config import TOKENS_PER_L
from harness.readers.advise.cost import Answer, log_interp, options_text, speed_rows, split_runs
from harness.readers.quality.frames import (
    accuracy_summary,
    by_distance_frame,
    mixed_recipe,
    quality_rows,
    trained_options,
)
from harness.store.rows import NO_TIME
from harness.store.storage import baseline_of, read_metadata, variant_facts


def advise(
    run_dirs: list[Path],
    *,
    n: int,
    device: str | None = None,
    pass_: str = "fwdbwd",
    causal: bool = True,
    memory: int | None = None,
    task: str = "recall",
    min_accuracy: float | None = None,
) -> tuple[list[Answer], dict]:
    """The answers per variant, ranked, and the context {"device", "pass", "causal", "n", "task", "quality_runs"}."""
    if n < 1:
        raise ArgumentError(f"--len {n} is not allowed; it must be >= 1")
    if min_accuracy is not None and not 0 <= min_accuracy <= 1:
        raise ArgumentError(
            f"--min-accuracy {min_accuracy} is not allowed; give a fraction in [0, 1] (0.9) or a percentage (90%)"
        )
    speed_dirs, quality_dirs = split_runs(run_dirs)
    device, sel = speed_rows(speed_dirs, device, pass_, causal)
    by_run = {str(d): quality_rows(d) for d in quality_dirs}
    mixed = mixed_recipe(by_run)
    if mixed:
        raise ArgumentError(f"{mixed}; their accuracies are not seeds of one training: give quality runs of one recipe")
    rows = [r for group in by_run.values() for r in group]
    planned = max([int((read_metadata(d).get("config") or {}).get("seeds") or 1) for d in quality_dirs], default=1)
    facts = variant_facts(*run_dirs)
    summary, distance = accuracy_summary(rows), by_distance_frame(rows, facts)
    if rows:
        quality_devices = {r.get("device", "cpu") for r in rows}
        summary = summary[summary["task"] == task]
        if summary.empty:
            finished = sorted({r["task"] for r in rows if r.get("final")})
            started = sum(1 for r in rows if r["task"] == task)
            if started:
                raise ArgumentError(
                    f"--task {task}: the quality runs hold no finished {task} training yet (only "
                    f"{started} evaluation rows of unfinished ones); finished: {', '.join(finished) or 'none'}"
                )
            raise ArgumentError(
                f"--task {task}: the quality runs trained {', '.join(finished) or 'nothing to the end'} only"
            )
        if device not in quality_devices:
            raise ArgumentError(
                f"the runs share no device: the quality runs trained on {', '.join(sorted(quality_devices))}, "
                f"the speed rows used are {device} (--device, or runs of the same device)"
            )
    answers = []
    for setting, group in sel.groupby("setting", sort=False):
        answer = Answer(group["variant"].iloc[0], label=setting)
        ok = group[group["status"] == "ok"]
        stopped = group[(group["status"].isin(NO_TIME)) & (group["n"] <= n)]
        if not stopped.empty:
            first = stopped.sort_values("n").iloc[0]
            answer.failed = f"{first['status']} at N={int(first['n'])}"
        if ok.empty:
            answer.how = "no successful measurement"
        else:
            answer.time_s, answer.how = log_interp(list(zip(ok["n"].astype(int), ok["time_median_s"])), n)
            pooled = ok[(ok["runs"] > 1) & (ok["n"].astype(int) == n)]
            if answer.how == "measured" and not pooled.empty:
                answer.how = f"measured (median of {int(pooled['runs'].iloc[0])} runs)"
            mem = [(int(m), float(b)) for m, b in zip(ok["n"], ok["peak_bytes"]) if b is not None and b == b and b > 0]
            answer.peak_bytes = log_interp(mem, n)[0] if mem else None
        speed_options = group["options"].iloc[0] or {}
        if rows:
            _attach_quality(
                answer, summary, distance, n, speed_options, facts, max(planned, int(summary["seeds"].max()))
            )
        answers.append(answer)
    floor = ""
    if min_accuracy is None and rows:
        min_accuracy, floor = default_floor(answers, baseline_of(facts))
    elif min_accuracy is not None:
        floor = f"ranked if accuracy >= {fmt_percent(min_accuracy)} (--min-accuracy)"
    _rank(answers, memory, min_accuracy, bool(rows))
    return answers, {
        "device": device,
        "pass": pass_,
        "causal": causal,
        "n": n,
        "task": task,
        "quality_runs": bool(rows),
        "memory": memory,
        "min_accuracy": min_accuracy,
        "floor": floor,
    }


FLOOR_POINTS = 0.10  # the default accuracy floor: this far below the baseline's accuracy at most


def default_floor(answers: list[Answer], baseline: str | None) -> tuple[float | None, str]:
    """The accuracy a variant must keep to be ranked when --min-accuracy is not given: within
    FLOOR_POINTS of the baseline's (exact softmax, trained the same way), so that a method failing the
    task is never ranked first for being fast. (None, why) when the baseline has no accuracy."""
    base = next((a for a in answers if a.variant == baseline and a.accuracy is not None), None)
    if base is None:
        return None, f"no floor: {baseline or 'no baseline'} has no accuracy in the quality runs (give --min-accuracy)"
    floor = max(0.0, base.accuracy - FLOOR_POINTS)
    return floor, (
        f"ranked if within {FLOOR_POINTS * 100:.0f} points of {baseline}'s accuracy ({base.accuracy:.1%}): "
        f">= {fmt_percent(floor)}; --min-accuracy to change it (0 for none)"
    )


def _attach_quality(
    answer: Answer,
    summary: pd.DataFrame,
    distance: pd.DataFrame,
    n: int,
    speed_options: dict,
    facts: dict[str, dict],
    seeds: int,
) -> None:
    """The accuracy of the variant, or of the variant its spec says computes the same function (as the
    runs recorded it), at the trained length nearest N; notes where the options that change the
    function differ between the speed and the quality run."""
    name = (
        answer.variant
        if answer.variant in set(summary["variant"])
        else facts.get(answer.variant, {}).get("same_function_as")
    )
    mine = summary[summary["variant"] == name] if name else summary.iloc[0:0]
    if mine.empty:
        answer.quality_note.append("not trained in the quality runs")
        return
    if name != answer.variant:
        answer.quality_note.append(f"accuracy of {name} (the same function)")
    lengths = sorted(mine["length"].astype(int))
    per = TOKENS_PER_L[mine["task"].iloc[0]]
    length = min(lengths, key=lambda L: (abs(math.log(per * L / n)), -L))
    row = mine[mine["length"] == length].iloc[0]
    answer.accuracy, answer.quality_length = float(row["accuracy"]), length
    answer.accuracy_range = (float(row["accuracy_min"]), float(row["accuracy_max"]))
    if int(row["seeds"]) < seeds:  # an unfinished run: this mean is over fewer seeds than the others'
        answer.quality_note.append(f"{int(row['seeds'])} of {seeds} seeds (the quality run did not finish them)")
    if per * length < n:
        tokens = f" ({per * length} tokens)" if per != 1 else ""
        answer.quality_note.append(f"trained at L={length}{tokens} < N: accuracy at N not measured")
    trained = trained_options(row)
    compared = facts.get(name, {}).get("function_options") or ()
    differ = [k for k in compared if k in trained and trained[k] != speed_options.get(k, trained[k])]
    if differ:
        answer.quality_note.append(
            f"trained with {options_text({k: trained[k] for k in differ})}, "
            f"timed with {options_text({k: speed_options[k] for k in differ})}"
        )
    far = distance[(distance["variant"] == name) & (distance["length"] == length) & (distance["task"] == row["task"])]
    if len(far) > 1:
        last = far.sort_values("min").iloc[-1]
        answer.quality_note.append(
            f"{last['accuracy']:.0%} at the farthest distances ({int(last['min'])}-{int(last['max'])})"
        )


def _rank(answers: list[Answer], memory: int | None, min_accuracy: float | None, have_quality: bool) -> None:
    for a in answers:
        if a.failed:
            a.excluded = a.failed
        elif a.time_s is None or not math.isfinite(a.time_s):
            a.excluded = a.how
        elif memory is not None and (a.peak_bytes is None or a.peak_bytes > memory):
            a.fits, a.excluded = (
                False,
                f"needs {fmt_bytes(a.peak_bytes)} > budget {fmt_bytes(memory)}"
                if a.peak_bytes
                else "memory not measured",
            )
        elif min_accuracy is not None and (a.accuracy is None or a.accuracy < min_accuracy):
            a.excluded = (
                "accuracy not measured"
                if a.accuracy is None
                else f"accuracy {a.accuracy:.1%} < {fmt_percent(min_accuracy)}"
            )
    ranked = sorted((a for a in answers if not a.excluded), key=lambda a: a.time_s)
    for i, a in enumerate(ranked, 1):
        a.rank = i
