"""What a linearization leaves in its folder: a checkpoint while it trains (`Checkpoint`), then the
saved model and its record (`finished`), which later runs load instead of training again."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class Checkpoint:
    """A linearization's progress in FOLDER/checkpoint.pt (written atomically): the stage, its step, the trained
    tensors, the optimizer, the seconds trained so far and what each finished stage measured."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / "checkpoint.pt"

    def load(self) -> dict | None:
        return torch.load(self.path, weights_only=False) if self.path.exists() else None

    def save(self, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_suffix(".part")
        torch.save(state, part)
        part.replace(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def save_dequantized(model, folder: Path) -> None:
    """`save_pretrained` of a model whose weights are plain floats, also one loaded from a GGUF file (transformers
    marks it quantized, and refuses to save it, although it dequantized every weight on loading): the mark is lifted
    while it saves, so the checkpoint reloads as an ordinary float model."""
    quantizer = getattr(model, "hf_quantizer", None)
    config = model.config.__dict__.pop("quantization_config", None)
    try:
        model.hf_quantizer = None
        model.save_pretrained(folder)
    finally:
        model.hf_quantizer = quantizer
        if config is not None:
            model.config.quantization_config = config


def row_of(record: dict, folder: Path) -> dict:
    """The `linearize` row's fields: each stage's record with its first and last losses (means of up to 10
    steps), the training's seconds and tokens in all, where the model was saved."""
    out = {}
    for stage in ("transfer", "lora"):
        data = record.get(stage)
        if data:
            losses = data["losses"]
            window = max(1, min(10, len(losses) // 2))
            data = {**data, "loss_first": sum(losses[:window]) / window, "loss_last": sum(losses[-window:]) / window}
        out[stage] = data
    stages = [s for s in out.values() if s]
    return {
        **out,
        "seconds": sum(s["seconds"] for s in stages),
        "tokens": sum(s["tokens"] for s in stages),
        "saved": str(Path(folder) / "model"),
    }


def summary_of(folder: Path) -> dict:
    """The row of a linearization that finished (saved) before its row was written."""
    return row_of(finished(folder), folder)


def finished(folder: Path) -> dict | None:
    """The record of a linearization saved in FOLDER, or None while it has not finished."""
    marker = Path(folder) / "linearized.json"
    return json.loads(marker.read_text()) if marker.exists() and (Path(folder) / "model").is_dir() else None


def load_linearized(model, folder: Path) -> None:
    """Put a saved linearization's weights (merged projections, the variant's parameters) into `model`, already
    switched to the same attention (variants.hf.use with the same variant and options, or its own sdpa)."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted((Path(folder) / "model").glob("*.safetensors")):
        state.update(load_file(file))
    missing = [
        name for name in state if name not in dict(model.named_parameters()) and name not in dict(model.named_buffers())
    ]
    if missing:
        raise ValueError(
            f"{folder}: the saved model holds {missing[0]}, which this model has not (saved with another "
            f"variant or options)"
        )
    model.load_state_dict(state, strict=False)
