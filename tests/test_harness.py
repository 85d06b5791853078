"""`bench run` and `bench list`: rows and statuses on tiny sweeps, faults, resume, bad arguments."""

from __future__ import annotations

import re

import os
import signal

import pytest

from harness.store.storage import read_metadata, read_rows
from helpers import FAST, SLOW_RUN, bench, bench_process, run_dir_rows, wait_for_rows


def test_tiny_sweep_writes_every_cell(tmp_path):
    out = tmp_path / "run"
    fast = [arg for arg in FAST if arg != "--no-report"]  # the main command's whole path: it ends with the report
    result = bench(
        "run",
        "--variants",
        "full,linear,sliding_window",
        "--lengths",
        "32,64",
        "--causal",
        "both",
        "--window",
        "8",
        "--out",
        str(out),
        *fast,
        columns=80,
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out)
    assert len(rows) == 3 * 2 * 2 * 2
    assert set(rows["status"]) == {"ok"}
    assert rows.duplicated(["device", "variant", "pass", "causal", "n"]).sum() == 0
    for col in ("time_median_s", "time_min_s", "time_iqr_s", "peak_bytes", "flops", "gflops", "threads", "wall_s"):
        assert rows[col].notna().all(), col
    assert (rows["time_min_s"] <= rows["time_median_s"]).all()
    sw = rows[rows["variant"] == "sliding_window"]
    assert all(o == {"window": 8, "global_tokens": 0, "block_size": None, "scale": None} for o in sw["options"])
    fwdbwd = rows[(rows["pass"] == "fwdbwd") & (rows["variant"] == "full") & (rows["n"] == 64) & ~rows["causal"]]
    assert fwdbwd["flops"].iloc[0] == pytest.approx(3.5 * 2 * 64 * 64 * 32 * 2)  # 3.5 x forward, B=1, H=2, D+Dv=32
    meta = read_metadata(out)
    assert meta["config"]["lengths"] == [32, 64]
    for key in ("command", "versions", "git", "cpu", "python"):
        assert key in meta["environment"]
    assert meta["machine"]["matmul_peak_gflops"]["cpu/float32"] > 0
    assert "beats full" in result.output and "results:" in result.output
    summary = result.output[result.output.index("Summary:") : result.output.index("results:")]
    assert max(map(len, summary.splitlines())) <= 80, summary  # readable in an 80-column terminal
    assert (out / "REPORT.md").is_file() and f"report: {out / 'REPORT.md'}" in result.output
    for name in ("time", "memory", "speedup", "efficiency"):
        assert (out / "figures" / f"{name}.png").is_file() and f"figure: {out / 'figures' / name}.png" in result.output


