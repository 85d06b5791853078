"""bench lm --kv-policy: the KV sweep on a tiny random Llama (rows, one prefill a prompt, the full cache's answer
as the model's own generation, resume, bad input refused before anything is written) and its readers (intervals,
the pairing against the full cache, the report's section and frontier figure)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers")

import variants.hf.kvcache as hk  # noqa: E402
from helpers import bench, save_tiny_gpt2, save_tiny_llama  # noqa: E402

from harness.lm.config import LMConfig, RESULTS, cells, row_key  # noqa: E402
from harness.lm.model import load  # noqa: E402
from harness.lm.tasks import passkey_prompt  # noqa: E402
from harness.readers.lm import kv as lm_kv  # noqa: E402

SWEEP = ["--kv-policy", "knorm,snapkv", "--ratios", "0.5", "--lengths", "384", "--depths", "50", "--keys", "2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def swept(tiny, tmp_path_factory):
    """A finished sweep (passkey and continuation, two policies at 0.5, both modes), and its prefill count."""
    out = tmp_path_factory.mktemp("kv") / "run"
    calls = []
    original = hk.prefill
    hk.prefill = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        result = bench("lm", "--model", str(tiny), *SWEEP, "--tasks", "passkey,perplexity", "--out", str(out))
    finally:
        hk.prefill = original
    assert result.exit_code == 0, result.output
    return out, len(calls)


def _rows(out):
    return [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]


def test_every_branch_of_every_prompt_is_a_row_from_one_prefill(swept):
    out, prefills = swept
    rows = _rows(out)
    config = LMConfig.from_json(json.loads((out / "metadata.json").read_text())["config"])
    assert [row_key(r) for r in rows] == cells(config)
    # passkey: 2 prompts x (full + 2 policies x 2 modes); continuation: 2 windows x (full + 2 policies, agnostic)
    assert len(rows) == 2 * 5 + 2 * 3
    assert prefills == 1 + 4, "one check on 8 tokens, then one prefill a prompt"
    full = {r["key_index"]: r for r in rows if r["task"] == "kv:passkey" and r["policy"] == "none"}
    for r in rows:
        if r["policy"] != "none" and r["task"] == "kv:passkey":
            kept = int(r["prompt_tokens"] * 0.5) if r["mode"] == "aware" else None
            assert r["state_bytes"] < full[r["key_index"]]["state_bytes"]
            if kept:  # the aware cache: every layer and K/V head keeps half the prompt
                assert r["state_bytes"] == full[r["key_index"]]["state_bytes"] * kept // r["prompt_tokens"]
    report = (out / "REPORT.md").read_text()
    assert "## KV-cache policies" in report and "`snapkv` agnostic" in report
    assert (out / "figures" / "kv_frontier.png").is_file()


def test_the_full_cache_answers_as_the_models_own_generation(tiny, swept):
    out, _ = swept
    model, tokenizer = load(tiny, None)
    config = LMConfig.from_json(json.loads((out / "metadata.json").read_text())["config"])
    for r in (r for r in _rows(out) if r["task"] == "kv:passkey" and r["policy"] == "none"):
        prompt = passkey_prompt(tokenizer, config.prompt_length("passkey", 384), 50, r["key"])
        with torch.no_grad():
            own = model.generate(prompt[None], max_new_tokens=r["steps"] + 1, do_sample=False, pad_token_id=256)
        assert tokenizer.decode(own[0, prompt.numel() :], skip_special_tokens=True) == r["answer"]


def test_a_killed_sweep_resumes_without_measuring_again(tiny, tmp_path):
    out = tmp_path / "run"
    args = ["lm", "--model", str(tiny), *SWEEP, "--tasks", "passkey", "--no-report", "--out", str(out)]
    assert bench(*args).exit_code == 0
    lines = (out / RESULTS).read_text().splitlines()
    (out / RESULTS).write_text("\n".join(lines[:7]) + "\n")  # the first prompt's 5 rows and 2 of the second's
    calls = []
    original = hk.prefill
    hk.prefill = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        assert bench("lm", "--resume", str(out), "--no-report").exit_code == 0
    finally:
        hk.prefill = original
    again = _rows(out)
    assert [json.loads(line) for line in lines[:7]] == again[:7] and len(again) == 10
    assert len(calls) == 1, "only the unfinished prompt is prefilled again"


def test_bad_input_is_refused_before_anything_is_written(tiny, tmp_path):
    gpt2 = save_tiny_gpt2(tmp_path / "gpt2")
    cases = [
        (["--model", str(tiny), "--kv-policy", "knorm", "--ratios", "1.5"], "--ratios=1.5: a compression ratio"),
        (["--model", str(tiny), "--kv-policy", "knorm", "--ratios", "0"], "strictly between 0 and 1"),
        (["--model", str(tiny), "--kv-policy", "knorm", "--ratios", "half"], "--ratios 'half': not a comma-separated"),
        (["--model", str(tiny), "--kv-policy", "snap"], "--kv-policy snap: unknown; choose from"),
        (["--model", str(tiny), "--kv-policy", "knorm", "--kv-modes", "sideways"], "--kv-modes sideways"),
        (["--model", str(tiny), "--kv-policy", "knorm", "--tasks", "cost"], "the KV sweep measures --tasks"),
        (["--model", str(gpt2), "--kv-policy", "expected_attention"], "has no rotary embedding"),
        (
            ["--model", str(tiny), "--kv-policy", "snapkv", "--tasks", "perplexity"],
            "--lengths 320: --tasks perplexity compresses a prompt of 64 tokens there; --kv-policy snapkv needs at least 65",
        ),
    ]
    for args, message in cases:
        out = tmp_path / "x"
        result = bench("lm", *args, "--lengths", "320", "--out", str(out))
        assert result.exit_code != 0 and message in result.output, (args, result.output)
        assert not out.exists(), args


def test_the_readers_pair_each_window_with_the_full_caches():
    rows = [
        {"task": "kv:continuation", "setting": s, "policy": p, "ratio": r, "mode": m, "length": 64, "window": w}
        | {"nll": nll, "scored": 256, "state_bytes": b}
        for w, base in enumerate([2.0, 3.0, 4.0])
        for s, p, r, m, nll, b in [
            ("full cache", "none", 0.0, "-", base, 100),
            ("knorm 0.5 agnostic", "knorm", 0.5, "agnostic", base + 0.1, 50),
        ]
    ]
    rows += [
        {"task": "kv:passkey", "setting": "knorm 0.5 aware", "policy": "knorm", "ratio": 0.5, "mode": "aware"}
        | {"length": 64, "key_index": i, "correct": i < 7, "state_bytes": 50, "token_s": 0.01}
        for i in range(10)
    ]
    ppl = lm_kv.kv_perplexity_table(pd.DataFrame(rows)).set_index("setting")
    assert ppl.loc["knorm 0.5 agnostic", "vs_full"] == pytest.approx(torch.tensor(0.1).exp().item())
    assert ppl.loc["knorm 0.5 agnostic", "vs_low"] == pytest.approx(ppl.loc["knorm 0.5 agnostic", "vs_high"])
    assert ppl.loc["full cache", "low"] < ppl.loc["full cache", "ppl"] < ppl.loc["full cache", "high"]
    acc = lm_kv.kv_accuracy_table(pd.DataFrame(rows)).iloc[0]
    assert acc["accuracy"] == 0.7 and acc["trials"] == 10 and 0.39 < acc["low"] < 0.4 and 0.89 < acc["high"] < 0.9


def test_another_runs_points_say_whether_they_are_the_sweeps_prompts():
    keys = [(50, i, f"{i}{i}{i}") for i in range(3)]
    sweep = pd.DataFrame(
        {"task": "kv:passkey", "length": 64, "policy": "none", "depth": d, "key_index": i, "key": k} for d, i, k in keys
    )
    prompts = lm_kv.sweep_prompts(sweep, 64)
    other = pd.DataFrame(
        {"task": "passkey", "length": 64, "setting": s, "variant": s.split(" ")[0], "state_bytes": 10}
        | {"depth": d, "key_index": i, "key": k if s != "mla" else "999", "correct": i == 0}
        for s in ["sdpa", "window_linear", "mla"]
        for d, i, k in keys
    )
    points = {p["setting"]: p for p in lm_kv.other_points(other, 64, "run", prompts)}
    assert set(points) == {"window_linear", "mla"}, "the model's own sdpa is the sweep's full cache"
    assert points["window_linear"]["shared"] and "(run: the same prompts)" in points["window_linear"]["label"]
    assert not points["mla"]["shared"] and "(run: its own prompts, 3 trials)" in points["mla"]["label"]
    assert points["window_linear"]["value"] == pytest.approx(1 / 3)
