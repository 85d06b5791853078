"""The micro-benchmark suite's settings and shared state (pytest-benchmark; see README, "Micro-benchmarks").

    pytest benchmarks/ --benchmark-only                                  # N = 1024, 4096 on the CPU
    pytest benchmarks/ --benchmark-only --bench-lengths 1024,4096,16384 --bench-memory
    pytest benchmarks/ --benchmark-disable --bench-lengths 64            # each case once, gate included (CI)
    pytest benchmarks/ --benchmark-only --bench-variants full,linear --bench-also 'linear feature_map=relu'  # one variant, two option sets

Every benchmark calls the measuring core of `bench run` (`harness.core`: calls, gate, timing): the same inputs, the
same correctness gate before timing, the same call per pass, threads from the affinity mask.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("attnbench", "attnbench micro-benchmarks")
    group.addoption(
        "--bench-lengths", default="1024,4096", help="sequence lengths N, comma-separated (default 1024,4096)"
    )
    group.addoption(
        "--bench-variants", default="all", help="'all' (every registered variant that runs on the device) or names"
    )
    group.addoption(
        "--bench-device", default="cpu", choices=("cpu", "cuda"), help="device of every benchmark (default cpu)"
    )
    group.addoption(
        "--bench-causal", default="both", choices=("no", "yes", "both"), help="causal masking (default both)"
    )
    group.addoption("--bench-passes", default="fwd,fwdbwd", help="fwd, fwdbwd or both (default)")
    group.addoption("--bench-dtype", default="float32", choices=("float32", "float16", "bfloat16", "float64"))
    group.addoption("--bench-shape", default="1,8,64", help="B,H,D (default 1,8,64)")
    group.addoption(
        "--bench-window", type=int, default=256, help="sliding-window w, also FlexAttention's band (default 256)"
    )
    group.addoption("--bench-compression", type=int, default=3, help="memory_compressed stride c (default 3)")
    group.addoption(
        "--bench-option", action="append", help="any variant option as name=value (bench list shows them); repeatable"
    )
    group.addoption(
        "--bench-also",
        action="append",
        metavar="'NAME name=value ...'",
        help="one more variant with options of its own, beside the others, labelled NAME[name=value,...] "
        "(e.g. 'linear feature_map=taylor feature_dim=16'); repeatable",
    )
    group.addoption(
        "--bench-memory",
        action="store_true",
        help="also record each call's peak extra memory in extra_info (pins glibc's mmap threshold for the whole session)",
    )


def pytest_configure(config):
    # an uncompiled FlexAttention materializes the N x N scores: timing it would be a lie
    config.addinivalue_line("filterwarnings", "error:flex_attention called without torch.compile")


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    from bench_cases import cases

    found = cases(metafunc.config)
    metafunc.parametrize("case", found, ids=[case.id for case in found])


@pytest.fixture(scope="session")
def suite(request):
    from bench_cases import Suite

    return Suite(request.config)