def test_cells_a_method_cannot_run_are_skipped_with_its_reason(tmp_path):
    # not causal by nature, more landmarks than positions: skipped cells naming why, the others measured
    out = tmp_path / "run"
    result = bench(
        "run",
        "--variants",
        "nystrom,linformer",
        "--option",
        "landmarks=40",
        "--option",
        "rank=4",
        "--option",
        "max_len=64",
        "--lengths",
        "32,64",
        "--passes",
        "fwd",
        "--causal",
        "both",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    rows = {(r["variant"], r["causal"], r["n"]): r for r in read_rows(out)}
    assert rows[("nystrom", False, 32)]["status"] == "skipped"
    assert "landmarks=40 > N=32" in rows[("nystrom", False, 32)]["message"]
    assert rows[("nystrom", False, 64)]["status"] == "ok" and rows[("linformer", False, 64)]["status"] == "ok"
    for name in ("nystrom", "linformer"):
        assert rows[(name, True, 64)]["status"] == "skipped"
        assert f"{name} does not support causal attention: " in rows[(name, True, 64)]["message"]


def test_decode_cells_time_one_step_and_record_the_state(tmp_path):
    # a decode cell: the state from the variant's prefill of N positions, one step of one token timed; the state's
    # bytes and the bandwidth of reading it recorded; non-causal decode cells are not planned; methods that cannot
    # decode are skipped with the reason; the gate checks decoded steps against the dense definition
    out = tmp_path / "run"
    fast = [arg for arg in FAST if arg != "--no-report"]
    result = bench(
        "run",
        "--variants",
        "full,linear,sliding_window,retention,nystrom",
        "--option",
        "window=8",
        "--lengths",
        "32,64",
        "--passes",
        "fwd,decode",
        "--causal",
        "both",
        "--out",
        str(out),
        *fast,
    )
    assert result.exit_code == 0, result.output
    rows = {(r["variant"], r["pass"], r["causal"], r["n"]): r for r in read_rows(out)}
    assert not any(p == "decode" and not c for (_, p, c, _) in rows)
    kinds = {"full": "kv", "linear": "recurrent", "sliding_window": "window", "retention": "recurrent"}
    for name, kind in kinds.items():
        at32, at64 = rows[(name, "decode", True, 32)], rows[(name, "decode", True, 64)]
        for r in (at32, at64):
            assert r["status"] == "ok" and r["state_kind"] == kind and r["time_median_s"] > 0, r
            assert r["read_bytes"] == r["state_bytes"]  # (these read all of it; moba reads part)
            assert r["bandwidth_gbs"] == pytest.approx(r["read_bytes"] / r["time_median_s"] / 1e9)
            assert r["flops"] is None  # memory-bound: its figure is the bandwidth
        if kind == "kv":
            assert (
                at64["state_bytes"] == 2 * 2 * 65 * 16 * 4
            )  # k and v, B=1, H=2, D=16, N + 1 positions (the step's too)
        elif kind == "window":
            assert at64["state_bytes"] == at32["state_bytes"] == 8 * 2 * 2 * 16 * 4  # w = 8 positions
        else:
            assert at64["state_bytes"] == at32["state_bytes"]
    assert rows[("nystrom", "decode", True, 32)]["status"] == "skipped"
    assert "nystrom does not support causal attention" in rows[("nystrom", "decode", True, 32)]["message"]
    assert read_metadata(out)["machine"]["memory_bandwidth_gbs"]["cpu"] > 0
    text = (out / "REPORT.md").read_text()
    assert "## Decoding: the state a step reads" in text and "| `sliding_window` | window |" in text
    assert (out / "figures" / "efficiency.png").is_file()  # decode panels against the copy bandwidth
    assert bench("run", "--passes", "decode", "--causal", "no", "--out", str(tmp_path / "x")).exit_code == 2
    assert not (tmp_path / "x").exists()


def test_every_selected_variant_gets_a_decode_row_or_a_reason_under_causal_auto(tmp_path):
    # --causal auto measures linformer bidirectionally only; its decode cells were left out without a row or a word
    out = tmp_path / "run"
    fast = [arg for arg in FAST if arg != "--no-report"]
    result = bench(
        "run", "--variants", "full,linformer", "--lengths", "32", "--passes", "fwd,decode", "--out", str(out), *fast
    )
    assert result.exit_code == 0, result.output
    rows = {(r["variant"], r["pass"], r["causal"]): r for r in read_rows(out)}
    assert rows[("linformer", "fwd", False)]["status"] == "ok"
    assert rows[("linformer", "decode", True)]["status"] == "skipped"
    assert "linformer does not support causal attention" in rows[("linformer", "decode", True)]["message"]
    assert rows[("full", "decode", True)]["status"] == "ok"


def test_faults_cost_one_cell_each(tmp_path):
    out = tmp_path / "faults"
    result = bench(
        "run",
        "--import",
        "fault_variants",
        "--variants",
        "test_raises,test_hangs,test_kills_itself,test_segfaults",
        "--lengths",
        "32,128,256",
        "--passes",
        "fwd",
        "--cell-timeout",
        "4",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out).set_index(["variant", "n"])
    assert rows.loc[("test_raises", 32), "status"] == "ok"
    assert rows.loc[("test_raises", 128), "status"] == "error"
    assert "ValueError: deliberate failure" in rows.loc[("test_raises", 128), "message"]
    assert rows.loc[("test_raises", 256), "status"] == "error"  # an error does not stop the series
    assert rows.loc[("test_hangs", 128), "status"] == "timeout"
    assert rows.loc[("test_kills_itself", 128), "status"] == "oom"
    assert "SIGKILL" in rows.loc[("test_kills_itself", 128), "message"]
    assert rows.loc[("test_segfaults", 128), "status"] == "error"
    assert "SIGSEGV" in rows.loc[("test_segfaults", 128), "message"]
    for name in ("test_hangs", "test_kills_itself"):  # timeout and oom stop the series
        assert rows.loc[(name, 256), "status"] == "skipped"
        assert "series stopped at N=128" in rows.loc[(name, 256), "message"]


def test_memory_budget_predicts_and_enforces(tmp_path):
    out = tmp_path / "budget"
    result = bench(
        "run",
        "--import",
        "fault_variants",
        "--variants",
        "test_hog,test_huge",
        "--lengths",
        "32,4096",
        "--passes",
        "fwd",
        "--memory-budget",
        "64MiB",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out).set_index(["variant", "n"])
    assert rows.loc[("test_hog", 32), "status"] == "ok"
    assert rows.loc[("test_hog", 4096), "status"] == "oom"  # 256 MiB asked for, 64 MiB allowed
    assert rows.loc[("test_huge", 32), "status"] == "skipped"
    assert "predicted 1024.0 TiB > memory budget 64.0 MiB" in rows.loc[("test_huge", 32), "message"]


def test_reported_memory_is_what_the_call_allocates(tmp_path):
    from fault_variants import ALLOC_MIB

    out = tmp_path / "alloc"
    result = bench(
        "run",
        "--import",
        "fault_variants",
        "--variants",
        "test_alloc,full",
        "--lengths",
        "128",
        "--passes",
        "fwd",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out).set_index("variant")
    extra = (rows.loc["test_alloc", "peak_bytes"] - rows.loc["full", "peak_bytes"]) / 2**20
    assert ALLOC_MIB - 4 <= extra <= ALLOC_MIB + 8, f"reported {extra:.1f} MiB for a {ALLOC_MIB} MiB allocation"


def test_incorrect_variant_is_never_timed(tmp_path):
    out = tmp_path / "wrong"
    result = bench(
        "run",
        "--import",
        "fault_variants",
        "--variants",
        "test_wrong,full",
        "--lengths",
        "32,64",
        "--passes",
        "fwd",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out)
    wrong = rows[rows["variant"] == "test_wrong"]
    assert set(wrong["status"]) == {"incorrect"}
    assert wrong["time_median_s"].isna().all()
    assert "relative error vs dense float64" in wrong["message"].iloc[0]


def test_every_cell_failing_exits_nonzero(tmp_path):
    result = bench(
        "run",
        "--import",
        "fault_variants",
        "--variants",
        "test_raises",
        "--lengths",
        "128,256",
        "--passes",
        "fwd",
        "--out",
        str(tmp_path / "bad"),
        *FAST,
    )
    assert result.exit_code == 1
    assert "no cell ran successfully" in result.output


def test_spec_limits_are_skipped_with_reason(tmp_path):
    out = tmp_path / "spec"
    result = bench(
        "run", "--variants", "sliding_window_flex,full_xformers", "--lengths", "32", "--out", str(out), *FAST
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out).set_index(["variant", "pass"])
    assert rows.loc[("sliding_window_flex", "fwd"), "status"] == "ok"
    assert rows.loc[("sliding_window_flex", "fwdbwd"), "status"] == "skipped"
    assert "no backward on cpu" in rows.loc[("sliding_window_flex", "fwdbwd"), "message"]
    assert "unavailable: full_xformers runs on cuda, not cpu" in rows.loc[("full_xformers", "fwd"), "message"]


def test_a_decode_cell_past_the_length_a_variant_holds_is_skipped(tmp_path):
    # a decode cell steps to position N + 1: log_linear with levels=6 holds 32 positions, so its forward at 32
    # runs and its decode is skipped with the reason (it had raised a bare IndexError inside the step)
    out = tmp_path / "levels"
    args = ("--variants", "log_linear", "--option", "levels=6", "--lengths", "32", "--passes", "fwd,decode")
    result = bench("run", *args, "--causal", "yes", "--out", str(out), *FAST)
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out).set_index("pass")
    assert rows.loc["fwd", "status"] == "ok"
    assert rows.loc["decode", "status"] == "skipped"
    assert "N=33: levels=6 fits up to 32 positions" in rows.loc["decode", "message"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--variants", "full,nope"],
            "unknown variant(s) nope; available: all, additive, bilinear, deltanet, dsa, forgetting, full",
        ),
        (["--devices", "cuda"], "cuda was asked for, but no CUDA device is available"),
        (["--devices", "tpu"], "--devices: 'tpu' is not allowed; choose from cpu, cuda"),
        (["--lengths", "1k,2k"], "--lengths: '1k,2k' is not a comma-separated list of integers"),
        (["--passes", "back"], "--passes: 'back' is not allowed; choose from fwd, fwdbwd, decode"),
        (["--memory-budget", "lots"], "--memory-budget: 'lots' is not a size"),
        (["--option", "window"], "--option: 'window' must look like name=value"),
        (["--window", "0", "--variants", "sliding_window"], "window=0 is invalid; expected an int >= 1"),
        (
            ["--compression", "3", "--variants", "full"],
            "option compression=3 is taken by none of the selected variants",
        ),
        (
            ["--option", "linformer.max_len=64", "--variants", "full"],
            "option linformer.max_len=64 is for linformer, which is not among",
        ),
        (
            ["--option", "linformer.window=4", "--variants", "linformer"],
            "linformer takes no option 'window'; it takes: rank",
        ),
        (["--min-len", "512", "--max-len", "256"], "need 1 <= min-len <= max-len"),
        (["--heads", "0"], "'--heads': 0 is not allowed; it must be >= 1"),
        (["--lengths", ""], "--lengths: '' must list integers from 1 to 2147483648"),
        (["--lengths", "32," + "9" * 27], "must list integers from 1 to 2147483648 (2^31)"),
        (["--max-len", str(2**32)], "need 1 <= min-len <= max-len <= 2147483648"),
        (["--check-len", "100000000"], "100000000 is not allowed; use 1 <= value <= 4096"),
        (
            ["--min-repeats", "4", "--repeats", "3"],
            "--min-repeats 4: at most --repeats (3), the most timed calls a cell makes",
        ),
    ],
    ids=[
        "unknown-variant",
        "no-cuda",
        "bad-device",
        "bad-lengths",
        "bad-pass",
        "bad-size",
        "bad-option",
        "bad-window",
        "unused-option",
        "scoped-unselected",
        "scoped-unknown",
        "bad-range",
        "bad-heads",
        "empty-lengths",
        "huge-length",
        "huge-max-len",
        "huge-check-len",
        "min-repeats-over-repeats",
    ],
)
def test_invalid_arguments(tmp_path, args, message):
    if "cuda" in args and __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = bench("run", *args, "--out", str(tmp_path / "x"))
    assert result.exit_code == 2
    assert message in " ".join(result.output.split()).replace("│", "").replace("  ", " ") or message in result.output
    assert not (tmp_path / "x").exists()


