"""Position encodings in the quality models (`bench quality --positions`, `--extrapolate`): every (variant,
encoding) pair trains or is refused with its reason, the plan refuses bad values before anything is written, the
extrapolation evaluates the trained model at longer lengths, and the readers never pool encodings."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import bench

import variants

from harness.options import ArgumentError
from harness.quality.choices import QualityChoices
from harness.quality.config import QualityConfig, TrainConfig
from harness.quality.model import TinyDecoder, trainable_variants
from harness.quality.plan import build_quality_config
from harness.quality.train import train_one
from harness.quality.trainings import planned, run_key
from harness.readers.quality.frames import final_frame
from harness.readers.quality.positions import positions_section, positions_summary
from variants.positions import ENCODINGS, encoding_unsupported_reason


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_every_variant_trains_with_an_encoding_or_is_refused_with_the_reason(encoding):
    cfg = TrainConfig(d_model=16, heads=2, layers=1, positions=encoding)
    tokens = torch.randint(0, 10, (2, 12))
    menu = [n for n in trainable_variants("cpu") if variants.variant_class(n).__module__.startswith("variants.methods")]
    for name in menu:  # (the menu's own: not a test's variant another test module registered)
        options = {"window": 4} if name in ("sliding_window", "sliding_window_flex", "window_linear") else {}
        reason = encoding_unsupported_reason(name, encoding)
        if reason:
            with pytest.raises(ValueError, match="score bias|forms the query-key scores|mixed across positions"):
                TinyDecoder(10, cfg, name, max_len=24, **options)
            continue
        torch.manual_seed(0)
        model = TinyDecoder(10, cfg, name, max_len=24, **options)
        model(tokens).logsumexp(-1).sum().backward()
        own = [p for n, p in model.named_parameters() if "positions" in n or n.startswith("pos.")]
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in own), (name, encoding)
        assert (encoding in ("learned", "relative")) == bool(own), (name, encoding)


def test_the_plan_records_refused_pairs_and_refuses_bad_values_before_anything_is_written(tmp_path):
    config = build_quality_config(QualityChoices(preset="positions", variants="full,linear"), [])
    assert config.positions == tuple(ENCODINGS) and config.train.extrapolate == (2, 4, 8) and not config.measure_cost
    assert {(v, p) for v, p, _ in config.refused} == {("linear", "alibi"), ("linear", "relative")}
    assert len(planned(config)) == 2 * 3 * (6 + 4)  # tasks x seeds x the pairs carried
    assert QualityConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    for choices, message in [
        (dict(positions="alibi", variants="linear"), r"--positions alibi: linear never forms the query-key scores"),
        (dict(positions="sinusoidal,bogus"), r"--positions 'sinusoidal,bogus': choose all, or some of"),
        (dict(extrapolate="0"), r"--extrapolate '0': each factor must lie in 2..64"),
        (dict(extrapolate="2,x"), r"--extrapolate '2,x': give whole factors"),
        (dict(preset="zoology", positions="rope"), r"Zoology's model has no position encoding"),
    ]:
        with pytest.raises(ArgumentError, match=message):
            build_quality_config(QualityChoices(**choices), [])
    result = bench("quality", "--variants", "mamba2", "--positions", "relative", "--out", tmp_path / "q")
    assert result.exit_code != 0 and "mamba2 never forms the query-key scores" in result.output
    assert not (tmp_path / "q").exists()


def test_extrapolation_evaluates_the_trained_model_at_longer_lengths():
    cfg = TrainConfig(d_model=16, heads=2, layers=1, steps=3, eval_every=3, positions="learned", extrapolate=(2, 4))
    rows = train_one("recall", 32, "full", {}, cfg)
    final = rows[-1]
    assert [(e["factor"], e["length"], e["seq_len"]) for e in final["extrapolation"]] == [(2, 64, 63), (4, 128, 127)]
    assert all(0 <= e["eval_accuracy"] <= 1 for e in final["extrapolation"])
    assert final["cfg_positions"] == "learned" and final["final"]


def _row(variant, encoding, seed, accuracy, longer):
    return {
        "task": "copy",
        "variant": variant,
        "length": 32,
        "final": True,
        "seed": seed,
        "eval_accuracy": accuracy,
        "eval_exact_match": 0.0,
        "cfg_positions": encoding,
        "extrapolation": [{"factor": 2, "eval_accuracy": longer, "eval_exact_match": 0.0}],
    }


def test_encodings_are_read_apart_and_never_pooled(tmp_path):
    rows = [_row("full", "alibi", s, 1.0, 0.9 + 0.05 * s) for s in (0, 1)]
    rows += [_row("full", "learned", s, 0.98, 0.1) for s in (0, 1)] + [_row("full", "sinusoidal", 0, 0.96, 0.2)]
    summary = positions_summary(rows).set_index(["positions", "factor"])
    assert summary.loc[("alibi", 2), "accuracy"] == pytest.approx(0.925) and summary.loc[("alibi", 2), "seeds"] == 2
    cfg = {"preset": "positions", "refused": [["linear", "alibi", "linear never forms the query-key scores"]]}
    text = "\n".join(positions_section(tmp_path, cfg, rows, []))
    assert "| `full` | alibi | 100.0 (100-100) | 92.5 (90-95) |" in text
    assert "learned ahead in 1 of 1" in text and "- `linear` with alibi: linear never forms" in text
    assert len({run_key(r) for r in rows}) == 5
    with pytest.raises(ValueError, match=r"3 position encodings \(alibi, learned, sinusoidal\); they would be pooled"):
        final_frame(rows)
