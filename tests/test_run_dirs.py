"""Run directories and verdicts that cannot be lost or wrong: one writer, config-complete identity,
tolerant readers, --retry-failed, an honest compare gate, no silent code execution, noise flagged,
nothing written before it is validated, and the library traps."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import FAST, SLOW_RUN, bench, bench_process, run_dir_rows, wait_for_rows
from torch import nn

import variants
from harness.core import TIMING_CORE
from harness.store.storage import read_rows

TESTS = Path(__file__).resolve().parent


_TINY: dict[tuple, Path] = {}  # one measured tiny run per set of extra arguments; each test gets a copy


def tiny_run(path: Path, *extra: str) -> Path:
    """A finished run directory at `path` (full and linear, N = 32, 64, forward), measured once per session."""
    if extra not in _TINY:
        template = Path(tempfile.mkdtemp(prefix="attnbench-tiny-")) / "run"
        atexit.register(shutil.rmtree, template.parent, True)
        result = bench(
            "run",
            "--variants",
            "full,linear",
            "--lengths",
            "32,64",
            "--passes",
            "fwd",
            "--out",
            str(template),
            *FAST,
            *extra,
        )
        assert result.exit_code == 0, result.output
        _TINY[extra] = template
    shutil.copytree(_TINY[extra], path)
    return path


# -- one writer per run directory ---------------------------------------------------------------------


def test_second_writer_is_refused_and_nothing_is_lost(tmp_path):
    out = tmp_path / "locked"
    first = bench_process("run", *SLOW_RUN, "--out", str(out))
    wait_for_rows(out, 1, first)
    second = bench_process("run", "--resume", str(out), "--import", "fault_variants")
    output, _ = second.communicate(timeout=120)
    assert second.returncode == 2 and f"PID {first.pid}" in output and "being written by another process" in output
    first_out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, first_out
    rows = run_dir_rows(out)
    assert len(rows) == 8 and not rows.duplicated(["variant", "n"]).any()


def test_quality_resume_while_training_is_refused(tmp_path):
    from harness.store.storage import RunLock

    out = tmp_path / "q"
    out.mkdir()
    config = {"tasks": ["copy"], "variants": ["full"], "lengths": [8], "options": {}, "steps": 1}
    (out / "metadata.json").write_text(json.dumps({"kind": "quality", "config": config, "timing_core": TIMING_CORE}))
    with RunLock(out):  # as a running bench quality holds it
        result = bench("quality", "--resume", str(out))
    assert result.exit_code == 2 and "being written by another process" in result.output


def test_resume_refuses_a_run_timed_by_another_measuring_core(tmp_path):
    # rows timed two ways never share a run: the core's version is in the metadata from the start
    run = tiny_run(tmp_path / "run")
    metadata = json.loads((run / "metadata.json").read_text())
    assert metadata["timing_core"] == TIMING_CORE
    for stored in ({"timing_core": 1}, {}):  # an older core, or a run from before the field existed
        edited = {key: value for key, value in metadata.items() if key != "timing_core"} | stored
        (run / "metadata.json").write_text(json.dumps(edited))
        result = bench("run", "--resume", str(run))
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split()).replace("│", "").replace("  ", " ")
        assert "was timed by measuring core 1" in text and f"this version's is {TIMING_CORE}" in text, text
        assert ("records none" in text) == (stored == {})


# -- rows of another configuration do not count ------------------------------------------------------------


def test_foreign_rows_are_ignored_with_a_warning_and_measured(tmp_path, capfd):
    out = tiny_run(tmp_path / "foreign")
    rows = read_rows(out)
    foreign = {**rows[0], "head_dim": 999}
    other_options = {**rows[-1], "options": {"feature_map": "elu", "chunk_size": 7, "eps": 1e-6, "scale": None}}
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [foreign, other_options]))
    result = bench("run", "--resume", str(out))
    assert result.exit_code == 0, result.output
    assert "2 rows belong to another configuration" in " ".join((result.output + capfd.readouterr().err).split())
    from harness.readers.speed.frames import load_frame

    df = load_frame(out)
    assert len(df) == 4 and set(df["head_dim"]) == {16}


# -- tolerant, loud readers ---------------------------------------------------------------------------------


def test_bad_line_mid_file_is_skipped_named_and_remeasured(tmp_path, capfd):
    out = tiny_run(tmp_path / "bad")
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text(lines[0] + "\n" + "{not json\n" + "".join(lines[2:]))
    result = bench("report", str(out))
    assert result.exit_code == 0, result.output
    assert f"{out / 'results.jsonl'}:3: not a JSON object; line skipped" in "".join(
        (result.output + capfd.readouterr().err).split("\n")
    )
    assert bench("run", "--resume", str(out)).exit_code == 0
    assert len([r for r in read_rows(out, quiet=True)]) == 4  # the lost cell measured again


def test_complete_last_row_without_newline_is_kept(tmp_path):
    out = tiny_run(tmp_path / "nonl")
    text = (out / "results.jsonl").read_text()
    (out / "results.jsonl").write_text(text.rstrip("\n"))
    before = read_rows(out)
    assert len(before) == 4
    assert bench("run", "--resume", str(out)).exit_code == 0
    after = read_rows(out)
    assert after == before  # nothing re-measured: the original measurement is kept


def test_duplicate_cells_resolve_to_the_latest_row(tmp_path, capfd):
    out = tiny_run(tmp_path / "dup")
    rows = read_rows(out)
    newer = {**rows[0], "time_median_s": 123.0}
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(newer) + "\n")
    from harness.readers.speed.frames import load_frame

    df = load_frame(out)
    assert len(df) == 4 and 123.0 in set(df["time_median_s"])
    assert "appear more than once; the latest row of each is used" in capfd.readouterr().err
    assert bench("report", str(out)).exit_code == 0


def test_corrupt_metadata_is_a_clear_error(tmp_path):
    out = tiny_run(tmp_path / "meta")
    (out / "metadata.json").write_text("{")
    for args in (("report", str(out)), ("run", "--resume", str(out))):
        result = bench(*args)
        assert result.exit_code == 2 and "metadata.json is corrupt" in " ".join(result.output.split())


# -- --retry-failed ------------------------------------------------------------------------------------------


def test_retry_failed_remeasures_failed_cells_and_what_they_stopped(tmp_path):
    out = tmp_path / "retry"
    args = [
        "run",
        "--import",
        "fault_variants",
        "--variants",
        "test_hangs",
        "--lengths",
        "32,128,256",
        "--passes",
        "fwd",
        "--cell-timeout",
        "3",
        "--out",
        str(out),
        *FAST,
    ]
    assert bench(*args).exit_code == 0
    before = run_dir_rows(out).set_index("n")["status"].to_dict()
    assert before == {32: "ok", 128: "timeout", 256: "skipped"}
    plain = bench("run", "--resume", str(out), "--import", "fault_variants")
    assert plain.exit_code == 0 and len(read_rows(out)) == 3  # a plain resume keeps the failures
    again = bench("run", "--resume", str(out), "--import", "fault_variants", "--retry-failed")
    assert again.exit_code == 0, again.output
    assert "2 rows of failed cells set aside" in again.output
    rows = read_rows(out)
    assert len(rows) == 3 and len(read_rows(out, "superseded.jsonl")) == 2
    finished = {r["n"]: r["finished"] for r in rows}
    assert finished[128] >= finished[32]


# -- honest compare --------------------------------------------------------------------------------------


def test_compare_fails_when_a_cell_stops_being_ok(tmp_path):
    a = tiny_run(tmp_path / "a")
    b = tiny_run(tmp_path / "b")
    rows = read_rows(b)
    for row in rows:
        if row["variant"] == "linear":
            row.update(status="incorrect", message="relative error ... FAILED", time_median_s=None)
    (b / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = bench("compare", str(a), str(b), "--fail-if-slower", "25%")
    assert result.exit_code == 1, result.output
    assert "2 cells ok in A are not ok in B" in result.output and "incorrect" in result.output


@pytest.mark.parametrize("threshold", ["nan", "inf", "-5%", "0%", "abc"])
def test_compare_thresholds_must_be_finite_and_positive(tmp_path, threshold):
    a = tiny_run(tmp_path / "a")
    result = bench("compare", str(a), str(a), "--fail-if-slower", threshold)
    assert result.exit_code == 2 and "--fail-if-slower" in result.output


# -- no silent code execution -------------------------------------------------------------------------


def test_resume_with_imports_requires_naming_them(tmp_path):
    out = tmp_path / "imp"
    assert (
        bench(
            "run",
            "--import",
            "fault_variants",
            "--variants",
            "test_raises",
            "--lengths",
            "32",
            "--passes",
            "fwd",
            "--out",
            str(out),
            *FAST,
        ).exit_code
        == 0
    )
    result = bench("run", "--resume", str(out))
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "was run with --import fault_variants" in text and "name it again" in text
    assert bench("run", "--resume", str(out), "--import", "fault_variants").exit_code == 0


def test_the_stored_command_reads_back_as_the_arguments_given():
    """An empty argument (`--long-lengths ''`) or one with a space stays an argument when the report's command
    is pasted into a shell; joined with spaces, `--long-lengths --pairs 8` took --pairs for its value."""
    import shlex

    from harness.core.machine import environment

    argv = ["/usr/bin/bench", "quality", "--long-lengths", "", "--variants", "full,linear", "--out", "a b"]
    assert shlex.split(environment(argv)["command"]) == ["bench", *argv[1:]]


def test_report_escapes_text_from_metadata(tmp_path):
    out = tiny_run(tmp_path / "esc")
    meta = json.loads((out / "metadata.json").read_text())
    meta["environment"]["command"] = "bench run `rm -rf /`\n# injected"
    meta["environment"]["cpu"]["model"] = "<img src=x onerror=alert(1)>"
    (out / "metadata.json").write_text(json.dumps(meta))
    assert bench("report", str(out)).exit_code == 0
    report = (out / "REPORT.md").read_text()
    assert (
        "<img" not in report.replace("\\<img", "")
        and "\n# injected" not in report
        and "`` bench run `rm -rf /` # injected ``" in report
    )


# -- the gate cannot be fooled by a broken definition ---------------------------------------------------------


@pytest.mark.parametrize("value", ["Infinity", "NaN", "-Infinity"])
def test_non_finite_options_are_rejected_before_anything_exists(tmp_path, value):
    out = tmp_path / "eps"
    result = bench(
        "run", "--variants", "linear", "--option", f"eps={value}", "--lengths", "32", "--out", str(out), *FAST
    )
    assert result.exit_code == 2 and "must be finite" in result.output
    assert not out.exists()
    with pytest.raises(ValueError, match=r"eps=inf is invalid; expected a number in \[0, 1.0\]"):
        variants.build("linear", eps=float("inf"))


def test_gate_rejects_all_zero_output_even_when_the_definition_is_zero_too():
    from harness.core.gate import gate_verdict

    zeros = torch.zeros(2, 4)
    verdict = gate_verdict(zeros, zeros, zeros.double(), "float32")
    assert not verdict["ok"] and "all zeros" in verdict["describe"]


def test_gate_checks_the_band_against_an_independent_softmax(tmp_path):
    """A band variant whose definition (`reference`) is wrong as well as its output: only the independent check sees it."""
    sys.path.insert(0, str(TESTS))
    from harness.sweep.config import RunConfig
    from harness.sweep.worker import check_variant

    import fault_variants  # noqa: F401

    cfg = RunConfig(
        variants=("test_wrong_definition",),
        lengths=(64,),
        devices=("cpu",),
        passes=("fwd",),
        causal=(False,),
        heads=2,
        head_dim=16,
        options=(("window", 8),),
        check_len=32,
    )
    verdict = check_variant(cfg, "cpu", "test_wrong_definition", False)
    assert not verdict["ok"] and "exact softmax at N=9" in verdict["message"]


def test_rows_record_the_error_against_exact_softmax(tmp_path):
    # what an approximation loses, from the gate's inputs: ~0 for exact attention, clearly more for the
    # random-feature estimate of it, and the same value on every row of a (variant, causal) series
    run = tmp_path / "run"
    result = bench(
        "run",
        "--variants",
        "full,performer",
        "--option",
        "features=8",
        "--lengths",
        "32,64",
        "--passes",
        "fwd",
        "--out",
        str(run),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    errors = {(r["variant"], r["n"]): r["softmax_error"] for r in read_rows(run)}
    assert max(errors[("full", 32)], errors[("full", 64)]) < 1e-5
    assert errors[("performer", 32)] == errors[("performer", 64)] > 0.05


# -- noise is measured and shown ----------------------------------------------------------------------------


def test_noisy_cells_are_flagged_and_the_start_warns(tmp_path):
    out = tmp_path / "noisy"
    hog = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 120\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.5)
        result = bench(
            "run",
            "--variants",
            "full",
            "--lengths",
            "256",
            "--passes",
            "fwd",
            "--out",
            str(out),
            "--check-len",
            "32",
            "--repeats",
            "5",
            "--min-time",
            "0.3",
            "--warmup",
            "0",
            "--heads",
            "2",
            "--head-dim",
            "16",
        )
    finally:
        hog.kill()
        hog.wait()
    assert result.exit_code == 0, result.output
    assert "the benchmark result may be unstable" in result.output
    row = read_rows(out)[0]
    assert row["noisy"] and "other processes used" in row["noise"] and row["others_cores"] > 0.25
    assert "noisy cells" in result.output
    assert bench("report", str(out)).exit_code == 0
    assert "## Noisy cells" in (out / "REPORT.md").read_text()


def test_quiet_cells_record_their_noise_too(tmp_path):
    out = tiny_run(tmp_path / "quiet")
    for row in read_rows(out):
        assert {"load_before", "load_after", "others_cores", "spread", "noisy", "noise"} <= set(row)


# -- nothing runs before it is validated -----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cell-timeout", "nan"], "--cell-timeout"),
        (["--cell-timeout", "inf"], "--cell-timeout"),
        (["--cell-timeout", "1e10"], "--cell-timeout"),
        (["--min-time", "nan"], "--min-time"),
    ],
    ids=["timeout-nan", "timeout-inf", "timeout-huge", "min-time-nan"],
)
def test_poisoned_numbers_are_rejected_before_any_file_exists(tmp_path, args, message):
    out = tmp_path / "poison"
    result = bench("run", "--variants", "full", "--lengths", "32", "--out", str(out), *args)
    assert result.exit_code == 2 and message in result.output and "finite" in result.output
    assert not out.exists()


def test_interrupted_start_up_leaves_no_directory(tmp_path, monkeypatch):
    from harness.sweep import session

    reached = []

    def interrupted(config, *args):
        reached.append(config)
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "measure_machine", interrupted)
    out = tmp_path / "startup"
    result = bench("run", "--variants", "full", "--lengths", "32", "--out", str(out))
    assert reached, f"the start-up never reached measure_machine, so this test checked nothing: {result.output}"
    assert result.exit_code == 130, result.output  # Ctrl-C's exit code
    assert not out.exists() and not list(tmp_path.iterdir())


def test_huge_compression_costs_no_parent_memory(tmp_path):
    from harness.core.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

    out = tmp_path / "huge"
    base = rss_bytes()
    reset_peak_rss()
    result = bench(
        "run",
        "--variants",
        "memory_compressed",
        "--compression",
        "100000",
        "--lengths",
        "32",
        "--passes",
        "fwd",
        "--heads",
        "8",
        "--head-dim",
        "64",
        "--memory-budget",
        "1GiB",
        "--out",
        str(out),
        "--check-len",
        "32",
    )
    assert peak_rss_bytes() - base < 512 * 2**20  # its conv weights would be 13 GB
    assert result.exit_code in (0, 1), result.output
    row = read_rows(out)[0]
    assert row["status"] in ("skipped", "oom", "error") and row["variant"] == "memory_compressed"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--window", "0"], "window=0 is invalid"),
        (["--compression", "0"], "compression=0 is invalid"),
        (["--lr", "inf"], "--lr"),
        (["--lr", "0"], "--lr"),
        (["--label-smoothing", "1.5"], "--label-smoothing"),
        (["--seeds", "0"], "Invalid value for '--seeds': 0 is not allowed; it must be >= 1"),
        (["--device", "tpu"], "--device: 'tpu' is not a device; choose cpu, cuda or auto"),
        pytest.param(
            ["--device", "cuda"],
            "--device: cuda was asked for, but no CUDA device is available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present"),
        ),
        (["--dtype", "bfloat16"], "--dtype bfloat16 trains with CUDA autocast; the device is cpu"),
        (["--pairs", "5"], "--lengths 8: recall: 5 pairs need a length of at least 12"),
        (
            ["--pairs", "40", "--vocab", "64", "--lengths", "128"],
            "recall: 40 distinct keys need a vocabulary of at least 80, got 64",
        ),
        (
            ["--pairs", "2", "--queries", "3", "--lengths", "32"],
            "recall: queries must be between 1 and the number of pairs (2), got 3",
        ),
    ],
    ids=[
        "window",
        "compression",
        "lr-inf",
        "lr-zero",
        "smoothing",
        "seeds",
        "device",
        "no-cuda",
        "dtype",
        "pairs-length",
        "pairs-vocab",
        "queries",
    ],
)
def test_quality_validates_every_option_before_training(tmp_path, args, message):
    out = tmp_path / "q"
    result = bench(
        "quality",
        "--variants",
        "full,sliding_window,memory_compressed",
        "--lengths",
        "8",
        "--steps",
        "1",
        "--out",
        str(out),
        *args,
    )
    assert result.exit_code == 2 and message in " ".join(result.output.split())
    assert not out.exists()


def test_quality_diverging_loss_reports_no_accuracy(tmp_path, monkeypatch):
    import harness.quality.train

    def nan_loss(logits, targets, **kw):  # as an lr that blows the model up would give
        return (logits.sum() * float("nan")).reshape(())

    monkeypatch.setattr(harness.quality.train.F, "cross_entropy", nan_loss)
    out = tmp_path / "div"
    result = bench(
        "quality",
        "--variants",
        "full",
        "--task",
        "copy",
        "--lengths",
        "8",
        "--steps",
        "3",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--batch",
        "4",
        "--out",
        str(out),
    )
    assert (
        result.exit_code == 1 and "training diverged" in result.output and "loss became nan at step 1" in result.output
    )
    assert not any(r.get("final") for r in read_rows(out, "quality.jsonl"))


# -- library traps ------------------------------------------------------------------------------------------


def _encoder():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()  # eval: swapped modules must stay so


def test_second_swap_switches_the_variant():
    model = variants.swap_attention(_encoder(), "full")
    variants.swap_attention(model, "linear")
    assert model.layers[0].self_attn.attention.spec.name == "linear" and not model.layers[0].self_attn.training
    x = torch.randn(1, 5, 16)
    linear = variants.swap_attention(_encoder(), "linear")
    linear.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), linear(x))


def test_swap_rejects_unknown_names_and_models_without_attention():
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        variants.swap_attention(_encoder(), "nope")
    with pytest.raises(ValueError, match="Sequential contains no torch.nn.MultiheadAttention"):
        variants.swap_attention(nn.Sequential(nn.Linear(4, 4)), "full")


@pytest.mark.parametrize("causal", ["no", None, 2, 0.5])
def test_causal_must_be_a_bool(causal):
    q = k = v = torch.randn(1, 1, 4, 8)
    with pytest.raises(TypeError, match="causal must be a bool"):
        variants.build("full")(q, k, v, causal=causal)
    variants.build("full")(q, k, v, causal=1)  # 0/1 ints are bools enough


def test_full_naive_bf16_forms_scores_in_float32():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g) * 8 for _ in range(3))  # large logits
    attn = variants.build("full_naive")
    ref = attn.reference(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double())
    out = attn(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 0.05


@pytest.mark.parametrize(
    "name", ["full", "full_naive", "sliding_window", "sliding_window_flex", "linear", "memory_compressed"]
)
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_nan_inputs_propagate(name, where, causal):
    opts = {"window": 8, "global_tokens": 2} if "sliding" in name else {}
    attn = variants.build(name, num_heads=2, head_dim=32, **opts)
    t = dict(zip("qkv", (torch.randn(1, 2, 300, 32) for _ in range(3))))
    t[where][0, 0, 150] = float("nan")
    with torch.no_grad():
        out = attn(t["q"], t["k"], t["v"], causal=causal)
    row = (
        150 if where == "q" else 153
    )  # a poisoned key reaches the queries that attend it (153 is within every pattern here)
    assert out[0, 0, row].isnan().any(), "a row that saw a poisoned input came out finite"
    assert torch.isfinite(out[0, 1]).all()  # the other head is untouched


def test_flex_cpu_backward_error_says_what_works():
    q = torch.randn(1, 1, 8, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="cannot be trained there.*torch.no_grad.*variant with a backward on cpu"):
        variants.build("sliding_window_flex", window=2)(q, q, q)
    with torch.no_grad():
        assert variants.build("sliding_window_flex", window=2)(q, q, q).shape == (1, 1, 8, 32)


def test_viz_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "p.png"
    out.write_bytes(b"mine")
    result = bench("viz", "--variants", "full", "--n", "8", "--out", str(out))
    assert result.exit_code == 2 and "already exists" in result.output and out.read_bytes() == b"mine"
    assert bench("viz", "--variants", "full", "--n", "8", "--out", str(out), "--force").exit_code == 0
    assert out.read_bytes() != b"mine"