def test_an_option_scoped_to_one_variant_reaches_that_variant_only(tmp_path):
    # max_len is linformer's length limit and, for linear, a cosformer-only option: shared, linear refuses it
    shared = bench("run", "--variants", "linear,linformer", "--option", "max_len=64", "--out", str(tmp_path / "a"))
    assert shared.exit_code == 2 and "feature_map='cosformer' only" in " ".join(shared.output.split())
    out = tmp_path / "b"
    result = bench(
        "run",
        "--variants",
        "linear,linformer",
        "--option",
        "linformer.max_len=64",
        "--lengths",
        "64",
        "--passes",
        "fwd",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out).set_index("variant")
    assert rows.loc["linformer", "options"]["max_len"] == 64 and rows.loc["linformer", "status"] == "ok"
    assert rows.loc["linear", "options"]["max_len"] is None
    config = read_metadata(out)["config"]
    assert dict(config["resolved_options"])["linformer"]["max_len"] == 64


def test_existing_out_dir_is_never_overwritten(tmp_path):
    (tmp_path / "taken").mkdir()
    result = bench("run", "--out", str(tmp_path / "taken"), "--lengths", "32")
    assert result.exit_code == 2
    assert "already exists" in result.output


def test_ctrl_c_then_sigkill_then_resume_give_exactly_the_plan(tmp_path):
    out = tmp_path / "interrupted"
    proc = bench_process("run", *SLOW_RUN, "--out", str(out))
    wait_for_rows(out, 1, proc)
    with open(f"/proc/{proc.pid}/status") as f:  # how the process treats SIGINT, for the failure message
        dispositions = [line.strip() for line in f if line.startswith(("SigIgn", "SigCgt", "SigBlk"))]
    proc.send_signal(signal.SIGINT)  # Ctrl-C: rows kept, the resume command said, exit 130
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"{dispositions}\n{output}"
    assert f"bench run --resume {out}" in " ".join(output.split())
    interrupted = len(read_rows(out))
    assert interrupted >= 1
    resumed = bench_process(
        "run", "--resume", str(out), "--import", "fault_variants"
    )  # its code runs again: named again
    wait_for_rows(out, interrupted + 1, resumed)
    os.killpg(resumed.pid, signal.SIGKILL)  # the parent and everything it started
    resumed.wait()
    assert interrupted + 1 <= len(read_rows(out)) < 8
    final = bench_process("run", "--resume", str(out), "--import", "fault_variants")
    output, _ = final.communicate(timeout=300)
    assert final.returncode == 0, output
    rows = run_dir_rows(out)
    keys = list(zip(rows["variant"], rows["n"]))
    assert sorted(keys) == sorted(
        (v, n) for v in ("test_slow", "full") for n in range(65, 69)
    )  # complete, no duplicates
    assert set(rows["status"]) == {"ok"}
    assert "resuming" in output


