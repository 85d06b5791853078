"""What a first GPU run would hit, exercised on the CPU: planning without touching the device, readable
failures, 16-bit accumulation, batched timing, the gate, GPU metadata parsing, OOM classification."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

import variants
from conftest import make_qkv, ref_linear
from harness.core.gate import gate_verdict
from harness.core.timing import CPU_MIN_SAMPLE_S, time_calls, warm_up
from harness.core.isolation import is_oom
from harness.sweep import worker
from harness.sweep.config import Cell, RunConfig
from harness.sweep.fate import shape_only_variant, useful_flops
from helpers import FAST, bench, run_dir_rows

TESTS = Path(__file__).resolve().parent


def config(**kw) -> RunConfig:
    base = dict(
        variants=("full",), lengths=(32, 64), devices=("cpu",), passes=("fwd",), causal=(False,), heads=2, head_dim=16
    )
    return RunConfig(**{**base, **kw})


# -- the parent plans on the meta device ------------------------------------------------------------


@pytest.mark.parametrize("name", variants.available())
def test_parent_plans_every_variant_without_a_device(name):
    """FLOPs and the memory estimate come from a meta-device instance: a CUDA-only variant plans on a CPU machine."""
    cfg = config(variants=(name,))
    attn = shape_only_variant(cfg, name)
    assert useful_flops(cfg, Cell("cuda", name, "fwd", False, 1024), attn) > 0
    assert not torch.cuda.is_initialized()


def test_parent_planning_a_huge_option_allocates_nothing():
    from harness.core.memory import rss_bytes

    cfg = config(variants=("memory_compressed",), heads=8, head_dim=64, options=(("compression", 100_000),))
    before = rss_bytes()
    attn = shape_only_variant(cfg, "memory_compressed")  # 13 GB of conv weights if they were real
    assert rss_bytes() - before < 64 * 2**20
    assert all(p.device.type == "meta" for p in attn.parameters())


def test_a_variant_without_flops_costs_its_cells_only(tmp_path):
    out = tmp_path / "noflops"
    result = bench(
        "run",
        "--import",
        "fault_variants",
        "--variants",
        "test_no_flops,full",
        "--lengths",
        "32",
        "--passes",
        "fwd",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out).set_index("variant")
    assert rows.loc["test_no_flops", "status"] == "error"
    assert (
        "cannot plan the cell: NotImplementedError: test_no_flops has no FLOP count"
        in rows.loc["test_no_flops", "message"]
    )
    assert rows.loc["full", "status"] == "ok"


def test_cuda_only_variant_builds_without_a_device_where_cuda_exists():
    """build() without a device asks for any device the variant runs on, not the CPU (MultiHeadAttention's case)."""
    reasons = {d: variants.variant_class("full_xformers").unavailable_reason(d) for d in ("cpu", "cuda")}
    if reasons["cuda"] is None:
        assert variants.MultiHeadAttention(64, 4, variant="full_xformers") is not None
    else:
        with pytest.raises(RuntimeError, match="full_xformers runs on cuda, not cpu|no CUDA device"):
            variants.MultiHeadAttention(64, 4, variant="full_xformers")


def test_xformers_availability_does_not_import_it(tmp_path):
    """Importing xformers.ops probes the GPU; availability must be found without it (a fake package proves it)."""
    pkg = tmp_path / "xformers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text("raise RuntimeError('xformers.ops was imported')\n")
    code = textwrap.dedent("""
        import sys, variants
        from variants.methods.full_xformers import _xformers_installed
        assert _xformers_installed() is None
        variants.variant_class("full_xformers").unavailable_reason("cuda")
        assert "xformers.ops" not in sys.modules
        print("ok")
    """)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{tmp_path}:{TESTS.parent}", "PATH": "/usr/bin:/bin"},
    )
    assert done.stdout.strip() == "ok", done.stderr


# -- failures are readable -----------------------------------------------------------------------------


