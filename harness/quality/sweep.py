"""Every training of a quality run, not finished yet: first each (task, variant, length)'s training-step
cost, measured in a process of its own on a quiet machine, then the trainings; rows appended as they exist."""

from __future__ import annotations

from pathlib import Path

import variants
from harness.core.isolation import run_isolated
from harness.quality.config import QualityConfig, TrainConfig
from harness.quality.kept_models import model_path
from harness.quality.train import measure_training_step, train_one
from harness.quality.trainings import keep_finished_runs, planned, training_keys, trainings
from harness.store.storage import QUALITY_RESULTS, TRAIN_COST, RowWriter, drop_torn_tail, read_rows


def cost_key(row: dict, d_model: int) -> tuple:
    """(task, variant, L, d_model) of a cost row; `d_model`: the width of a row from before rows recorded theirs
    (measured at the run's first width, `config.train`)."""
    return (row["task"], row["variant"], int(row["length"]), int(row.get("cfg_d_model", d_model)))


COST_TIMEOUT_S = 600  # for one cost measurement (model build, 7 steps, a measured step)


def measure_cost(
    run_dir: Path, config: QualityConfig, cfg: TrainConfig, task: str, name: str, length: int, options: dict
) -> dict:
    """One training step's cost (of recipe `cfg`) in a process of its own; a failure (OOM, crash, timeout) is a row
    that says so."""
    outcome = run_isolated(
        measure_training_step,
        (task, length, name, options, cfg, config.device, config.dtype),
        timeout=COST_TIMEOUT_S,
        imports=config.imports,
        log_path=str(run_dir / "cost.log"),
    )
    if outcome.kind == "result":
        return {**outcome.value, "status": "ok"}
    return {
        "task": task,
        "variant": name,
        "options": options,
        "length": length,
        "device": config.device,
        "dtype": config.dtype,
        "status": "error",
        "error": outcome.describe(),
        **cfg.row_fields(),
    }


def sweep_quality(
    run_dir: Path, config: QualityConfig, on_eval=None, on_start=None, finished: set[tuple] | None = None
) -> list[dict]:
    """Run every training not finished yet; rows are appended as they exist. With config.measure_cost,
    each (task, variant, length) first gets its training-step cost at each width in RUN_DIR/train_cost.jsonl.

    finished: the result of `keep_finished_runs(run_dir, config)` when the caller already called it.
    """
    finished = keep_finished_runs(run_dir, config) if finished is None else finished
    options = config.options
    if config.measure_cost:  # first, all together: a quiet machine for the timings, before hours of training
        drop_torn_tail(run_dir, TRAIN_COST)
        costed = {cost_key(r, config.train.d_model) for r in read_rows(run_dir, TRAIN_COST)}
        cells = dict.fromkeys((t, v, n) for t, v, _, chain in trainings(config) for n in chain)
        with RowWriter(run_dir, TRAIN_COST) as cost_writer:
            for cfg, (task, name, n) in ((c, cell) for c in config.step_recipes() for cell in cells):
                if (task, name, n, cfg.d_model) not in costed:
                    if on_start:
                        on_start(task, n, name, None, "cost")
                    cost_writer.append(
                        measure_cost(run_dir, config, cfg, task, name, n, variants.options_taken(name, options))
                    )
    with RowWriter(run_dir, QUALITY_RESULTS) as writer:
        for cfg, (task, name, seed, chain) in planned(config):
            if all(key in finished for key in training_keys(cfg, task, name, seed, chain)):
                continue
            if on_start:
                on_start(task, chain[0], name, seed, "train")

            def record(row):
                writer.append(row)
                if on_eval:
                    on_eval(row)

            train_one(
                task,
                chain,
                name,
                variants.options_taken(name, options),
                cfg,
                seed=seed,
                device=config.device,
                dtype=config.dtype,
                on_eval=record,
                save_to=model_path(run_dir, config, cfg, task, name, chain[-1], seed) if config.keep_models else None,
            )
    return read_rows(run_dir, QUALITY_RESULTS)
