"""Quality: the task generators, the training loop, and the `bench quality` command (rows, resume, bad input)."""

from __future__ import annotations

import pytest
import torch
from helpers import bench

from harness.quality.tasks import CopyTask, RecallTask, make_task
from harness.quality.train import lr_factor, train_one
from harness.quality.model import TinyDecoder, trainable_variants
from harness.quality.config import TrainConfig


def test_copy_task_layout():
    task = CopyTask(length=5, vocab=7)
    inputs, targets, mask = task.batch(3, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == mask.shape == (3, 10) and task.seq_len == 10
    assert (inputs[:, 5] == 7).all()  # the separator
    assert torch.equal(targets[:, 5:], inputs[:, :5])  # after the separator, the string again
    assert mask[:, 5:].all() and not mask[:, :5].any()  # only the reproduced part is scored
    assert int(inputs.max()) <= 7 and task.vocab_size == 8


def test_recall_task_layout():
    task = RecallTask(length=32, vocab=20)
    inputs, targets, mask = task.batch(50, torch.Generator().manual_seed(0))
    p = task.num_pairs
    assert p == 4 and task.num_queries == 12 and inputs.shape == (50, 31)
    seq = torch.cat([inputs, targets[:, -1:]], dim=1)
    keys, values = seq[:, 0 : 2 * p : 2], seq[:, 1 : 2 * p : 2]
    assert (keys < 10).all() and (values >= 10).all()  # keys and values from disjoint halves
    for row in keys:
        assert len(set(row.tolist())) == p  # no key repeated in an example
    assert mask.sum(1).eq(task.num_queries).all()
    for b in range(50):
        bound = dict(zip(keys[b].tolist(), values[b].tolist()))
        for t in mask[b].nonzero().flatten().tolist():
            assert (
                targets[b, t].item() == bound[inputs[b, t].item()]
            )  # the answer is the value bound to the queried key


def test_tasks_are_deterministic_and_validated():
    for name in ("copy", "recall"):
        task = make_task(name, 16)
        a = task.batch(4, torch.Generator().manual_seed(3))
        b = task.batch(4, torch.Generator().manual_seed(3))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="pairs need a length of at least"):
        RecallTask(length=8, pairs=4)
    with pytest.raises(ValueError, match="unknown task 'sort'"):
        make_task("sort", 8)


def test_lr_schedule_warms_up_then_decays():
    factors = [lr_factor(s, 100, 0.1) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[50] < 1.0 and factors[-1] < 0.01
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))


@pytest.mark.parametrize("variant", ["full", "sliding_window", "linear", "memory_compressed"])
def test_training_lowers_the_loss(variant):
    cfg = TrainConfig(d_model=32, layers=1, heads=2, steps=60, batch=16, lr=3e-3, eval_every=30, eval_examples=32)
    rows = train_one("copy", 8, variant, {"window": 4} if variant == "sliding_window" else {}, cfg)
    assert [r["step"] for r in rows] == [30, 60] and rows[-1]["final"]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] < 3.0
    assert 0.0 <= rows[-1]["eval_accuracy"] <= 1.0


def test_rows_record_every_option_and_the_sequence_length_and_readers_use_them():
    """A row holds the options as given and every option trained with (defaults filled in), and the
    tokens its model read; a windowed variant trained at its default window still gets its reach."""
    import variants
    from harness.readers.quality.frames import by_distance_frame, trained_options

    cfg = TrainConfig(d_model=16, layers=1, heads=2, steps=2, batch=4, eval_every=2, eval_examples=8)
    row = train_one("recall", 16, "sliding_window", {}, cfg)[-1]
    default = variants.effective_options("sliding_window")["window"]
    assert row["options"] == {} and row["resolved_options"]["window"] == default
    assert "num_heads" not in row["resolved_options"] and "head_dim" not in row["resolved_options"]
    assert (
        row["seq_len"] == make_task("recall", 16).seq_len and train_one("copy", 4, "full", {}, cfg)[-1]["seq_len"] == 8
    )
    assert trained_options(row)["window"] == default
    assert (
        trained_options({k: v for k, v in row.items() if k != "resolved_options"}) == {}
    )  # a row from before issue 22
    facts = {"sliding_window": variants.variant_class("sliding_window").spec.facts()}
    assert set(by_distance_frame([row], facts)["window"]) == {default}


