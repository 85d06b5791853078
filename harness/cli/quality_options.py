"""`bench quality`'s options: their types, help texts and defaults (read from the recipe and the presets)."""

from __future__ import annotations

from dataclasses import fields
from enum import Enum
from typing import Annotated, Optional

import typer

from harness.quality.choices import QualityChoices
from harness.quality.config import TrainConfig
from harness.quality.presets import PRESETS

from .common import Task, at_least, compression_option, out_option, resume_option, usual_default

TRAIN = TrainConfig()  # the recipe's defaults, read by the help texts
Preset = Enum("Preset", {name: name for name in PRESETS}, type=str)  # --preset's choices: the presets, by name


TaskOption = Annotated[
    Optional[Task],
    typer.Option(help="copy, recall, mqar (Zoology's), or all. Default: the preset's (quick, long: copy and recall)."),
]
VariantsOption = Annotated[
    Optional[str],
    typer.Option(
        "--variants",
        help="'all' (one variant per attention function that trains on the device) or names, comma-separated. Default: the preset's (quick, zoology: one variant a family; long: all).",
    ),
]
PresetOption = Annotated[
    Preset,
    typer.Option(
        help="quick: minutes, a variant a family. long: L = 64-1024, 3 seeds. zoology: Zoology's MQAR, width and lr swept. positions: every encoding, evaluated at 2-8x L (docs/quality.md)."
    ),
]
LengthsOption = Annotated[
    Optional[str],
    typer.Option(
        help="Task lengths L: the recall sequence's length / the copied string's length (the sequence is 2L). Default: the preset's."
    ),
]
LongLengthsOption = Annotated[
    Optional[str],
    typer.Option(
        help="Lengths after --lengths that only --long-variants train, the curriculum going on to them. Default: the preset's (long: 512,1024 on the CPU)."
    ),
]
LongVariantsOption = Annotated[
    Optional[str],
    typer.Option(
        help="Which variants train --long-lengths: names, comma-separated, or all. Default: the preset's that the run selects (long: one variant a family, those whose spec names one), else all."
    ),
]
CopyLengthsOption = Annotated[
    Optional[str],
    typer.Option(
        help="Copy's lengths when they differ from --lengths. Default: the preset's (long: 32,64,128 on the CPU, sequences of 64-256 tokens like recall's)."
    ),
]
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda, or auto (CUDA when present).")]
DtypeOption = Annotated[str, typer.Option(help="float32, or bfloat16 (autocast; CUDA only).")]
SeedsOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(1),
        help="Train every (task, variant, L) with seeds 0..K-1 (model, data and held-out set); the report gives the mean and min-max. Default: the preset's (quick 1, long 3).",
    ),
]
StepsOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(1),
        help="Training steps per length (per curriculum stage), the same for every variant. Default: the preset's (quick 1500, long 800).",
    ),
]
CurriculumOption = Annotated[
    Optional[bool],
    typer.Option(
        "--curriculum/--no-curriculum",
        help="Train one model per (task, variant, seed) at each length in increasing order, each stage starting from the last. Default: the preset's (long: on).",
    ),
]
PairsOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(1), help="Recall: key-value pairs per sequence (default: the preset's; quick: L // 8)."
    ),
]
QueriesOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(1),
        help="Recall: ask this many distinct keys once each, at random places among filler tokens (<= --pairs). Default: the preset's (quick: every remaining place is a query, keys repeat).",
    ),
]
WarmStartOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(0),
        help="Recall asked once among filler: first train this many steps on the dense layout (every place a query) at the first length; unscored. Default: the preset's (long 2000).",
    ),
]
ShortConvOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(0),
        help="Width of a causal depthwise convolution before each block's attention (Mamba-2's, GLA's and DeltaNet's short convolution; 4 in their papers). Default: the preset's (0: none).",
    ),
]
OutputGateOption = Annotated[
    Optional[bool],
    typer.Option(
        "--output-gate/--no-output-gate",
        help="Multiply each attention's heads by a learned sigmoid gate of its input before the output projection (Qwen3-Next's gated attention), in every variant's model. Default: the preset's (off).",
    ),
]
VocabOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(2),
        help="Task vocabulary (copy: symbols, default 16; recall: keys + values, default max(64, 2 x pairs); mqar 8192).",
    ),
]
DModelOption = Annotated[
    Optional[str],
    typer.Option(
        help="Model width, or several comma-separated: a training at each (a sweep axis). Default: the preset's (64; zoology 64,128)."
    ),
]
LayersOption = Annotated[
    Optional[int],
    typer.Option(callback=at_least(1), help=f"Layers (default {TRAIN.layers}; zoology: convolution, then attention)."),
]
HeadsOption = Annotated[
    Optional[int], typer.Option(callback=at_least(1), help=f"Attention heads (default {TRAIN.heads}; zoology 1).")
]
BatchOption = Annotated[
    Optional[int], typer.Option(callback=at_least(1), help=f"Training batch size (default {TRAIN.batch}).")
]
BatchTokensOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(1),
        help="At most this many tokens a training batch (at long L fewer sequences, never under 1). Default: the preset's (long: 8192 on the CPU; else none).",
    ),
]
LrOption = Annotated[
    Optional[str],
    typer.Option(
        help="Peak learning rate (AdamW, warm-up then cosine decay), or several comma-separated: a training at each, the report keeping the best. Default: the preset's."
    ),
]
EarlyStopOption = Annotated[
    Optional[float],
    typer.Option(
        help="Stop a training once its held-out accuracy reaches this fraction. Default: the preset's (zoology 0.99)."
    ),
]
TrainExamplesOption = Annotated[
    Optional[int],
    typer.Option(
        callback=at_least(1),
        help="Train on a fixed set of this many sequences, in epochs (default: fresh sequences every step; zoology 100000).",
    ),
]
LabelSmoothingOption = Annotated[float, typer.Option(help="Label smoothing of the training loss.")]
WindowOption = Annotated[
    Optional[int],
    typer.Option(
        help=f"Sliding-window width w (default: the preset's, quick {PRESETS['quick']['options']['window']}, long "
        f"{PRESETS['long']['options']['window']}: narrower than most distances on purpose, that is what local "
        "attention gives up)."
    ),
]
CostOption = Annotated[
    bool,
    typer.Option(
        "--cost/--no-cost",
        help="Measure a training step's time, tokens/s and peak memory per (task, variant, L), each in a process of its own (RUN_DIR/train_cost.jsonl).",
    ),
]
OutOption = out_option("quality-")
ResumeOption = resume_option("quality run")

USUAL_STRIDE = usual_default("compression")
STRIDES = ", ".join(f"{name} {p.get('options', {}).get('compression', USUAL_STRIDE)}" for name, p in PRESETS.items())
CompressionOption = compression_option(f"default: the preset's, {STRIDES}")
CHOICES = {f.name: f.default for f in fields(QualityChoices)}  # a new run's defaults, written once: there
PositionsOption = Annotated[
    Optional[str],
    typer.Option(
        help="Position encoding: sinusoidal, learned, rope, alibi, relative (T5's bias) or none; several comma-separated, or all (each variant with those it can carry). Default: the preset's (sinusoidal; zoology none)."
    ),
]
ExtrapolateOption = Annotated[
    Optional[str],
    typer.Option(
        help="After training at L, also evaluate the model at these factors of L, never trained there (2,4,8: the ALiBi paper's test). Default: the preset's (positions: 2,4,8)."
    ),
]
KeepModelsOption = Annotated[
    bool,
    typer.Option(
        "--keep-models/--no-keep-models",
        help="Keep each trained model in RUN_DIR/models (about 0.5 MB each at the quick size), for bench viz --run.",
    ),
]