def test_torn_last_line_is_dropped_on_resume(tmp_path):
    out = tmp_path / "torn"
    assert (
        bench("run", "--variants", "full", "--lengths", "32,64", "--passes", "fwd", "--out", str(out), *FAST).exit_code
        == 0
    )
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text(lines[0] + lines[1][:20])  # as if killed mid-write of the second row
    assert len(read_rows(out)) == 1
    result = bench("run", "--resume", str(out))
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out)
    assert sorted(rows["n"]) == [32, 64]


def test_list_shows_variants_and_availability():
    result = bench("list", columns=250)
    assert result.exit_code == 0, result.output
    for name in (
        "full",
        "full_naive",
        "full_xformers",
        "sliding_window",
        "sliding_window_flex",
        "linear",
        "memory_compressed",
    ):
        assert name in result.output
    if not __import__("torch").cuda.is_available():
        assert "no CUDA device is available" in result.output
    assert "runs on cuda, not cpu" in result.output


def test_list_reads_at_80_columns():
    """Every line fits 80 columns, every variant's name stands whole at the start of its row, and what
    qualifies a memory bound is a numbered note under the table."""
    import variants

    result = bench("list", columns=80)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80, result.output
    table = lines[: next(i for i, line in enumerate(lines) if line.startswith("Methods"))]  # the table and its notes
    firsts = {line.split()[0] for line in table if line.strip()}
    assert set(variants.available()) <= firsts, set(variants.available()) - firsts
    assert any(re.match(r"  \[\d+\] full: O\(N D\) \(key padding", line) for line in lines), result.output


