"""The trained models a quality run keeps (`bench quality --keep-models`): one file per training, written before
its final row (a finished training always has its model), and read back exactly as trained (inspect.py), for `bench viz --run`.
Each file holds the weights and everything needed to rebuild the model: the task, variant, options and recipe."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from harness.quality.config import QualityConfig, TrainConfig

MODELS = "models"  # RUN_DIR/models/<task>-<variant>-L<length>-seed<seed>[-<axes>].pt


def model_path(
    run_dir: Path, config: QualityConfig, recipe: TrainConfig, task: str, variant: str, length: int, seed: int
) -> Path:
    """Where a training's model is kept; the run's axes (encoding, width, rate) are named where it has them."""
    axes = (f"-{recipe.encoding}" if config.positions else "") + (f"-d{recipe.d_model}" if config.d_models else "")
    axes += f"-lr{recipe.lr:g}" if config.lrs else ""
    return Path(run_dir) / MODELS / f"{task}-{variant}-L{length}-seed{seed}{axes}.pt"


def save_model(path: Path, model: nn.Module, facts: dict) -> None:
    """The weights and `facts` (task, variant, options, cfg as a dict, vocab_size, max_len, length, seed), written to
    a temporary name then moved: a killed run never leaves half a file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    torch.save({"state_dict": model.state_dict(), **facts}, part)
    part.replace(path)


def kept_models(run_dir: Path) -> list[Path]:
    """The kept models of a run, in name order (empty when it kept none)."""
    return sorted((Path(run_dir) / MODELS).glob("*.pt"))


def model_facts(
    task: str, variant: str, options: dict, cfg: TrainConfig, vocab_size: int, max_len: int, length: int, seed: int
) -> dict:
    """What `save_model` stores beside the weights."""
    return {
        "task": task,
        "variant": variant,
        "options": dict(options),
        "cfg": asdict(cfg),
        "vocab_size": vocab_size,
        "max_len": max_len,
        "length": length,
        "seed": seed,
    }