def test_decoder_is_causal():
    torch.manual_seed(0)
    model = TinyDecoder(10, TrainConfig(d_model=16, layers=2, heads=2), "full", max_len=20).eval()
    x = torch.randint(0, 10, (2, 20))
    x2 = x.clone()
    x2[:, 12:] = (x2[:, 12:] + 1) % 10
    with torch.no_grad():
        assert torch.equal(model(x)[:, :12], model(x2)[:, :12])


def test_short_conv_mixes_only_earlier_positions_and_is_in_every_variants_model():
    torch.manual_seed(0)
    cfg = TrainConfig(d_model=16, layers=2, heads=2, short_conv=4)
    for variant in ("full", "linear"):
        model = TinyDecoder(10, cfg, variant, max_len=20).eval()
        assert len(model.convs) == 2 and model.convs[0].conv.kernel_size == (4,)
        x = torch.randint(0, 10, (2, 20))
        x2 = x.clone()
        x2[:, 12:] = (x2[:, 12:] + 1) % 10
        with torch.no_grad():
            assert torch.equal(model(x)[:, :12], model(x2)[:, :12])  # causal
            h = torch.randn(1, 20, 16)
            bumped = h.clone()
            bumped[:, 5] += 1
            changed = (model.convs[0](bumped) - model.convs[0](h)).abs().sum(-1)[0]
            assert (
                changed[5:9].gt(0).all() and changed[:5].eq(0).all() and changed[9:].eq(0).all()
            )  # positions 5..5+K-1
    assert TinyDecoder(10, TrainConfig(d_model=16, heads=2), "full", max_len=20).convs is None  # the default: none


def test_the_output_gate_is_in_every_variants_model_and_recorded():
    from harness.quality.model import ZoologyLM, training_memory_estimate

    cfg = TrainConfig(d_model=16, layers=2, heads=2, output_gate=True)
    for variant in ("full", "kda"):
        blocks = TinyDecoder(10, cfg, variant, max_len=20).blocks
        assert all(b.attn.gate_proj is not None for b in blocks)
    zoology = ZoologyLM(10, TrainConfig(d_model=16, layers=2, heads=2, arch="zoology", output_gate=True), "full")
    assert zoology.mixers[1].gate_proj is not None
    plain = TinyDecoder(10, TrainConfig(d_model=16, layers=2, heads=2), "full", max_len=20)
    assert plain.blocks[0].attn.gate_proj is None  # the default: none
    sizes = [training_memory_estimate(c, 20, 10, "full", {})["parameters"] for c in (TrainConfig(d_model=16), cfg)]
    assert sizes[1] - sizes[0] == 2 * (16 * 16 + 16) * 4 * 4  # the gates' weights, their gradients and two moments


def test_trainable_variants_on_cpu():
    names = trainable_variants("cpu")
    assert {"full", "sliding_window", "linear", "memory_compressed"} <= set(names)
    assert "sliding_window_flex" not in names and "full_xformers" not in names
    assert "full_naive" not in names  # the same function as full: its row would repeat full's


# -- the bench quality command ------------------------------------------------------------------


def _quality(*args):
    return bench("quality", *args, "--no-cost")  # cost: test_quality_long