def test_help_explains_options():
    result = bench("run", "--help", columns=200)
    assert result.exit_code == 0
    for text in ("--variants", "--memory-budget", "--resume", "--cell-timeout", "fwdbwd"):
        assert text in result.output


@pytest.mark.parametrize("command", ["run", "quality", "lm", "advise", "report", "viz"])
def test_help_reads_in_80_columns(command):
    """Every line of a command's --help fits 80 columns, and an option's help starts on the option's line within
    the first half of it (rich's six-column option table left the help a 30-column strip there)."""
    lines = bench(command, "--help", columns=80).output.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(line for line in lines if len(line) > 80)
    options = [line for line in lines[lines.index("Options:") :] if line.startswith("  --") and "  " in line.strip()]
    assert options, lines
    for option in options:  # "  --name <type>    help", the help's first words beside the name
        assert len(option) - len(option.strip().split("  ", 1)[1].lstrip()) <= 40, option


def test_a_cell_predicted_past_the_cell_timeout_is_skipped_not_run():
    """A series' time extrapolated from its two largest ok N: a cell whose fewest calls (warm-up, --min-repeats
    timed, one for memory) would pass half of --cell-timeout (the prediction's margin) is skipped with the
    prediction, before anything runs; never the baseline's."""
    from harness.sweep.fate import SweepState, calls_per_cell, decide
    from harness.sweep.config import Cell, RunConfig
    from harness.sweep.plan import build_run_config

    config = build_run_config(
        variants="full,linear",
        lengths=(64, 128, 256),
        devices="cpu",
        passes="fwd",
        causal=(False,),
        options={},
        imports=[],
        min_time=0,
        cell_timeout=4,
        batch=1,
        heads=1,
        head_dim=8,
        dtype="float32",
        repeats=3,
        warmup=1,
        threads=0,
        check_len=32,
    )
    rows = [
        {
            "device": "cpu",
            "variant": v,
            "pass": "fwd",
            "causal": False,
            "n": n,
            "device_name": None,
            "status": "ok",
            "time_median_s": t,
        }
        for v in ("full", "linear")
        for n, t in ((32, 0.02), (64, 0.1), (128, 0.4))
    ]
    state = SweepState.from_rows(rows)
    cell = Cell("cpu", "linear", "fwd", False, 256, None)
    assert state.predicted_time(cell) == pytest.approx((1.6, 2.0, 64, 128))  # the two largest below N: slope 2
    assert state.predicted_time(Cell("cpu", "linear", "fwd", False, 64, None)) is None  # one point below: no slope
    assert state.predicted_time(Cell("cpu", "linear", "fwdbwd", False, 256, None)) is None  # another series
    status, message, measured, _ = decide(config, cell, state, {}, None, executor=None)  # (nothing to run it with)
    assert status == "skipped" and measured is None
    assert message == (
        "predicted 1.6 s a call (~N^2.00 from N=64 and 128): its 3 calls would pass 2 s, 1/2 of "
        "--cell-timeout 4 s (the prediction's margin)"
    )
    three = RunConfig.from_json(
        {**config.to_json(), "min_repeats": 3, "cell_timeout": 5}
    )  # at least 3 timed calls: 5 a cell
    assert calls_per_cell(three) == 5 and decide(three, cell, state, {}, None, executor=None)[0] == "skipped"
    before = {
        key: value for key, value in config.to_json().items() if key != "min_repeats"
    }  # a run from before it was recorded
    assert RunConfig.from_json(before).min_repeats == 3

    class Ran(Exception):
        pass

    class Refuses:  # an executor that says the cell went on to run (its correctness check first)
        def submit(self, *args, **kwargs):
            raise Ran

    baseline = Cell("cpu", "full", "fwd", False, 256, None)
    assert state.predicted_time(baseline)[0] * calls_per_cell(config) > config.cell_timeout
    with pytest.raises(
        Ran
    ):  # full, the baseline of every speed-up, is predicted past it too, yet never skipped by prediction
        decide(config, baseline, state, {}, None, executor=Refuses())
    near = SweepState.from_rows([{**r, "time_median_s": r["time_median_s"] / 2} for r in rows])
    assert near.predicted_time(cell)[0] * calls_per_cell(config) == pytest.approx(2.4)  # under 4 s, over half of it
    assert decide(config, cell, near, {}, None, executor=None)[0] == "skipped"
    fast = SweepState.from_rows([{**r, "time_median_s": r["time_median_s"] / 4} for r in rows])
    assert fast.predicted_time(cell)[0] * calls_per_cell(config) == pytest.approx(1.2)  # under half of 4 s: it runs
    with pytest.raises(Ran):
        decide(config, cell, fast, {}, None, executor=Refuses())
    tiny = SweepState.from_rows([{**r, "time_median_s": r["time_median_s"] / 100} for r in rows])
    assert tiny.predicted_time(cell) is None  # 4 ms at N=128: fixed costs still shape the slope, no prediction


