"""bench plot / report / compare / viz on small synthetic run directories (no measuring)."""

from __future__ import annotations

import hashlib
import math
import json
from pathlib import Path

import pytest
import torch

import variants
from harness.readers.speed.summary import crossover, fit_exponent, summarize
from helpers import NS, bench, make_run

ROOT = Path(__file__).resolve().parent.parent


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fit_exponent_and_crossover():
    assert fit_exponent(NS, [n**2 for n in NS]) == pytest.approx(2.0)
    assert fit_exponent(NS, [3 * n for n in NS]) == pytest.approx(1.0)
    assert fit_exponent([256], [1.0]) is None
    import pandas as pd

    base = pd.DataFrame({"n": NS, "time_median_s": [1e-9 * n * n for n in NS]})
    fast = pd.DataFrame({"n": NS, "time_median_s": [1e-6 * n for n in NS]})
    assert crossover(fast, base) == (1024, "")  # 1e-6 n < 1e-9 n^2  <=>  n > 1000
    assert crossover(base, fast)[1] == "never faster"


@pytest.mark.parametrize("fmt", ["png", "svg", "pdf"])
def test_plot_writes_figures_deterministically(tmp_path, fmt):
    run = make_run(tmp_path / "run")
    first = bench("plot", str(run), "--format", fmt, "--out", str(tmp_path / "a"), columns=80)
    second = bench("plot", str(run), "--format", fmt, "--out", str(tmp_path / "b"), columns=80)
    assert first.exit_code == 0 and second.exit_code == 0, first.output
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(f"{k}.{fmt}" for k in ("time", "memory", "speedup", "efficiency"))
    for name in names:
        assert digest(tmp_path / "a" / name) == digest(tmp_path / "b" / name), f"{name} differs between two runs"


def test_plot_works_on_partial_runs(tmp_path):
    run = make_run(tmp_path / "partial", partial=True)
    result = bench("plot", str(run), columns=80)
    assert result.exit_code == 0, result.output
    assert (run / "figures" / "time.png").stat().st_size > 1000


def test_plot_rejects_non_run_dirs(tmp_path):
    result = bench("plot", str(tmp_path), columns=300)  # one line, whatever the path's length
    assert result.exit_code == 2
    assert "is not a run directory" in result.output


def test_report_has_tables_exponents_and_reasons(tmp_path):
    run = make_run(tmp_path / "run")
    result = bench("report", str(run), columns=80)
    assert result.exit_code == 0, result.output
    text = (run / "REPORT.md").read_text()
    assert "Command: ` bench run --test `" in text
    assert "![time](figures/time.png)" in text and "![memory](figures/memory.png)" in text
    assert "| cpu | fwd | no | `full` | 4096 |" in text  # summary line of the baseline
    assert "| 2.00 |" in text and "| 1.00 |" in text  # fitted exponents of full and linear
    assert "`full_naive` cpu fwd, N = 2048: **oom** — killed" in text
    assert (
        "`sliding_window_flex` cpu fwdbwd, N = 256, 512, 1024, 2048, 4096: **skipped** — sliding_window_flex has no backward on cpu"
        in text
    )
    assert "| `linear` |" in text and "N=4096" in text


def test_summary_crossover_of_synthetic_run(tmp_path):
    from harness.readers.speed.frames import load_frame

    from harness.store.storage import baseline_of, variant_facts

    run = make_run(tmp_path / "run")
    summary = summarize(load_frame(run), baseline_of(variant_facts(run))).set_index(["pass", "variant"])
    assert summary.attrs["baseline"] == "full"  # (the run's recorded facts name it)
    assert summary.loc[("fwd", "linear"), "crossover_n"] == 2048  # 2e-6 n < 1e-9 n^2  <=>  n > 2000
    assert summary.loc[("fwd", "full_naive"), "stopped"].startswith("oom at N=2048")


