"""What a trained model attends to (`bench quality --keep-models`, `bench viz --run`): the kept model is the trained
one, the maps are the weights the model applies (weights @ v is the attention's output), the per-head summary and
the rank correlation follow their definitions, and bad input is refused before anything is drawn."""

from __future__ import annotations

import importlib.util

import pytest
import scipy.stats
import torch
from helpers import bench

import variants
from harness.quality.config import TrainConfig
from harness.quality.inspect import attention_maps, head_summary, load_model, rank_correlation
from harness.quality.tasks import make_task
from harness.quality.train import evaluate, precision, train_one
from variants.modules import head_inputs


@pytest.mark.parametrize("variant, positions", [("full", "alibi"), ("linear", "rope"), ("sliding_window", "relative")])
def test_the_weights_drawn_are_the_ones_applied(variant, positions):
    torch.manual_seed(0)
    options = {"window": 3} if variant == "sliding_window" else {}
    mha = variants.MultiHeadAttention(16, 2, variant=variant, positions=positions, **options).double()
    if positions == "relative":
        torch.nn.init.normal_(mha.positions.table)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    weights = mha.attention_weights(x, causal=True)
    projections = tuple((p.weight, p.bias) for p in (mha.q_proj, mha.k_proj, mha.v_proj))
    q, k, v, extra = head_inputs(x, x, x, projections, 2, True, mha.positions)
    assert torch.allclose(weights @ v, mha.attention(q, k, v, causal=True, **extra), atol=1e-10)
    assert weights.triu(1).abs().max() == 0  # causal


def test_a_kept_model_is_the_trained_model(tmp_path):
    cfg = TrainConfig(d_model=16, heads=2, layers=1, steps=4, eval_every=4, short_conv=2)
    path = tmp_path / "m.pt"
    final = train_one("recall", 32, "mamba2", {}, cfg, save_to=path)[-1]
    model, facts = load_model(path)
    assert facts["variant"] == "mamba2" and facts["cfg"] == cfg and facts["length"] == 32
    task = make_task("recall", 32)
    scores = evaluate(model, task, 0, facts["cfg"], torch.device("cpu"), precision(torch.device("cpu"), "float32"))
    assert scores["eval_accuracy"] == final["eval_accuracy"]
    maps = attention_maps(model, task.sample(1, torch.Generator().manual_seed(0)).inputs[0])
    assert len(maps) == 1 and maps[0].shape == (2, 31, 31)


def test_head_summary_and_rank_correlation_follow_their_definitions():
    n = 12
    local = torch.eye(n)[None]  # every query on itself: distance 0, entropy 0
    uniform = torch.ones(n, n).tril()
    uniform = (uniform / uniform.sum(-1, keepdim=True))[None]
    (a,), (b,) = head_summary(local), head_summary(uniform)
    assert a["kind"] == "local" and a["distance"] == 0 and a["entropy"] == pytest.approx(0)
    assert b["distance"] == pytest.approx(sum(i / 2 for i in range(n)) / n)
    assert b["entropy"] == pytest.approx(sum(torch.log(torch.tensor(i + 1.0)).item() for i in range(n)) / n)
    x, y = torch.randn(40), torch.randn(40)
    y[:5] = y[5]  # ties
    assert rank_correlation(x, y) == pytest.approx(scipy.stats.spearmanr(x, y).statistic)


def test_viz_run_draws_every_kept_model_and_refuses_what_it_cannot_draw(tmp_path, monkeypatch):
    out = tmp_path / "q"
    args = ["--variants", "full,linear", "--task", "recall", "--steps", "3", "--d-model", "16", "--heads", "2"]
    assert bench("quality", *args, "--no-cost", "--no-report", "--out", out).exit_code == 0
    assert bench("viz", "--run", out).exit_code != 0  # no models kept
    assert "--keep-models" in bench("viz", "--run", out).output
    kept = tmp_path / "k"
    assert bench("quality", *args, "--no-cost", "--no-report", "--keep-models", "--out", kept).exit_code == 0
    result = bench(
        "viz", "--run", kept, "--heads", "1", *(["--attribute"] if importlib.util.find_spec("captum") else [])
    )
    assert result.exit_code == 0, result.output
    assert {p.name for p in (kept / "figures").glob("trained_attention_*")} >= {
        "trained_attention_recall_full.png",
        "trained_attention_recall_linear.png",
        "trained_attention_recall.md",
    }
    assert "| `linear` | 1 | 1 |" in (kept / "figures" / "trained_attention_recall.md").read_text()
    assert "the model has 2 heads" in " ".join(bench("viz", "--run", kept, "--heads", "5").output.split())
    assert "give --run" in bench("viz", "--attribute").output
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "captum" else object())
    assert "pip install 'captum" in bench("viz", "--run", kept, "--attribute").output