def test_causal_auto_measures_each_variant_in_one_mode_once_the_menu_has_decoders():
    """--causal auto (the default): a sweep of methods that all run bidirectionally stays bidirectional; once a
    method is causal only or a pass decodes, each method runs causal where it can, an encoder-only method
    bidirectionally with full's bidirectional cells beside it; the plan and the stored rows follow."""
    from harness.store.rows import belongs
    from harness.sweep.config import RunConfig
    from harness.sweep.plan import build_run_config, plan

    base = dict(
        lengths=(64,),
        devices="cpu",
        options={},
        imports=[],
        min_time=0,
        cell_timeout=5,
        batch=1,
        heads=1,
        head_dim=8,
        dtype="float32",
        repeats=3,
        warmup=1,
        threads=0,
        check_len=32,
    )

    def modes(variants, passes, causal=None):
        config = build_run_config(variants=variants, passes=passes, causal=causal, **base)
        planned = {(cell.variant, cell.causal) for cell in plan(config)}
        assert planned == {(name, mode) for name in config.variants for mode in config.modes_of(name)}
        assert RunConfig.from_json(config.to_json()) == config  # stored in metadata.json as it is
        return config.causal, {name: config.modes_of(name) for name in config.variants}

    assert modes("full,linear", "fwd") == ((False,), {"full": (False,), "linear": (False,)})
    assert modes("full,linear,retention", "fwd") == (
        (True,),
        {"full": (True,), "linear": (True,), "retention": (True,)},
    )
    assert modes("full", "fwd,decode") == ((True,), {"full": (True,)})
    assert modes("full,linformer,retention", "fwd") == (
        (False, True),
        {"full": (False, True), "linformer": (False,), "retention": (True,)},
    )
    assert modes("linformer,retention", "fwd") == ((False, True), {"linformer": (False,), "retention": (True,)})
    both = modes("full,linformer,retention", "fwd", causal=(False, True))  # as given: every variant in every mode
    assert both == ((False, True), {name: (False, True) for name in ("full", "linformer", "retention")})
    assert build_run_config(variants="retention", passes="fwd", causal=(False,), **base).causal == (False,)  # as given
    mixed = build_run_config(variants="full,linformer,retention", passes="fwd", causal=None, **base)
    row = {"device": "cpu", "pass": "fwd", "n": 64, "batch": 1, "heads": 1, "head_dim": 8, "dtype": "float32"}
    kept = {
        (v, c): belongs({**row, "variant": v, "causal": c, "options": mixed.resolved(v)}, mixed)
        for v in ("full", "linformer", "retention")
        for c in (False, True)
    }
    assert kept == {
        ("full", False): True,
        ("full", True): True,
        ("linformer", False): True,
        ("linformer", True): False,
        ("retention", False): False,
        ("retention", True): True,
    }  # a stored row outside its variant's modes is not the run's
    assert "each variant in one mode, causal where it runs so" in " ".join(
        bench("run", "--help", columns=200).output.split()
    )