def test_compare_ratios_and_exit_codes(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", slow_factor=1.2)  # full and linear 20% slower, full_naive and flex unchanged
    from harness.readers.speed.compare import compare_runs

    cells, per_variant, broken = compare_runs(a, b)
    assert broken.empty  # every cell ok in A is ok in B
    ratios = per_variant.set_index(["variant", "pass"])["time_geomean"]
    assert ratios[("full", "fwd")] == pytest.approx(1.2)
    assert ratios[("full_naive", "fwd")] == pytest.approx(1.0)
    assert len(cells) == 2 * 5 * 2 + 2 * 3 + 5  # full, linear: 10 each; naive: 6 ok; flex fwd: 5
    ok = bench("compare", str(a), str(b), "--fail-if-slower", "25%", columns=200)
    assert ok.exit_code == 0, ok.output
    bad = bench("compare", str(a), str(b), "--fail-if-slower", "10%", columns=200)
    assert bad.exit_code == 1
    assert "slower by more than 10%" in bad.output and "linear" in bad.output
    plain = bench("compare", str(a), str(b), columns=200)
    assert plain.exit_code == 0 and "1.200" in plain.output
    overall = 1.2 ** (20 / 31)  # full and linear (20 cells) 1.2x slower, the other 11 cells unchanged
    assert f"all 31 matched ok cells: time B/A geometric mean {overall:.3f} (cells 1.000 to 1.200)" in plain.output
    assert bench("compare", str(a), str(b), "--fail-if-slower", "fast", columns=80).exit_code == 2


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_viz_draws_every_variant(tmp_path, causal):
    out = tmp_path / "patterns.png"
    args = ["viz", "--n", "32", "--out", str(out)] + (["--causal"] if causal else [])
    result = bench(*args, columns=200)
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 1000
    assert "skipped full_xformers" in result.output


@pytest.mark.parametrize(
    "name, options",
    [
        ("full", {}),
        ("full_naive", {}),
        ("sliding_window", {"window": 3, "global_tokens": 2}),
        ("sliding_window_flex", {"window": 3, "global_tokens": 2}),
        ("linear", {}),
        ("memory_compressed", {"compression": 4}),
        ("linear", {"feature_map": "taylor"}),
        ("linear", {"feature_map": "cosformer"}),
        ("performer", {"features": 32}),
        ("bilinear", {}),
        ("additive", {}),
    ],
)
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_attention_matrix_is_what_the_variant_applies(name, options, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 24, 16) for _ in range(3))
    attn = variants.build(name, num_heads=1, head_dim=16, **options)
    w = attn.attention_matrix(q, k, causal=causal)
    assert w.shape == (1, 1, 24, 24)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 1, 24), atol=1e-4, rtol=0)  # rows are distributions
    if causal:
        assert (w[0, 0].triu(1) == 0).all(), "a query gives weight to a future position"
    if name != "memory_compressed":  # out = weights @ v (memory_compressed transforms v first)
        torch.testing.assert_close(w @ v, attn(q, k, v, causal=causal), atol=1e-5, rtol=1e-5)
    if name.startswith("sliding_window"):
        i, j = torch.arange(24)[:, None], torch.arange(24)[None]
        outside = ((i - j).abs() > 3) & (i >= 2) & (j >= 2)
        assert (w[0, 0][outside] == 0).all()


def test_viz_bad_arguments(tmp_path):
    assert bench("viz", "--n", "0", columns=80).exit_code == 2
    bad = bench("viz", "--out", str(tmp_path / "x.gif"), columns=200)
    assert bad.exit_code == 2 and "must end in .png, .svg or .pdf" in bad.output


