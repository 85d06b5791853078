"""A quality run's rows as tables: accuracy per (task, variant, L) over seeds, accuracy by distance,
and training-step cost. Reading only (pandas, no torch): the report, the figures and `bench advise` use it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.quality.config import STEP_FIELDS, TrainConfig
from harness.store.storage import QUALITY_RESULTS, TRAIN_COST, read_metadata, read_rows

KEY = ["task", "variant", "length"]
NOT_RECIPE = ("cfg_threads", "cfg_eval_every")  # how a training ran, not what it trained


def recipe(row: dict) -> dict:
    """What a row's accuracy depends on besides its seed: the training recipe (TrainConfig's fields, each
    at its default where the row predates it), the variant's options, the device and dtype."""
    fields = {f"cfg_{f.name}": row.get(f"cfg_{f.name}", f.default) for f in TrainConfig.__dataclass_fields__.values()}
    fields["cfg_extrapolate"] = tuple(fields["cfg_extrapolate"])  # (JSON keeps it as a list)
    arch_own = "none" if fields["cfg_arch"] == "zoology" else "sinusoidal"  # what positions=None (or no field) means
    fields["cfg_positions"] = fields["cfg_positions"] or arch_own
    return {
        **{k: v for k, v in fields.items() if k not in NOT_RECIPE},
        "options": row.get("options") or {},
        "device": row.get("device", "cpu"),
        "dtype": row.get("dtype", "float32"),
    }


def trained_options(row: dict) -> dict:
    """Every option a row's attention trained with: its `resolved_options` (rows record them since issue
    22), else the options given (older rows: the variant's defaults were not written down)."""
    resolved = row.get("resolved_options")
    return resolved if isinstance(resolved, dict) else (row.get("options") or {})


def mixed_recipe(rows_by_run: dict[str, list[dict]]) -> str | None:
    """Where quality runs trained one (task, variant, L) with different recipes (their accuracies would be
    pooled as if seeds of one): what differs, named; None when every such training shares one recipe."""
    seen: dict[tuple, tuple[str, dict]] = {}
    for run, rows in rows_by_run.items():
        for r in rows:
            if not r.get("final"):
                continue
            key, mine = (r["task"], r["variant"], int(r["length"])), recipe(r)
            if key not in seen:
                seen[key] = (run, mine)
                continue
            other_run, other = seen[key]
            diff = [
                f"{name.removeprefix('cfg_')} {other[name]!r} in {other_run} but {mine[name]!r} in {run}"
                for name in mine
                if mine[name] != other[name]
            ]
            if diff:
                return f"{key[0]} of {key[1]} at L={key[2]} was trained with different recipes: {'; '.join(diff)}"
    return None


def final_frame(rows: list[dict]) -> pd.DataFrame:
    """The rows of finished trainings (the evaluation after each length's last step), with a seed column."""
    final = [{**r, "seed": int(r.get("seed", r.get("cfg_seed", 0)))} for r in rows if r.get("final")]
    encodings = sorted({str(r.get("cfg_positions")) for r in final if r.get("cfg_positions")})
    if len(encodings) > 1:  # (a run with an axis of encodings: harness/readers/quality/positions.py reads it)
        raise ValueError(
            f"these rows hold trainings with {len(encodings)} position encodings ({', '.join(encodings)}); they "
            "would be pooled as seeds of one: read them by encoding (bench report draws such a run apart)"
        )
    df = pd.DataFrame(final)
    if not df.empty:
        df["length"] = df["length"].astype(int)
    return df


def accuracy_summary(rows: list[dict]) -> pd.DataFrame:
    """Per (task, variant, length), in first-seen order: mean, min and max held-out accuracy over seeds,
    the mean exact match, the number of seeds and the options."""
    df = final_frame(rows)
    if df.empty:
        return pd.DataFrame(
            columns=[*KEY, "accuracy", "accuracy_min", "accuracy_max", "exact_match", "seeds", "options"]
        )
    out = (
        df.groupby(KEY, sort=False)
        .agg(
            accuracy=("eval_accuracy", "mean"),
            accuracy_min=("eval_accuracy", "min"),
            accuracy_max=("eval_accuracy", "max"),
            exact_match=("eval_exact_match", "mean"),
            seeds=("seed", "nunique"),
            options=("options", "first"),
            **({"resolved_options": ("resolved_options", "first")} if "resolved_options" in df else {}),
        )
        .reset_index()
    )
    return out