def test_kv_heads_measures_grouped_query_shapes(tmp_path):
    # --kv-heads: k and v of fewer heads than q in every cell (the gate too); a native variant's decoding state
    # holds Hkv heads (the window's too; a repeating one's H is tested in test_gqa); a number of K/V heads that does
    # not divide --heads is refused
    out = tmp_path / "run"
    fast = [arg for arg in FAST if arg != "--no-report"]
    result = bench(
        "run",
        "--variants",
        "full,retention,sliding_window",
        "--option",
        "window=8",
        "--lengths",
        "32",
        "--passes",
        "fwd,decode",
        "--causal",
        "yes",
        *fast,
        "--heads",
        "6",
        "--kv-heads",
        "2",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    rows = {(r["variant"], r["pass"]): r for r in read_rows(out)}
    assert all(r["status"] == "ok" and r["kv_heads"] == 2 and r["heads"] == 6 for r in rows.values()), rows
    full, window = rows[("full", "decode")], rows[("sliding_window", "decode")]
    assert full["state_bytes"] == 2 * 2 * 33 * 16 * 4  # k and v of 2 K/V heads, B=1, D=16, N + 1 positions
    assert window["state_bytes"] == 2 * 2 * 8 * 16 * 4  # its window kept per K/V head, not per query head
    assert "H=6 on 2 K/V heads" in (out / "REPORT.md").read_text()
    refused = bench("run", "--heads", "6", "--kv-heads", "4", "--out", str(tmp_path / "x"))
    assert refused.exit_code == 2 and "--kv-heads 4: must divide --heads 6" in refused.output
    assert not (tmp_path / "x").exists()