@pytest.mark.parametrize("complete_config", [False, True], ids=["partial-config", "complete-config"])
def test_reading_a_run_imports_no_torch(tmp_path, complete_config):
    # report, plot, compare and advise read run directories only: formatting numbers must not pull in the engine
    import json
    import subprocess
    import sys

    run = make_run(tmp_path / "run")
    if complete_config:  # a sweep's whole configuration, as bench run stores it (before options were resolved)
        meta = json.loads((run / "metadata.json").read_text())
        meta["config"].update(
            variants=["full", "linear", "full_naive", "sliding_window_flex"],
            lengths=NS,
            devices=["cpu"],
            passes=["fwd", "fwdbwd"],
            causal=[False],
        )
        (run / "metadata.json").write_text(json.dumps(meta))
    code = f"""
import sys
from typer.testing import CliRunner
from harness.cli import app
for args in (["report", {str(run)!r}], ["compare", {str(run)!r}, {str(run)!r}], ["advise", "--len", "1024", "--no-causal", {str(run)!r}]):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
from harness.readers.speed.frames import load_frame
frame = load_frame({str(run)!r})
assert len(frame) == 40, len(frame)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("variants")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_lr_sweep_table_takes_each_variants_best_rate_and_refuses_runs_that_differ_otherwise(tmp_path):
    """scripts/lr_sweep.py: one probe at several learning rates, each variant's best marked; runs that differ in
    anything but the rate (here the pairs) are refused, naming the field, rather than put in one table."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "lr_sweep", Path(__file__).resolve().parent.parent / "scripts" / "lr_sweep.py"
    )
    lr_sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lr_sweep)

    def run(name, lr, accuracies, pairs=32):
        out = tmp_path / name
        out.mkdir()
        rows = [
            {
                "task": "recall",
                "variant": v,
                "length": 128,
                "seed": 0,
                "final": True,
                "options": {},
                "cfg_lr": lr,
                "cfg_pairs": pairs,
                "eval_accuracy": a,
                "state_bytes": 9728,
            }
            for v, a in accuracies.items()
        ]
        (out / "quality.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return out

    low, high = run("low", 1e-3, {"full": 0.99, "linear": 0.2}), run("high", 1e-2, {"full": 0.04, "linear": 0.79})
    rates, cells = lr_sweep.sweep([low, high])
    assert rates == [1e-3, 1e-2] and cells["full"][1e-3] == 0.99 and cells["linear"][1e-2] == 0.79
    text = lr_sweep.table(rates, cells)
    assert "| `full` | 9.5 KiB | **99.0%** | 4.0% | 99.0% (lr 0.001) |" in text, text
    assert "| `linear` | 9.5 KiB | 20.0% | **79.0%** | 79.0% (lr 0.01) |" in text, text
    with pytest.raises(ValueError, match="cfg_pairs"):
        lr_sweep.sweep([low, run("other", 1e-2, {"full": 0.5}, pairs=8)])


def _lm_run(path: Path, settings: dict[str, list[float]], seed: int = 0) -> Path:
    """A minimal lm run directory: perplexity rows of `settings` ({setting: NLL per window}) at L = 64."""
    import json

    path.mkdir()
    config = {"seed": seed, "windows": 2, "scored_from": 0.5, "scored_tokens": 0}
    machine = {"model": {"sha256": "m"}, "corpus": {"sha256": "t"}}
    (path / "metadata.json").write_text(json.dumps({"config": config, "machine": machine, "kind": "lm"}))
    rows = [
        {"task": "perplexity", "setting": s, "length": 64, "window": w, "start": 100 * w, "scored": 32, "nll": nll}
        for s, nlls in settings.items()
        for w, nll in enumerate(nlls)
    ]
    (path / "lm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_lm_paired_pairs_another_runs_sdpa_window_by_window_and_refuses_other_texts(tmp_path, capsys):
    # scripts/lm_paired.py: a conversion run made without sdpa against the run that measured it, on the same windows
    import importlib.util

    spec = importlib.util.spec_from_file_location("lm_paired", ROOT / "scripts" / "lm_paired.py")
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    base = _lm_run(tmp_path / "base", {"sdpa": [2.0, 3.0], "ablation": [9.0, 9.0]})
    run = _lm_run(tmp_path / "run", {"converted": [2.5, 3.5]})
    paired.main(str(base), str(run))
    out = capsys.readouterr().out
    assert "converted" in out and f"{math.exp(0.5):8.3f}" in out and "ablation" not in out
    with pytest.raises(SystemExit, match="config.seed differs"):
        paired.main(str(base), str(_lm_run(tmp_path / "seed1", {"converted": [2.5, 3.5]}, seed=1)))