def state_frame(rows: list[dict], task: str = "recall") -> pd.DataFrame:
    """Per (variant, length) of `task`: the decoding state the trained model holds after the task's
    sequence (all layers, batch 1; rows record it since issue 30) and the accuracy (mean over seeds):
    Zoology's axis, on which methods compare fairly. Empty for rows that do not record a state."""
    columns = ["variant", "length", "state_bytes", "state_kind", "accuracy", "seeds"]
    df = final_frame([r for r in rows if r.get("task") == task and r.get("state_bytes") is not None])
    if df.empty:
        return pd.DataFrame(columns=columns)
    out = (
        df.groupby(["variant", "length"], sort=False)
        .agg(
            state_bytes=("state_bytes", "first"),
            state_kind=("state_kind", "first"),
            accuracy=("eval_accuracy", "mean"),
            seeds=("seed", "nunique"),
        )
        .reset_index()
    )
    return out[columns].sort_values(["state_bytes", "variant"], kind="stable").reset_index(drop=True)


def by_distance_frame(rows: list[dict], facts: dict[str, dict] | None = None) -> pd.DataFrame:
    """Accuracy by distance bucket per (task, variant, length): pooled over seeds (scored positions
    weighted by their count), with the lowest and highest seed's accuracy in that bucket, and the
    variant's reach (`window`: the value of its spec's reach option, from the run's recorded `facts`)."""
    records = []
    for r in final_frame(rows).to_dict("records"):
        for b in r.get("by_distance") or []:
            records.append(
                {
                    "task": r["task"],
                    "variant": r["variant"],
                    "length": r["length"],
                    "seed": r["seed"],
                    "min": b["min"],
                    "max": b["max"],
                    "right": b["accuracy"] * b["count"],
                    "count": b["count"],
                    "seed_accuracy": b["accuracy"],
                    "options": r.get("options") or {},
                    "resolved": trained_options(r),
                }
            )
    if not records:
        return pd.DataFrame(
            columns=[*KEY, "min", "max", "accuracy", "accuracy_min", "accuracy_max", "count", "seeds", "window"]
        )
    df = pd.DataFrame(records)
    out = (
        df.groupby([*KEY, "min", "max"], sort=False)
        .agg(
            right=("right", "sum"),
            count=("count", "sum"),
            accuracy_min=("seed_accuracy", "min"),
            accuracy_max=("seed_accuracy", "max"),
            seeds=("seed", "nunique"),
            options=("options", "first"),
            resolved=("resolved", "first"),
        )
        .reset_index()
    )
    out["accuracy"] = out["right"] / out["count"]
    reach = {name: fact.get("reach_option") for name, fact in (facts or {}).items()}
    out["window"] = [o.get(reach[v]) if reach.get(v) else None for v, o in zip(out["variant"], out["resolved"])]
    return out.drop(columns=["right", "resolved"]).sort_values([*KEY, "min"], kind="stable").reset_index(drop=True)


def accuracy_within(distance: pd.DataFrame, low: int, high: int | None) -> tuple[float, int]:
    """(accuracy, count) pooled over the buckets of `distance` (rows of `by_distance_frame`, one task,
    variant and length) that lie within [low, high] (high None: no upper bound); buckets are powers of
    two, so pass bucket edges."""
    sel = distance[distance["min"] >= low]
    if high is not None:
        sel = sel[sel["max"] <= high]
    count = int(sel["count"].sum())
    return (float((sel["accuracy"] * sel["count"]).sum() / count) if count else float("nan")), count


def cost_frame(run_dir: Path) -> pd.DataFrame:
    """RUN_DIR/train_cost.jsonl: one row per (task, variant, length, width), with the recipe it measured in cfg_<field>
    (a row from before rows recorded theirs: the run's own first recipe, what it was measured at); empty when the
    run measured none."""
    rows = read_rows(Path(run_dir), TRAIN_COST, quiet=True) if (Path(run_dir) / TRAIN_COST).exists() else []
    df = pd.DataFrame(rows)
    if not df.empty:
        df["length"] = df["length"].astype(int)
        cfg = read_metadata(Path(run_dir)).get("config", {})
        for f in TrainConfig.__dataclass_fields__.values():
            column = f"cfg_{f.name}"
            measured_at = cfg.get(f.name, f.default)
            values = df[column] if column in df else [None] * len(df)  # (a value may be a list: filled one by one)
            df[column] = [measured_at if v is None or (isinstance(v, float) and pd.isna(v)) else v for v in values]
    return df