def test_multiline_errors_keep_their_reason_and_log_a_traceback(tmp_path):
    out = tmp_path / "multi"
    result = bench(
        "run",
        "--import",
        "fault_variants",
        "--variants",
        "test_raises_multiline",
        "--lengths",
        "32,128",
        "--passes",
        "fwd",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out).set_index("n")
    assert rows.loc[128, "status"] == "error"
    assert "LoweringException: the real reason is here" in rows.loc[128, "message"]
    log = (out / "worker.log").read_text()
    assert (
        "Traceback (most recent call last)" in log and "measure_cell(cpu test_raises_multiline fwd N=128) failed" in log
    )


def test_alloc_failures_of_cuda_libraries_are_oom():
    for text in (
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    ):
        assert is_oom(RuntimeError(text))
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory.")) and is_oom(MemoryError())
    assert not is_oom(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED"))


# -- 16-bit linear attention keeps its sums in float32 -----------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_linear_fp16_long_sequence_matches_reference(causal):
    """φ(q)·Σφ(k) ≈ 86·N at D=64 passes fp16's 65504 from N ≈ 760: the output must stay right at N = 2048."""
    q, k, v = make_qkv(b=1, h=2, n_q=2048, d=64, requires_grad=False)
    out = variants.build("linear")(q.half(), k.half(), v.half(), causal=causal)
    assert out.dtype == torch.float16
    ref = ref_linear(q.half().double(), k.half().double(), v.half().double(), causal)
    relative = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert relative < 5e-3, relative  # fp16 sums gave all zeros here (relative error 1.0)


# -- timing batches calls per sample ------------------------------------------------------------------------


class FakeClock:
    """Each call advances time by `per_call` seconds, and each start/stop pair costs `overhead`."""

    def __init__(self, per_call: float, overhead: float):
        self.now, self.per_call, self.overhead = 0.0, per_call, overhead

    def call(self):
        self.now += self.per_call

    def start(self):
        self.t0 = self.now

    def stop(self):
        self.now += self.overhead
        return self.now - self.t0


def test_time_calls_batches_short_calls_per_sample():
    clock = FakeClock(per_call=10e-6, overhead=50e-6)  # a 10 µs kernel, 50 µs of launch/sync overhead per sample
    times, per_sample = time_calls(clock.call, clock, repeats=5, min_time=1.0, min_sample_s=1e-3)
    assert per_sample == 17  # ceil(1 ms / 60 µs measured for the calibrating call)
    assert len(times) == 5
    assert all(t == pytest.approx(10e-6 + 50e-6 / 17) for t in times)  # overhead shared by 17 calls, not added to each


def test_time_calls_one_call_per_sample_on_cpu_and_min_time():
    clock = FakeClock(per_call=0.4, overhead=0.0)
    times, per_sample = time_calls(clock.call, clock, repeats=10, min_time=1.0)
    assert per_sample == 1 and len(times) == 3  # 3 samples of 0.4 s pass min_time = 1 s


def test_a_call_lasting_min_time_is_timed_once_with_min_repeats_1():
    # pyperf's calibration: a call that alone lasts min_time is stable on its own; shorter ones still fill min_time
    long = FakeClock(per_call=1.5, overhead=0.0)
    assert len(time_calls(long.call, long, repeats=10, min_time=1.0, min_repeats=1)[0]) == 1
    assert len(time_calls(long.call, long, repeats=10, min_time=1.0)[0]) == 3  # the default: at least 3
    short = FakeClock(per_call=0.4, overhead=0.0)
    assert len(time_calls(short.call, short, repeats=10, min_time=1.0, min_repeats=1)[0]) == 3  # 1.2 s >= 1 s


def test_one_sample_has_no_spread_and_only_load_flags_it():
    from harness.core.noise import Snapshot, noise_fields

    before, after = Snapshot(0.0, 10.0, 1.0, 0.5), Snapshot(1.0, 11.0, 2.0, 0.5)  # others used no core
    assert noise_fields(before, after, 1.0, 0.0, samples=1)["spread"] is None
    assert not noise_fields(before, after, 1.0, 0.0, samples=1)["noisy"]
    wide = noise_fields(before, after, 1.0, 0.5, samples=3)
    assert wide["spread"] == 0.5 and wide["noisy"] and "spread" in wide["noise"]
    busy = noise_fields(before, Snapshot(1.0, 12.0, 2.0, 1.5), 1.0, 0.0, samples=1)  # another process kept 1 core busy
    assert busy["spread"] is None and busy["noisy"] and "other processes used 1.00 cores" in busy["noise"]


def test_last_warm_up_call_calibrates_samples_without_another_call():
    # a cell of seconds a call must not pay one more call to learn what its warm-up already measured
    clock = FakeClock(per_call=10e-6, overhead=50e-6)
    calls = []
    last = warm_up(lambda: (calls.append(1), clock.call()), clock, calls=3, seconds=0.0)
    assert len(calls) == 3 and last == pytest.approx(60e-6)
    calls.clear()
    times, per_sample = time_calls(
        lambda: (calls.append(1), clock.call()), clock, repeats=5, min_time=1.0, min_sample_s=1e-3, per_call=last
    )
    assert per_sample == 17 and len(calls) == 5 * 17  # ceil(1 ms / 60 µs), and no calibrating call
    assert warm_up(clock.call, clock, calls=0, seconds=0.0) is None


def test_warm_up_runs_by_count_and_by_time():
    clock = FakeClock(per_call=0.004, overhead=0.0)
    calls = []
    warm_up(lambda: (calls.append(1), clock.call()), clock, calls=1, seconds=0.025)
    assert len(calls) == 7  # until 25 ms have passed at 4 ms a call
    calls.clear()
    warm_up(lambda: (calls.append(1), clock.call()), clock, calls=2, seconds=0.0)
    assert len(calls) == 2


def test_rows_record_kernel_memory_kind_and_calls_per_sample(tmp_path):
    out = tmp_path / "row"
    # warmed calls calibrate the samples (FAST's --warmup 0 would calibrate on the process's first, cold call)
    result = bench(
        "run",
        "--variants",
        "full,linear",
        "--lengths",
        "64",
        "--passes",
        "fwd",
        "--out",
        str(out),
        *FAST,
        "--warmup",
        "3",
    )
    assert result.exit_code == 0, result.output
    rows = run_dir_rows(out).set_index("variant")
    assert rows.loc["full", "kernel"] == "flash_attention"
    assert pd.isna(rows.loc["linear", "kernel"])
    assert set(rows["memory_kind"]) == {"rss"}
    # calibrated on the CPU too: a sample of several calls at N = 64 (0.1 ms each on a quiet machine, where a 10 ms
    # sample holds dozens; the timed calls may be 4 x faster than the last warm-up call the count came from), or of
    # one call only where load made that call itself long (a quarter of CPU_MIN_SAMPLE_S) - never a lone short call
    alone = rows[rows["calls_per_sample"] == 1]
    assert (alone["time_median_s"] >= CPU_MIN_SAMPLE_S / 4).all(), rows[["calls_per_sample", "time_median_s"]]
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["machine"]["matmul_peak_precision"]["cpu/float32"] == "float32"


# -- the gate --------------------------------------------------------------------------------------------


def test_gate_catches_a_tile_skipping_bug_only_at_a_sparse_length():
    """Every tile pair touches the band at short N; the gate's length (>= 2w + 3 tiles) must make some skipped."""
    sys.path.insert(0, str(TESTS))
    import fault_variants  # noqa: F401 — registers test_flex_wrong_order

    cfg = config(
        variants=("test_flex_wrong_order",), lengths=(128, 1024), options=(("window", 8),), check_len=32, head_dim=32
    )
    verdict = worker.check_variant(cfg, "cpu", "test_flex_wrong_order", False)
    assert verdict["check_len"] == 2 * 8 + 3 * 128
    assert not verdict["ok"] and "FAILED" in verdict["message"]
    short = config(
        variants=("test_flex_wrong_order",), lengths=(64, 128), options=(("window", 8),), check_len=32, head_dim=32
    )
    assert worker.check_variant(short, "cpu", "test_flex_wrong_order", False)["ok"]  # what the old N = 320 gate saw


def test_gate_checks_a_batch_of_two_even_for_batch_one_runs():
    sys.path.insert(0, str(TESTS))
    import fault_variants  # noqa: F401

    verdict = worker.check_variant(config(variants=("test_batch_bug",), batch=1), "cpu", "test_batch_bug", False)
    assert not verdict["ok"] and "B=2" in verdict["message"]


def test_gate_verdicts():
    want = torch.randn(4, 8, dtype=torch.float64)
    low = want.float()  # the dense definition in float32: rounding error only
    ok = gate_verdict(want.float() + 1e-7, low, want, "float32")
    assert ok["ok"]
    assert not gate_verdict(want.float() * 1.001, low, want, "float32")["ok"]
    zeros = gate_verdict(torch.zeros(4, 8), low, want, "float32")
    assert not zeros["ok"] and "all zeros" in zeros["describe"]
    nan = gate_verdict(torch.full((4, 8), float("nan")), low, want, "float32")
    assert not nan["ok"] and "non-finite" in nan["describe"]
    overflow = gate_verdict(want.half(), torch.full((4, 8), float("inf")), want, "float16")
    assert overflow["ok"] and "overflows" in overflow["describe"]


# -- GPU metadata -----------------------------------------------------------------------------------------

SMI_TWO_GPUS = (
    "GPU-aaaa-1111, 580.159.03, 1980, 3201, 700.00, Disabled, Enabled, Default\n"
    "GPU-bbbb-2222, 580.159.03, 1980, 3201, [N/A], [N/A], Enabled, Default\n"
)


def test_nvidia_smi_parser_picks_this_gpu():
    row = worker.parse_nvidia_smi(SMI_TWO_GPUS, 0, "bbbb-2222")
    assert row["uuid"] == "GPU-bbbb-2222" and row["driver_version"] == "580.159.03"
    assert row["power.limit"] is None and row["mig.mode.current"] is None and row["clocks.max.sm"] == "1980"


@pytest.mark.parametrize(
    "stdout, code, uuid, error",
    [
        (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
            9,
            "x",
            "nvidia-smi exited with 9",
        ),
        ('Field "foo" is not a valid field to query.\n', 0, "x", "unexpected line"),
        ("", 0, "x", "listed no GPU"),
        (SMI_TWO_GPUS, 0, "cccc", "no GPU with uuid cccc"),
    ],
    ids=["driver-down", "bad-field", "empty", "other-gpu"],
)
def test_nvidia_smi_parser_never_stores_error_text_as_values(stdout, code, uuid, error):
    row = worker.parse_nvidia_smi(stdout, code, uuid)
    assert set(row) == {"error"} and error in row["error"]


# -- FlexAttention on CUDA -----------------------------------------------------------------------------


def test_flex_has_no_float64_on_cuda_and_the_sweep_skips_it():
    cls = variants.variant_class("sliding_window_flex")
    assert "no float64 on cuda" in cls.dtype_unsupported_reason("cuda", "float64")
    assert "no float64 on cpu" in cls.dtype_unsupported_reason("cpu", "float64")  # compiled flex refuses it there too
    assert cls.dtype_unsupported_reason("cpu", "float32") is None
    from harness.sweep.fate import static_skip_reason

    reason = static_skip_reason(
        config(variants=("sliding_window_flex",), dtype="float64"),
        Cell("cuda", "sliding_window_flex", "fwd", False, 64),
    )
    assert reason and ("no float64 on cuda" in reason or "no CUDA device" in reason)
