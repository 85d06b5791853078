"""`bench advise`: join measured cost (speed runs) and measured loss (quality runs) into one answer
for a sequence length N, a memory budget and an accuracy need. Reads run directories only.

Per variant: time and peak memory at N — measured at N, or interpolated / extrapolated on the
log-log line of the nearest measured lengths (the fitted exponent), and marked so; held-out accuracy
on the task at the trained length L nearest to N (marked when L < N: the model never saw N), with
what accuracy by distance says at that L; then a ranking: the fastest variant that fits the budget
and keeps the accuracy asked for.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from harness.fmt import fmt_bytes, fmt_time
from harness.options import ArgumentError
from harness.quality.config import TOKENS_PER_L
from harness.readers.frames import load_frame
from harness.readers.quality_frames import (
    accuracy_summary,
    by_distance_frame,
    mixed_recipe,
    quality_rows,
    trained_options,
)
from harness.readers.summary import fit_exponent
from harness.store.rows import NO_TIME
from harness.sweep.config import BASELINE
from harness.store.storage import RESULTS, read_metadata, variant_facts


@dataclass
class Answer:
    variant: str
    label: str = ""  # the variant, with the options that tell it apart where the runs timed several option sets
    time_s: float | None = None
    peak_bytes: float | None = None
    how: str = ""  # "measured", "interpolated ...", "extrapolated ...", or why there is no figure
    failed: str = ""  # "oom at N=..." when the variant stopped at or below N
    accuracy: float | None = None
    accuracy_range: tuple[float, float] | None = None
    quality_length: int | None = None
    quality_note: list[str] = field(default_factory=list)
    fits: bool = True
    rank: int | None = None
    excluded: str = ""


def split_runs(run_dirs: list[Path]) -> tuple[list[Path], list[Path]]:
    """(speed runs, quality runs) among the directories; a directory must be one or the other."""
    speed, quality = [], []
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise ArgumentError(f"RUN_DIR {str(run_dir)!r} is not a directory")
        has_speed, has_quality = (run_dir / RESULTS).exists(), bool(quality_rows(run_dir))
        if not has_speed and not has_quality:
            raise ArgumentError(f"RUN_DIR {str(run_dir)!r} holds no rows of bench run or bench quality")
        (speed if has_speed else quality).append(run_dir)
    if not speed:
        raise ArgumentError(
            "bench advise needs at least one speed run (written by bench run) beside the quality runs; "
            f"got only quality runs: {', '.join(map(str, quality))}"
        )
    return speed, quality


SETUP = (
    "device_name",
    "batch",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "threads",
)  # what a speed row measured besides its cell


def speed_rows(speed_dirs: list[Path], device: str | None, pass_: str, causal: bool) -> tuple[str, pd.DataFrame]:
    """(device, the speed runs' rows of that device, pass and causality); device None: cpu if the runs
    hold it. ArgumentError naming what the runs hold when they have no such rows, and naming the difference
    when the runs measured different setups (machine, B, H, D, dtype, threads): rows of different setups are
    never pooled. A variant timed with different options in different runs is one `setting` per option set
    (labelled with the options that differ); a cell measured by several runs of one setup is their median."""
    frames = []
    for d in speed_dirs:
        frame = load_frame(d)
        frame["run"] = str(d)
        frames.append(frame)
    df = pd.concat(frames, ignore_index=True)
    df["causal"] = df["causal"].astype(bool)
    devices = sorted(df["device"].unique())
    device = device or ("cpu" if "cpu" in devices else devices[0])
    if device not in devices:
        raise ArgumentError(f"--device {device}: the speed runs hold {', '.join(devices)} only")
    sel = df[(df["device"] == device) & (df["pass"] == pass_) & (df["causal"] == causal)]
    if sel.empty:
        mine = df[df["device"] == device]
        have = ", ".join(
            f"{p} {_causal_word(c)}" for p, c in sorted({(p, bool(c)) for p, c in zip(mine["pass"], mine["causal"])})
        )
        raise ArgumentError(
            f"the speed runs have no {pass_} {_causal_word(causal)} rows on {device}; they hold {have} "
            "(--pass, --causal/--no-causal)"
        )
    _check_one_setup(sel)
    return device, _settings(sel)


def _known(value) -> bool:
    return value is not None and value == value  # (NaN: not recorded by an older run)


def _check_one_setup(sel: pd.DataFrame) -> None:
    """ArgumentError naming each setup field whose recorded values differ between the runs (a field a run
    did not record is not compared)."""
    diffs = []
    for name in SETUP:
        if name not in sel:
            continue
        per_run = {
            run: sorted({str(v) for v in group[name] if _known(v)}) for run, group in sel.groupby("run", sort=False)
        }
        values = {v for vs in per_run.values() for v in vs}
        if len(values) > 1:
            diffs.append(f"{name} " + ", ".join(f"{'/'.join(vs)} in {run}" for run, vs in per_run.items() if vs))
    if diffs:
        raise ArgumentError(
            "the speed runs measured different setups, whose rows cannot be pooled: "
            + "; ".join(diffs)
            + " (give speed runs of one machine and shape)"
        )


def _options_key(options) -> str:
    """The options a row was timed with, those at None left out (a run older than an option did not record it)."""
    return json.dumps({k: v for k, v in (options or {}).items() if v is not None}, sort_keys=True, default=str)


def _settings(sel: pd.DataFrame) -> pd.DataFrame:
    """The rows with a `setting` column (the variant, with the options that tell its option sets apart where
    the runs timed it with several) and one row per (setting, N): the median over the runs that measured it
    (`runs` says how many), a failed row only where no run measured that cell."""
    sel = sel.assign(options_key=[_options_key(o) for o in sel["options"]])
    labels = {}
    for variant, group in sel.groupby("variant", sort=False):
        keys = list(dict.fromkeys(group["options_key"]))
        for key in keys:
            if len(keys) == 1:
                labels[(variant, key)] = variant
                continue
            mine, others = json.loads(key), [json.loads(k) for k in keys if k != key]
            differ = {k: v for k, v in mine.items() if any(o.get(k) != v for o in others)}
            labels[(variant, key)] = (
                f"{variant} ({_options_text(differ)})" if differ else variant
            )  # (the other sets add options)
    sel = sel.assign(setting=[labels[(v, k)] for v, k in zip(sel["variant"], sel["options_key"])])
    out = []
    for (_, n), group in sel.groupby(["setting", "n"], sort=False):
        ok = group[group["status"] == "ok"]
        if len(ok) > 1:
            row = ok.iloc[0].copy()
            row["time_median_s"] = float(ok["time_median_s"].median())
            peaks = [b for b in ok["peak_bytes"] if _known(b)]
            row["peak_bytes"] = float(pd.Series(peaks).median()) if peaks else None
            row["runs"] = len(ok)
            out.append(row)
        else:
            row = (ok if len(ok) else group).iloc[0].copy()
            row["runs"] = 1
            out.append(row)
    return pd.DataFrame(out).reset_index(drop=True)


def log_interp(points: list[tuple[int, float]], n: int) -> tuple[float, str]:
    """Value at n on the log-log line through the measured points: exact, between two, or beyond the ends
    (slope fitted on the two nearest points' side: the last half of the points)."""
    points = sorted(points)
    for m, v in points:
        if m == n:
            return v, "measured"
    below = [(m, v) for m, v in points if m < n]
    above = [(m, v) for m, v in points if m > n]
    if below and above:
        (m0, v0), (m1, v1) = below[-1], above[0]
        k = math.log(v1 / v0) / math.log(m1 / m0)
        return v0 * (n / m0) ** k, f"interpolated between N={m0} and N={m1}"
    if len(points) < 2:
        return float("nan"), f"only N={points[0][0]} measured: no exponent to extrapolate with"
    if below:  # beyond the largest
        k = fit_exponent([m for m, _ in points], [v for _, v in points])
        m0, v0 = below[-1]
        return v0 * (n / m0) ** k, f"extrapolated from N={m0} (~N^{k:.2f})"
    k = fit_exponent([m for m, _ in points[:2]], [v for _, v in points[:2]], upper_fraction=1.0)
    m1, v1 = above[0]
    return v1 * (n / m1) ** k, f"extrapolated down from N={m1} (~N^{k:.2f})"


def _causal_word(causal: bool) -> str:
    return "causal" if causal else "non-causal"


def _options_text(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items() if v is not None)


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
        min_accuracy, floor = default_floor(answers)
    elif min_accuracy is not None:
        floor = f"ranked if accuracy >= {_percent(min_accuracy)} (--min-accuracy)"
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


def default_floor(answers: list[Answer]) -> tuple[float | None, str]:
    """The accuracy a variant must keep to be ranked when --min-accuracy is not given: within
    FLOOR_POINTS of the baseline's (exact softmax, trained the same way), so that a method failing the
    task is never ranked first for being fast. (None, why) when the baseline has no accuracy."""
    base = next((a for a in answers if a.variant == BASELINE and a.accuracy is not None), None)
    if base is None:
        return None, f"no floor: {BASELINE} has no accuracy in the quality runs (give --min-accuracy)"
    floor = max(0.0, base.accuracy - FLOOR_POINTS)
    return floor, (
        f"ranked if within {FLOOR_POINTS * 100:.0f} points of {BASELINE}'s accuracy ({base.accuracy:.1%}): "
        f">= {_percent(floor)}; --min-accuracy to change it (0 for none)"
    )


def _percent(fraction: float) -> str:
    """90%, 85.5%: a floor as a percentage, one decimal where it has one."""
    return f"{fraction:.1%}".replace(".0%", "%")


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
            f"trained with {_options_text({k: trained[k] for k in differ})}, "
            f"timed with {_options_text({k: speed_options[k] for k in differ})}"
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
                else f"accuracy {a.accuracy:.1%} < {_percent(min_accuracy)}"
            )
    ranked = sorted((a for a in answers if not a.excluded), key=lambda a: a.time_s)
    for i, a in enumerate(ranked, 1):
        a.rank = i


def recommendation(answers: list[Answer], context: dict) -> str:
    """One sentence: the pick and why, or why there is none."""
    ranked = sorted((a for a in answers if a.rank), key=lambda a: a.rank)
    need = []
    if context.get("memory") is not None:
        need.append(f"fits in {fmt_bytes(context['memory'])}")
    if context.get("min_accuracy") is not None:
        need.append(f"keeps >= {_percent(context['min_accuracy'])} on {context['task']}")
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
    """The answers and their context as plain JSON (`bench advise --format json`)."""

    def clean(value):
        return None if isinstance(value, float) and not math.isfinite(value) else value

    return {
        "context": {k: clean(v) for k, v in context.items()},
        "answers": [
            {k: clean(v) for k, v in asdict(a).items()}
            for a in sorted(answers, key=lambda a: (a.rank is None, a.rank or 0))
        ],
        "recommendation": recommendation(answers, context),
    }