def step_key(row: dict) -> tuple:
    """What a training step's cost depends on besides the attention: the task, L, the recipe's model and batch
    (STEP_FIELDS), the device and dtype. Two variants' costs compare only where this is the same."""
    return (
        row["task"],
        int(row["length"]),
        *(row.get(f"cfg_{f}") for f in STEP_FIELDS),
        row.get("device"),
        row.get("dtype"),
    )


def sweep_rows(run_dir: Path) -> list[dict]:
    """Every evaluation row of a quality run, at every point of its sweep (d_model, lr)."""
    return read_rows(Path(run_dir), QUALITY_RESULTS, quiet=True) if (Path(run_dir) / QUALITY_RESULTS).exists() else []


def quality_rows(run_dir: Path) -> list[dict]:
    """A quality run's rows as its tables and figures read them: one recipe per (task, variant, L) (`chosen_recipe`)."""
    return chosen_recipe(sweep_rows(run_dir))


def sweep_point(row: dict) -> tuple[int, float]:
    """(d_model, lr) a row trained with."""
    return int(row.get("cfg_d_model", TrainConfig.d_model)), float(row.get("cfg_lr", TrainConfig.lr))


def chosen_recipe(rows: list[dict]) -> list[dict]:
    """The rows of one training recipe per (task, variant, L), so no table pools two: the widest d_model the run
    finished at every one of its rates (else the widest it finished at all: a stopped sweep's half-trained width
    does not stand for the variant), at the learning rate whose final accuracy (mean over seeds) is best there
    (Zoology reports the best of its rates). A run with one d_model and one lr keeps every row; unfinished
    trainings keep theirs."""
    scores: dict[tuple, dict[tuple, list[float]]] = {}
    for r in rows:
        if r.get("final"):
            scores.setdefault((r["task"], r["variant"], int(r["length"])), {}).setdefault(sweep_point(r), []).append(
                r["eval_accuracy"]
            )
    rates = {lr for points in scores.values() for _, lr in points}
    chosen = {}
    for key, points in scores.items():
        complete = [d for d in {d for d, _ in points} if {lr for w, lr in points if w == d} >= rates]
        widest = max(complete or [d for d, _ in points])
        at = {point: sum(acc) / len(acc) for point, acc in points.items() if point[0] == widest}
        chosen[key] = max(at, key=lambda point: (at[point], -point[1]))  # (a tie: the smaller rate)
    return [
        r for r in rows if chosen.get((r["task"], r["variant"], int(r["length"])), sweep_point(r)) == sweep_point(r)
    ]


def width_frame(rows: list[dict]) -> pd.DataFrame:
    """Per (task, variant, L, d_model) of a sweep's finished trainings: the best learning rate's final accuracy
    (mean over seeds) and that rate, every rate's accuracy, and the decoding state (Zoology's figure: accuracy
    against model width and against state size, the best of its rates at each width)."""
    columns = ["task", "variant", "length", "d_model", "accuracy", "lr", "by_lr", "state_bytes", "seeds"]
    finals = [r for r in rows if r.get("final")]
    if not finals:
        return pd.DataFrame(columns=columns)
    cells: dict[tuple, dict] = {}
    for r in finals:
        d, lr = sweep_point(r)
        cell = cells.setdefault((r["task"], r["variant"], int(r["length"]), d), {"by_lr": {}, "state": None})
        cell["by_lr"].setdefault(lr, []).append(r["eval_accuracy"])
        cell["state"] = r.get("state_bytes")
    out = []
    for (task, variant, length, d), cell in cells.items():
        means = {lr: sum(acc) / len(acc) for lr, acc in sorted(cell["by_lr"].items())}
        best = max(means, key=lambda lr: (means[lr], -lr))
        seeds = len(cell["by_lr"][best])
        out.append([task, variant, length, d, means[best], best, means, cell["state"], seeds])
    return pd.DataFrame(out, columns=columns)
