"""The sections of a quality run's REPORT.md that only a sweep has (--d-model, --lr over several values): accuracy
against model width and state size at each width's best rate, and a zoology run against Zoology's configuration."""

from __future__ import annotations

from pathlib import Path

from harness.fmt import fmt_bytes
from harness.quality.config import ZOOLOGY_PUBLISHED, ZOOLOGY_VALUES, QualityConfig
from harness.readers.quality_frames import sweep_rows, width_frame
from harness.readers.tables import markdown_table


def sweep_lines(run_dir: Path, cfg: dict) -> list[str]:
    """What the tables of a sweep hold, true of the run as it stands (finished or not)."""
    if _unfinished_points(width_frame(sweep_rows(run_dir)), cfg):
        return [
            "The sweep is unfinished: the tables below hold, for each variant, the widest model trained at every "
            "learning rate so far, at its best rate; the section on model width holds every point trained and names "
            "the points not trained yet.",
            "",
        ]
    return [
        "Every training was made at each point of the sweep; the tables below hold, for each variant, the widest "
        "model at its best learning rate, and the section on model width holds every point.",
        "",
    ]


def width_section(run_dir: Path, cfg: dict) -> list[str]:
    """Accuracy against d_model and against decoding-state bytes, the best learning rate at each width (Zoology's
    figure), every rate's accuracy beside it; and, for the zoology preset, the run against Zoology's configuration."""
    widths = width_frame(sweep_rows(run_dir))
    if widths.empty:
        return []
    rates = sorted({lr for cell in widths["by_lr"] for lr in cell})
    body = [
        [
            f"`{r['variant']}`",
            str(r["task"]),
            str(r["length"]),
            str(r["d_model"]),
            fmt_bytes(r["state_bytes"]) if r["state_bytes"] is not None else "—",
            f"**{r['accuracy']:.1%}** ({r['lr']:g})",
            *[f"{r['by_lr'][lr]:.1%}" if lr in r["by_lr"] else "" for lr in rates],
        ]
        for r in widths.sort_values(["task", "length", "d_model"], kind="stable").to_dict("records")
    ]
    lines = [
        "### Accuracy against model width and state size",
        "",
        "Final held-out accuracy at each d_model, the best learning rate in bold (Zoology reports the best of its "
        "rates), each rate's beside it; state: the decoding state after the sequence, every layer, batch 1.",
        "",
        markdown_table(
            ["variant", "task", "L", "d_model", "state", "best (lr)", *[f"lr {lr:g}" for lr in rates]], body
        ),
        "",
        *_unfinished_points(widths, cfg),
    ]
    if cfg.get("preset") == "zoology":
        lines += [
            "### Against Zoology's published configuration",
            "",
            markdown_table(
                ["", "Zoology", "this run", "why"],
                [
                    [what, theirs, _cfg_text(cfg, key), _why(cfg, key, why)]
                    for what, theirs, key, why in ZOOLOGY_PUBLISHED
                ],
            ),
            "",
        ]
    return lines


def _unfinished_points(widths, cfg: dict) -> list[str]:
    """A line naming the sweep's (variant, d_model, lr) points (`QualityConfig.recipes`, what the run trains)
    with no finished training, if there are any."""
    config = QualityConfig.from_json(cfg)
    done = {(r["variant"], int(r["d_model"]), float(lr)) for r in widths.to_dict("records") for lr in r["by_lr"]}
    missing: dict[tuple[int, float], list[str]] = {}
    for recipe in config.recipes():
        for name in config.variants:
            if (name, recipe.d_model, recipe.lr) not in done:
                missing.setdefault((recipe.d_model, recipe.lr), []).append(f"`{name}`")
    if not missing:
        return []
    points = "; ".join(f"d_model {d} at lr {lr:g}: {', '.join(names)}" for (d, lr), names in missing.items())
    return [
        f"The sweep is unfinished (`bench quality --resume RUN_DIR` trains the rest). Not trained yet: {points}.",
        "",
    ]


def _why(cfg: dict, key: str, why: str) -> str:
    """The reason a run differs from Zoology, or nothing where it does not (a CUDA run at Zoology's values)."""
    return "" if key in ZOOLOGY_VALUES and cfg.get(key) == ZOOLOGY_VALUES[key] else why


def _cfg_text(cfg: dict, key: str) -> str:
    """A run's value of `key` for the comparison table (a key it does not hold is the text itself)."""
    if key not in cfg and key not in ("d_models", "lrs"):
        return key
    value = cfg.get(key) or ([cfg.get("d_model")] if key == "d_models" else [cfg.get("lr")] if key == "lrs" else None)
    if key == "lengths":
        return ", ".join(f"({n}, {cfg.get('pairs') or n // 16})" for n in value)
    if key == "steps":
        seen = value * cfg.get("batch", 1)
        epochs = (
            f", {seen / cfg['train_examples']:.1f} epochs of {cfg['train_examples']:,}"
            if cfg.get("train_examples")
            else ""
        )
        return f"{value} steps{epochs}"
    if isinstance(value, list):
        return ", ".join(f"{v:g}" for v in value)
    return str(value)
