"""Real complexity: subquadratic variants never hold an N x N matrix (measured peak memory)."""

from __future__ import annotations

import pytest

import json

from helpers import peak_bytes, selected, side_by_side


def subquadratic_cases() -> list[tuple[str, dict, bool]]:
    """(name, options, backward on the CPU): every registered variant whose spec says it is subquadratic,
    with its default options, plus EXTRA_PATHS (options that take another code path at long N)."""
    import variants
    from conftest import shipped

    cases = []
    for name in shipped():
        cls = variants.variant_class(name)
        if cls.spec.subquadratic and cls.unavailable_reason("cpu") is None:
            backward = cls.backward_unsupported_reason("cpu") is None
            for options in ({}, *EXTRA_PATHS.get(name, ())):
                cases.append((name, {"num_heads": 1, "head_dim": 32, **options}, backward))
    return cases


EXTRA_PATHS = {"sliding_window": ({"global_tokens": 4},)}  # the global rows and columns beside the band
SUBQUADRATIC = [case for case in subquadratic_cases() if case[2]]
CASES = [(name, options, backward) for name, options, _ in SUBQUADRATIC for backward in (False, True)]
# subquadratic on the CPU without a CPU backward: compiled per shape, so each has a test of its own below
FORWARD_ONLY = {"sliding_window_flex": "test_flex_forward_keeps_below_one_score_matrix"}


def test_every_subquadratic_variant_is_measured():
    forward_only = {name for name, _, backward in subquadratic_cases() if not backward}
    missing = sorted(forward_only - set(FORWARD_ONLY))
    assert not missing, (
        f"subquadratic variants without a CPU backward, measured by no test: {missing}; add each to "
        "FORWARD_ONLY in tests/test_complexity.py with a forward memory test of its own"
    )
    assert {name for name, _, _ in SUBQUADRATIC} | forward_only >= {"sliding_window", "linear", "memory_compressed"}
    assert all(name in globals() for name in FORWARD_ONLY.values())


SHORT, LONG = 2048, 8192
MIB = 2**20


def _modes(name: str) -> list[bool]:
    import variants

    spec = variants.variant_class(name).spec
    return [causal for causal, ok in ((False, spec.supports_non_causal), (True, spec.supports_causal)) if ok]


def _key(name: str, options: dict, backward: bool) -> str:
    return json.dumps([name, options, backward], sort_keys=True)


@pytest.fixture(scope="module")
def peaks(request) -> dict[str, list[int]]:
    """The peaks of every case this session runs, two fresh processes at a time: (N, causal) pairs each."""
    cases = [
        (p["name"], p["options"], p["backward"])
        for p in selected(request, "test_subquadratic_memory_grows_at_most_linearly")
    ]
    measured = side_by_side(
        [
            lambda name=name, options=options, backward=backward: peak_bytes(
                name, [SHORT, LONG], backward, causal=_modes(name), threads=1, **options
            )
            for name, options, backward in cases
        ]
    )
    return {_key(*case): found for case, found in zip(cases, measured)}


@pytest.mark.parametrize(
    "name, options, backward",
    CASES,
    ids=[f"{n}{'-global' if o.get('global_tokens') else ''}-{'fwdbwd' if b else 'fwd'}" for n, o, b in CASES],
)
def test_subquadratic_memory_grows_at_most_linearly(peaks, name, options, backward):
    # 4x the length: what is O(N) (output, gradients, O(N D) buffers) grows 4x, what is bounded not at
    # all, and anything of size N x N (or N x N / c) 16x. Causal and not (one process measures both),
    # forward and forward+backward.
    one_score_matrix = LONG * LONG * 4
    found = peaks[_key(name, options, backward)]
    for causal, short, long in zip(_modes(name), found[::2], found[1::2]):
        mode = "causal" if causal else "bidir"
        assert long <= 5 * short + 4 * MIB, (
            f"{name} {mode}: peak {short / MIB:.1f} MiB at N={SHORT}, {long / MIB:.1f} MiB "
            f"at N={LONG}: grows {long / max(short, 1):.1f}x for 4x N"
        )
        assert long < one_score_matrix / 4, (
            f"{name} {mode}: peak {long / MIB:.0f} MiB at N={LONG} (one N x N matrix: {one_score_matrix / MIB:.0f} MiB)"
        )


def test_flex_forward_keeps_below_one_score_matrix():
    # compiled per shape (seconds each): one length, causal and not in one process, against the N x N bound
    for causal, peak in zip(
        (False, True), peak_bytes("sliding_window_flex", LONG, False, causal=[False, True], window=256)
    ):
        assert peak < LONG * LONG * 4 / 16, (
            f"sliding_window_flex causal={causal}: peak {peak / MIB:.1f} MiB at N={LONG}"
        )


def test_full_forward_keeps_below_one_score_matrix():
    n = 8192
    assert peak_bytes("full", n, False) < n * n * 4 / 2


def test_measurement_sees_a_score_matrix():
    # the checks above can fail: the textbook form at N=4096 holds 4096 x 4096 floats (64 MiB) at least
    n = 4096
    assert peak_bytes("full_naive", n, False) >= n * n * 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, options",
    [
        ("sliding_window", {"window": 256, "global_tokens": 3}),
        ("linear", {}),
        ("memory_compressed", {"num_heads": 2, "head_dim": 32}),
    ],
)
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
