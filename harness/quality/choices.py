"""What `bench quality`'s command line chose for a new run, typed (`QualityChoices`); plan.py checks it and makes the
run's `QualityConfig` from it. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.quality.config import QualityConfig, TrainConfig


@dataclass(frozen=True)
class QualityChoices:
    """What `bench quality`'s command line chose for a new run, typed; None: the preset's value (or the recipe's
    default). `build_quality_config` checks it and makes the run's QualityConfig from it, once."""

    tasks: tuple[str, ...] | None = None
    variants: str | None = None  # 'all' or names, comma-separated (None: the preset's)
    preset: str = QualityConfig.preset
    given: dict = field(default_factory=dict)  # the variant options given, over the preset's
    measure_cost: bool = QualityConfig.measure_cost
    device: str = QualityConfig.device  # or 'auto'
    dtype: str = QualityConfig.dtype
    lengths: str | None = None  # the command line's texts: "64,128"
    copy_lengths: str | None = None
    long_lengths: str | None = None
    long_variants: str | None = None
    seeds: int | None = None
    d_model: str | None = None  # an axis: "64" or "64,128"
    lr: str | None = None  # an axis: "1e-3" or "1e-3,3e-3"
    label_smoothing: float = TrainConfig.label_smoothing
    layers: int | None = None
    heads: int | None = None
    steps: int | None = None
    batch: int | None = None
    batch_tokens: int | None = None
    curriculum: bool | None = None
    pairs: int | None = None
    queries: int | None = None
    vocab: int | None = None
    warm_start: int | None = None
    short_conv: int | None = None
    output_gate: bool | None = None
    early_stop: float | None = None
    train_examples: int | None = None
    positions: str | None = None  # "all", or encodings comma-separated (several: an axis)
    extrapolate: str | None = None  # factors, comma-separated: "2,4,8"
    keep_models: bool = False
