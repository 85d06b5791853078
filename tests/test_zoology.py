"""Zoology's MQAR in bench quality: the task as Zoology generates it, its model, the d_model and lr sweep axes
(rows of different recipes never pooled), the fixed training set and the early stop."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import bench

from harness.options import ArgumentError
from harness.quality.choices import QualityChoices
from harness.quality.config import QualityConfig, TrainConfig
from harness.quality.model import ZoologyLM, decoder, decoding_state
from harness.quality.plan import build_quality_config
from harness.quality.tasks import MQARTask, distinct_draws, make_task
from harness.quality.train import FixedSet, train_one
from harness.quality.trainings import run_key, training_keys
from harness.readers.quality.frames import chosen_recipe, width_frame


def test_mqar_is_zoologys_layout():
    task = MQARTask(64, vocab=512, pairs=4)
    s = task.sample(2000, torch.Generator().manual_seed(0))
    assert s.inputs.shape == (2000, 64) and task.seq_len == 64 and task.vocab_size == 512
    keys, values = s.inputs[:, 0:8:2], s.inputs[:, 1:8:2]
    assert keys.min() >= 1 and keys.max() < 256 and values.min() >= 256 and values.max() < 512
    assert (keys.sort(1).values[:, 1:] != keys.sort(1).values[:, :-1]).all()  # distinct keys in a sequence
    assert (values.sort(1).values[:, 1:] != values.sort(1).values[:, :-1]).all()
    assert (s.mask.sum(1) == 4).all() and not s.mask[:, :8].any()  # every key asked once, after the bindings
    rows, cols = s.mask.nonzero(as_tuple=True)
    assert (cols % 2 == 0).all()  # queries at even offsets of the query region
    asked = s.inputs[rows, cols]
    bound = (s.inputs[rows, :8:2] == asked[:, None]).float().argmax(1)  # which binding each query asks
    assert (s.targets[rows, cols] == s.inputs[rows, 2 * bound + 1]).all()  # its value is the target
    assert (s.distance[rows, cols] == cols - (2 * bound + 1)).all()  # the distance back to that value
    assert (s.inputs[:, 8:][~s.mask[:, 8:]] == 0).all()  # the rest of the query region is 0
    gaps = (cols - 8) // 2
    counts = torch.bincount(gaps, minlength=28)
    assert counts[0] > counts[5] > counts[27]  # the power law: most queries soon after the bindings


def test_mqar_refuses_what_zoology_does_not_generate():
    with pytest.raises(ValueError, match="4 x pairs"):
        MQARTask(60, pairs=16)
    with pytest.raises(ValueError, match="even length"):
        MQARTask(65, pairs=4)
    assert make_task("mqar", 128).num_pairs == 8  # Zoology's L / 16


def test_distinct_draws_are_distinct_and_uniform():
    d = distinct_draws(30_000, 3, 0, 8, torch.Generator().manual_seed(1))
    assert (d.sort(1).values[:, 1:] != d.sort(1).values[:, :-1]).all()
    counts = torch.bincount(d.flatten(), minlength=8).double()
    assert (counts / counts.mean() - 1).abs().max() < 0.05


def test_zoology_model_ties_its_head_and_scores_only_where_asked():
    cfg = TrainConfig(d_model=16, heads=1, layers=2, arch="zoology", short_conv=4)
    torch.manual_seed(0)
    model = decoder(64, cfg, "deltanet", max_len=33)
    assert isinstance(model, ZoologyLM) and model.head.weight is model.embed.weight
    assert not any(isinstance(m, torch.nn.TransformerEncoderLayer) for m in model.modules())
    tokens = torch.randint(0, 64, (3, 32))
    at = torch.rand(3, 32) < 0.2
    torch.testing.assert_close(model(tokens, at), model(tokens)[at])
    # the conv state: one GatedConv (width 3: 2 inputs) and one ShortConv (width 4: 3 inputs), float32
    state = decoding_state(model, 32, cfg)
    attention_only = decoding_state(model, 32, replace(cfg, short_conv=0))
    assert state["state_bytes"] - attention_only["state_bytes"] == 3 * 16 * 4


def test_the_sweep_axes_make_a_training_at_each_point_and_tables_never_pool_them():
    config = build_quality_config(
        QualityChoices(variants="full", preset="zoology", d_model="16,32", lr="1e-3,1e-2", lengths="32"), []
    )
    assert config.d_models == (16, 32) and config.lrs == (1e-3, 1e-2) and len(config.recipes()) == 4
    assert QualityConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    rows = [
        {
            "task": "mqar",
            "variant": "full",
            "length": 32,
            "final": True,
            "seed": 0,
            "eval_accuracy": acc,
            "cfg_d_model": d,
            "cfg_lr": lr,
            "cfg_arch": "zoology",  # (as every row records its recipe: its encoding, Zoology's none, follows)
            "state_bytes": 100 * d,
        }
        for d, lr, acc in [(16, 1e-3, 0.2), (16, 1e-2, 0.6), (32, 1e-3, 0.9), (32, 1e-2, 0.4)]
    ]
    kept = chosen_recipe(rows)
    assert [(r["cfg_d_model"], r["cfg_lr"]) for r in kept] == [(32, 1e-3)]  # the widest, at its best rate
    widths = width_frame(rows).set_index("d_model")
    assert widths.loc[16, "accuracy"] == 0.6 and widths.loc[16, "lr"] == 1e-2 and widths.loc[32, "lr"] == 1e-3
    assert {run_key(r) for r in rows} == {
        key for recipe in config.recipes() for key in training_keys(recipe, "mqar", "full", 0, (32,))
    }


@pytest.mark.parametrize(
    "args, message",
    [
        (["--d-model", "64,x"], "--d-model: '64,x' is not allowed"),
        (["--lr", "0"], "--lr: '0' is not allowed"),
        (["--d-model", "30", "--heads", "4"], "--d-model 30 must be divisible by --heads 4"),
        (["--layers", "3"], "--layers 3: Zoology's model alternates"),
        (["--early-stop", "1.5"], "--early-stop"),
        (["--lengths", "64", "--pairs", "17"], "4 x pairs"),
    ],
)
def test_zoology_preset_refuses_bad_values_before_writing(tmp_path, args, message):
    out = tmp_path / "run"
    result = bench("quality", "--preset", "zoology", "--variants", "full", *args, "--out", str(out))
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not out.exists()


def test_a_fixed_set_serves_epochs_and_an_early_stop_ends_the_training():
    task = make_task("mqar", 32, vocab=64)
    fixed = FixedSet(task, 10, seed=0)
    g = torch.Generator().manual_seed(0)
    first = torch.cat([fixed.batch(5, g)[0] for _ in range(2)])
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, fixed.data[0].tolist()))  # one epoch: each once
    cfg = TrainConfig(
        d_model=16,
        heads=1,
        steps=40,
        eval_every=10,
        arch="zoology",
        vocab=64,
        early_stop=0.0,
        train_examples=50,
        eval_examples=16,
    )
    rows = train_one("mqar", 32, "full", {}, cfg)
    assert len(rows) == 1 and rows[0]["final"] and rows[0]["step"] == 10  # reached 0%: stopped at the first eval


def test_a_zoology_run_resumes_to_the_same_rows(tmp_path):
    out = tmp_path / "zoo"
    args = [
        "--preset",
        "zoology",
        "--variants",
        "full",
        "--lengths",
        "32",
        "--d-model",
        "16,32",
        "--lr",
        "1e-3",
        "--steps",
        "6",
        "--train-examples",
        "40",
        "--no-cost",
        "--no-report",
        "--out",
        str(out),
    ]
    assert bench("quality", *args).exit_code == 0
    rows = [json.loads(line) for line in (out / "quality.jsonl").read_text().splitlines()]
    assert sorted(r["cfg_d_model"] for r in rows) == [16, 32]
    again = bench("quality", "--resume", str(out))
    assert again.exit_code == 0 and (out / "quality.jsonl").read_text().count("\n") == 2
    assert bench("report", str(out)).exit_code == 0  # Zoology's figure, its table and the comparison
    text = (out / "REPORT.md").read_text()
    assert (out / "figures" / "quality_width.png").exists() and "### Accuracy against model width" in text
    assert (
        "### Against Zoology's published configuration" in text and "| d_model | 64, 128, 256, 512 | 16, 32 |" in text
    )
    assert "The sweep is unfinished" not in text
    # a run stopped before its d_model 32 point (as a kill leaves it): the report names the point not trained
    kept = [line for line in (out / "quality.jsonl").read_text().splitlines() if '"cfg_d_model": 32' not in line]
    (out / "quality.jsonl").write_text("\n".join(kept) + "\n")
    assert bench("report", str(out)).exit_code == 0
    text = (out / "REPORT.md").read_text()
    assert "Not trained yet: d_model 32 at lr 0.001: `full`." in text
    # the report's first word on the sweep is true of it: unfinished, not "every training was made"
    assert "The sweep is unfinished: the tables below hold" in text and "Every training was made" not in text
    with pytest.raises(ArgumentError, match="divisible"):
        build_quality_config(QualityChoices(variants="full", preset="zoology", d_model="10", heads=4), [])


def test_the_width_table_names_each_method_and_refuses_other_tasks(tmp_path):
    """scripts/width_table.py: one row a method across runs (linear with the Taylor map is told apart from plain
    linear by its options), one column a width; runs of another task or length are refused."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("width_table", root / "scripts" / "width_table.py")
    width_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(width_table)
    common = ["--preset", "zoology", "--lengths", "32", "--lr", "1e-3", "--steps", "4", "--train-examples", "20"]
    common += ["--no-cost", "--no-report"]
    runs = [tmp_path / "menu", tmp_path / "based", tmp_path / "other"]
    assert bench("quality", *common, "--variants", "linear", "--d-model", "16,32", "--out", str(runs[0])).exit_code == 0
    taylor = ["--option", "feature_map=taylor", "--option", "feature_dim=4"]
    assert (
        bench("quality", *common, "--variants", "linear", *taylor, "--d-model", "16", "--out", str(runs[1])).exit_code
        == 0
    )
    text = width_table.table(runs[:2])
    assert "| method | d_model 16 | d_model 32 |" in text
    rows = [line for line in text.splitlines() if line.startswith("| `linear`")]
    assert len(rows) == 2 and rows[0].startswith("| `linear` |") and "not run" in rows[1]
    assert "feature_map=taylor" in rows[1] and "feature_dim=4" in rows[1]
    other = [a if a != "32" else "64" for a in common]
    assert bench("quality", *other, "--variants", "linear", "--d-model", "16", "--out", str(runs[2])).exit_code == 0
    with pytest.raises(SystemExit, match="one \\(task, L\\) a table"):
        width_table.table([runs[0], runs[2]])
    merged = width_table.table([runs[0], runs[0]])  # one width trained by two runs: one row, the better
    assert len([line for line in merged.splitlines() if line.startswith("| `linear` |")]) == 1
    longer = [a if a != "4" else "5" for a in common]
    assert (
        bench("quality", *longer, "--variants", "full", "--d-model", "16", "--out", str(tmp_path / "l")).exit_code == 0
    )
    with pytest.raises(SystemExit, match="in steps: one recipe a table"):
        width_table.table([runs[0], tmp_path / "l"])