def test_quality_cli_writes_rows_and_report(tmp_path):
    import pandas as pd

    out = tmp_path / "q"
    result = _quality(
        "--variants",
        "full,linear",
        "--lengths",
        "8",
        "--steps",
        "20",
        "--d-model",
        "32",
        "--short-conv",
        "0",  # (the state below is the attention's alone)
        "--output-gate",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    rows = pd.read_json(out / "quality.jsonl", lines=True)
    assert sorted(zip(rows["task"], rows["variant"])) == [
        ("copy", "full"),
        ("copy", "linear"),
        ("recall", "full"),
        ("recall", "linear"),
    ]
    assert rows["final"].all() and (rows["step"] == 20).all()
    for col in (
        "train_loss",
        "eval_accuracy",
        "eval_exact_match",
        "wall_s",
        "parameters",
        "cfg_lr",
        "cfg_short_conv",
        "options",
    ):
        assert rows[col].notna().all(), col
    assert "held-out token accuracy" in result.output and rows["cfg_output_gate"].all()
    from typer.testing import CliRunner

    from harness.cli import app

    report = CliRunner().invoke(app, ["report", str(out)])
    assert report.exit_code == 0, report.output
    text = (out / "REPORT.md").read_text()
    assert "## Quality: copy and associative recall" in text and "| `full` |" in text and "output gate" in text
    assert (out / "figures" / "quality_accuracy.png").exists() and (out / "figures" / "quality_curves.png").exists()
    # recall against state size: full's KV cache of the recall sequence (2 layers x k, v x 4 heads x 8 dims x 4 bytes a
    # position) against linear's constant recurrent state
    recall = rows[rows["task"] == "recall"].set_index("variant")
    assert (
        recall.loc["full", "state_kind"] == "kv"
        and recall.loc["full", "state_bytes"] == 2 * 2 * 4 * 8 * 4 * recall.loc["full", "seq_len"]
    )
    assert recall.loc["linear", "state_kind"] == "recurrent"
    assert "### Recall against state size" in text and (out / "figures" / "recall_state.png").exists()


def test_decoding_state_is_each_layers_prefilled_state():
    """decoding_state sums every layer's own prefilled state: a window's is bounded, a recurrence's constant,
    a KV cache's linear in the sequence; an attention that cannot decode has none."""
    from harness.quality.model import decoding_state

    cfg = TrainConfig(d_model=16, layers=3, heads=2)
    per_position = 3 * 2 * 2 * 8 * 4  # layers x (k, v) x heads x head dim x float32
    for name, options, sizes in [
        ("full", {}, (10 * per_position, 40 * per_position)),
        ("sliding_window", {"window": 4}, (4 * per_position, 4 * per_position)),
    ]:
        model = TinyDecoder(8, cfg, name, max_len=64, **options)
        assert tuple(decoding_state(model, n, cfg)["state_bytes"] for n in (10, 40)) == sizes, name
    linear = TinyDecoder(8, cfg, "linear", max_len=64)
    assert (
        decoding_state(linear, 10, cfg) == decoding_state(linear, 40, cfg)
        and decoding_state(linear, 10, cfg)["state_kind"] == "recurrent"
    )
    # mla holds a FullAttention for its softmax: only the layer's own latent counts (latent_dim Hkv·D/2 a position)
    mla = decoding_state(TinyDecoder(8, cfg, "mla", max_len=64), 10, cfg)
    assert mla == {"state_bytes": 10 * per_position // 4, "state_kind": "latent"}
    assert decoding_state(TinyDecoder(8, cfg, "nystrom", max_len=64, landmarks=4), 10, cfg) == {
        "state_bytes": None,
        "state_kind": None,
    }
    conv = TrainConfig(d_model=16, layers=3, heads=2, short_conv=4)  # + the last 3 inputs of each layer's convolution
    assert (
        decoding_state(TinyDecoder(8, conv, "full", max_len=64), 10, conv)["state_bytes"]
        == 10 * per_position + 3 * 3 * 16 * 4
    )


def test_quality_resume_redoes_only_unfinished_trainings(tmp_path):
    import json

    import pandas as pd

    out = tmp_path / "q"
    assert (
        _quality(
            "--variants", "full", "--lengths", "8", "--steps", "10", "--d-model", "32", "--out", str(out)
        ).exit_code
        == 0
    )
    lines = (out / "quality.jsonl").read_text().splitlines()
    assert len(lines) == 2  # copy and recall
    unfinished = json.loads(lines[1])
    unfinished.update(final=False, step=5)  # as if recall had been interrupted after an evaluation
    (out / "quality.jsonl").write_text(lines[0] + "\n" + json.dumps(unfinished) + "\n" + '{"torn')
    result = _quality("--resume", str(out))
    assert result.exit_code == 0, result.output
    rows = pd.read_json(out / "quality.jsonl", lines=True)
    assert sorted(rows["task"]) == ["copy", "recall"] and rows["final"].all()  # no duplicate, no leftover partial row


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "2", "--task", "recall"], "pairs need a length of at least"),
        (["--variants", "sliding_window_flex"], "cannot be trained on cpu: sliding_window_flex has no backward on cpu"),
        (["--d-model", "30"], "--d-model 30 must be divisible by --heads 4"),
        (["--variants", "nope"], "unknown variant(s) nope"),
        (["--short-conv", "-1"], "--short-conv"),
        # sizes the memory budget cannot hold are refused before anything is written (they crashed in the allocator,
        # after metadata.json, whose --resume crashed again)
        (["--vocab", "100000000", "--task", "recall"], "tokens, vocab 100000000) with --d-model 64"),
        (["--d-model", "100000000", "--heads", "1"], "more than the memory budget"),
        (["--batch", "100000000"], "--batch 100000000: training"),
        (["--layers", "100000"], "--layers 100000"),
        (["--lengths", "100000", "--task", "recall"], "recall at L=100000"),
        (["--seeds", "100000000000000000000"], "--seeds 100000000000000000000 is not allowed; it must lie in 1..1000"),
        (
            ["--copy-lengths", "8", "--task", "recall"],
            "--copy-lengths 8: the copy task's lengths, but the run trains recall only",
        ),
        (["--pairs", "4", "--task", "copy"], "--pairs 4: an option of recall and mqar, but the run trains copy only"),
    ],
)
def test_quality_bad_arguments(tmp_path, args, message):
    result = _quality(*args, "--out", str(tmp_path / "x"))
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())
    assert not (tmp_path / "x").exists()


