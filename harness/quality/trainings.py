"""A quality run's trainings: each in the order the run makes them, the keys of its rows, and which finished
(the rows of an unfinished one are dropped: it is redone whole). Torch-free."""

from __future__ import annotations

from pathlib import Path

from harness.quality.config import QualityConfig, TrainConfig
from harness.store.storage import QUALITY_RESULTS, drop_torn_tail, read_rows, rewrite_rows


def run_key(row: dict) -> tuple:
    """(task, variant, length, seed, d_model, lr, positions) of an evaluation row (rows of old runs carry no seed:
    0; no encoding: their architecture's, sinusoidal or Zoology's none)."""
    return (
        row["task"],
        row["variant"],
        int(row["length"]),
        int(row.get("seed", 0)),
        int(row.get("cfg_d_model", TrainConfig.d_model)),
        float(row.get("cfg_lr", TrainConfig.lr)),
        row.get("cfg_positions") or ("none" if row.get("cfg_arch") == "zoology" else "sinusoidal"),
    )


def training_keys(recipe: TrainConfig, task: str, variant: str, seed: int, chain) -> list:
    """The run keys (`run_key`) of one training's final rows: one a length of its chain."""
    return [(task, variant, n, seed, recipe.d_model, float(recipe.lr), recipe.encoding) for n in chain]


def trainings(config: QualityConfig) -> list[tuple[str, str, int, tuple[int, ...]]]:
    """Every training of the run as (task, variant, seed, lengths): one per length, or with the
    curriculum one per (task, variant, seed) through every length in increasing order. Seed by seed:
    an interrupted run holds whole seeds of every (task, variant) rather than every seed of a few; within
    a seed variant by variant, the `long_variants` (one of each family) first, so it holds whole families."""
    cfg = config.train
    if cfg.curriculum:
        first = tuple(v for v in config.long_variants if v in config.variants)
        ordered = first + tuple(v for v in config.variants if v not in first)
        return [
            (t, v, s, tuple(sorted(config.lengths_of(t, v))))
            for s in config.seeds_list
            for v in ordered
            for t in config.tasks
        ]
    every = {t: tuple(dict.fromkeys(n for v in config.variants for n in config.lengths_of(t, v))) for t in config.tasks}
    return [
        (t, v, s, (n,))
        for s in config.seeds_list
        for t in config.tasks
        for n in every[t]
        for v in config.variants
        if n in config.lengths_of(t, v)
    ]


def planned(config: QualityConfig) -> list[tuple[TrainConfig, tuple[str, str, int, tuple[int, ...]]]]:
    """(recipe, training) of every training the run makes: each point of its axes by each of `trainings`, but
    a variant with an encoding it cannot carry (`config.refused`)."""
    return [(c, t) for c in config.recipes() for t in trainings(config) if config.carries(t[1], c.positions)]


def keep_finished_runs(run_dir: Path, config: QualityConfig | None = None) -> set[tuple]:
    """Drop the rows of trainings that did not finish (they are redone whole); return the finished
    run keys (`run_key`). With the curriculum, a training finishes when its last length does."""
    drop_torn_tail(run_dir, QUALITY_RESULTS)
    rows = read_rows(run_dir, QUALITY_RESULTS)
    finished = {run_key(r) for r in rows if r.get("final")}
    if config is not None and config.train.curriculum:
        whole = {
            key
            for recipe in config.recipes()
            for t, v, s, chain in trainings(config)
            for keys in [training_keys(recipe, t, v, s, chain)]
            if all(k in finished for k in keys)
            for key in keys
        }
        finished &= whole
    kept = [r for r in rows if run_key(r) in finished]
    if len(kept) != len(rows):
        rewrite_rows(run_dir, kept, QUALITY_RESULTS)
    return finished