def test_the_comparison_gives_a_reason_only_where_a_run_differs_from_zoology():
    from harness.readers.quality.report import _why

    assert _why({"batch": 512}, "batch", "too slow") == "" and _why({"batch": 128}, "batch", "too slow") == "too slow"
    assert _why({"lrs": [1e-4, 4.64e-4, 2.15e-3, 1e-2]}, "lrs", "r") == "" and _why({}, "heads", "r") == "r"


def test_a_half_trained_width_does_not_stand_for_the_variant():
    """A sweep stopped part-way through d_model 32 (one of its two rates trained) is read at d_model 16, where
    both rates finished; once 32 has both, it is read there, at its best rate."""
    from harness.readers.quality.frames import chosen_recipe, sweep_point

    def row(d, lr, acc):
        return {"task": "mqar", "variant": "full", "length": 32, "final": True, "cfg_d_model": d, "cfg_lr": lr,
                "eval_accuracy": acc}  # fmt: skip

    rows = [row(16, 1e-3, 0.2), row(16, 1e-2, 0.9), row(32, 1e-3, 0.1)]
    assert [sweep_point(r) for r in chosen_recipe(rows)] == [(16, 1e-2)]
    rows.append(row(32, 1e-2, 0.95))
    assert [sweep_point(r) for r in chosen_recipe(rows)] == [(32, 1e-2)]