def _text(result) -> str:
    """The command's output as one line, rich's box drawing removed (messages wrap inside it)."""
    return " ".join(result.output.replace("│", " ").split())


def test_quality_scores_a_users_variant_with_its_options(tmp_path):
    import json

    out = tmp_path / "mine"
    args = [
        "--import",
        "user_variant",
        "--variants",
        "test_tempered,full",
        "--option",
        "temperature=2",
        "--task",
        "copy",
        "--lengths",
        "8",
        "--steps",
        "2",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--no-report",
    ]
    result = _quality(*args, "--out", str(out))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "quality.jsonl").read_text().splitlines()]
    assert {r["variant"]: r["options"] for r in rows} == {"test_tempered": {"temperature": 2}, "full": {}}
    resumed = _quality("--resume", str(out))  # resuming runs the module's code again: it must be named
    assert resumed.exit_code == 2 and "name it again to allow it: --import user_variant" in _text(resumed)
    bad = _quality(*[a if a != "temperature=2" else "temperature=0" for a in args], "--out", str(tmp_path / "bad"))
    assert bad.exit_code == 2 and "temperature=0 is invalid" in _text(bad)
    unused = _quality(*args, "--option", "chunk_size=8", "--out", str(tmp_path / "unused"))
    assert unused.exit_code == 2 and "chunk_size=8 is taken by none of the selected variants" in _text(unused)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "unused").exists()


@pytest.mark.parametrize("preset", ["quick", "long"])
def test_each_presets_options_make_every_variant_differ_from_exact_attention_at_its_longest_length(preset):
    """A variant that is exact softmax attention at every length a preset trains (a window as wide as the
    sequence, MoBA's 256-key blocks at L = 64) would only repeat full's row under another name."""
    import variants as registry
    from harness.options import parse_lengths
    from harness.quality.config import TOKENS_PER_L
    from harness.quality.presets import PRESETS

    defaults = PRESETS[preset]
    longest = max(parse_lengths(defaults["lengths"]["cpu"]))  # every variant trains it
    for name in trainable_variants("cpu"):
        # the run's options: the preset's, and the variant's own at the preset's reach (`training_options`)
        own = registry.variant_class(name).training_options(defaults["options"]["window"], 16)
        options = {**defaults["options"], **{f"{name}.{key}": value for key, value in own.items()}}
        attn = registry.build(name, num_heads=4, head_dim=16, **registry.options_taken(name, options))
        exact = attn.softmax_equivalent_length()
        assert exact is None or exact < longest * TOKENS_PER_L["recall"], (preset, name, exact)
