"""Real complexity: subquadratic variants never hold an N x N matrix (measured peak memory)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# runs in a fresh process so nothing else's memory or allocator state is counted
MEASURE = r"""
import json, sys, torch, variants
from harness.memory import measure_peak, pin_mmap_threshold
name, n, backward, options, dv = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", json.loads(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(2)
attn = variants.build(name, **options)
q, k = (torch.randn(1, 1, n, 32, requires_grad=backward) for _ in range(2))
v = torch.randn(1, 1, n, dv, requires_grad=backward)
def call():
    if backward:
        attn(q, k, v).sum().backward()
    else:
        with torch.no_grad():
            attn(q, k, v)
call()  # warm-up (and compile)
pin_mmap_threshold()
print(json.dumps(measure_peak(call, torch.device("cpu"))))
"""


def peak_bytes(name: str, n: int, backward: bool, dv: int = 32, **options) -> int:
    """Peak extra bytes of one call at (B, H) = (1, 1), D = 32 and the given Dv, in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, name, str(n), "1" if backward else "0", json.dumps(options), str(dv)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


N = 8192
ONE_SCORE_MATRIX = N * N * 4  # one N x N float32 matrix for the single head


@pytest.mark.parametrize(
    "name, backward, options",
    [
        ("sliding_window", False, {"window": 256}),
        ("sliding_window", True, {"window": 256}),
        ("sliding_window", True, {"window": 256, "global_tokens": 4}),
        ("sliding_window_flex", False, {"window": 256}),
        ("linear", False, {}),
        ("linear", True, {}),
        ("memory_compressed", False, {"num_heads": 1, "head_dim": 32}),
        ("memory_compressed", True, {"num_heads": 1, "head_dim": 32}),
        ("full", False, {}),
    ],
    ids=["sw-fwd", "sw-fwdbwd", "sw-global-fwdbwd", "flex-fwd", "linear-fwd", "linear-fwdbwd", "mc-fwd", "mc-fwdbwd", "full-fwd"],
)
def test_peak_memory_below_one_score_matrix(name, backward, options):
    peak = peak_bytes(name, N, backward, **options)
    assert peak < ONE_SCORE_MATRIX / 2, f"{name}: peak {peak / 2**20:.0f} MiB at N={N} (one N x N matrix: {ONE_SCORE_MATRIX / 2**20:.0f} MiB)"


def test_measurement_sees_a_score_matrix():
    # the check above can fail: the textbook form at N=4096 holds 4096 x 4096 floats (64 MiB) at least
    n = 4096
    assert peak_bytes("full_naive", n, False) >= n * n * 4


@pytest.mark.slow
@pytest.mark.parametrize("name, options", [
    ("sliding_window", {"window": 256, "global_tokens": 3}), ("linear", {}), ("memory_compressed", {"num_heads": 2, "head_dim": 32}),
])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_long_sequences_match_definition(name, options, causal):
    """Opt-in (-m slow): N=4096, every group/chunk/block boundary of the defaults crossed many times."""
    import torch

    import variants

    torch.manual_seed(0)
    attn = variants.build(name, **options).double()
    q, k, v = (torch.randn(1, 2, 4096, 32, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attn(q, k, v, causal=causal)
    ref = attn.reference(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)