def test_a_width_sweep_measures_each_widths_step_and_the_report_names_it(tmp_path):
    # a --d-model sweep measured the step once, at its first width, and the report printed it unlabelled beside
    # tables of the widest width: each width is measured, and the row and the table say which
    from harness.readers.quality.frames import cost_frame, step_key

    out = tmp_path / "zoo"
    args = ["--preset", "zoology", "--variants", "full,linear", "--lengths", "32", "--d-model", "16,32", "--lr", "1e-3"]
    args += ["--steps", "2", "--train-examples", "40", "--out", str(out)]
    assert bench("quality", *args).exit_code == 0
    costs = [json.loads(line) for line in (out / "train_cost.jsonl").read_text().splitlines()]
    assert sorted((r["variant"], r["cfg_d_model"]) for r in costs) == [
        ("full", 16), ("full", 32), ("linear", 16), ("linear", 32)
    ]  # fmt: skip
    text = (out / "REPORT.md").read_text()
    assert "| task | L | variant | d_model | tokens/seq |" in text
    assert "| mqar | 32 | `full` | 16 |" in text and "| mqar | 32 | `full` | 32 |" in text
    frame = cost_frame(out).to_dict("records")
    assert len({step_key(r) for r in frame}) == 2  # a step compares with another of the same width only
    again = bench("quality", "--resume", str(out))  # nothing measured twice
    assert again.exit_code == 0 and (out / "train_cost.jsonl").read_text().count("\n") == 4
