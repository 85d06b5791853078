"""Exact attention (`full`, `full_naive`) against the independent float64 reference."""

from __future__ import annotations

import itertools

import pytest

import variants
from conftest import assert_close_with_grads, case_id, make_padding, make_qkv, ref_full

SHAPES = [  # (n_q, n_k, d, dv)
    (1, 1, 8, 8),
    (7, 7, 8, 8),
    (64, 64, 16, 16),
    (257, 257, 8, 8),
    (5, 9, 8, 8),  # cross-attention, Nq != Nk
    (16, 16, 8, 12),  # D != Dv
    (33, 20, 8, 4),
]
CASES = [
    (name, shape, causal, padded)
    for name, shape, causal, padded in itertools.product(("full", "full_naive"), SHAPES, (False, True), (False, True))
    if not (causal and shape[0] != shape[1])
]


@pytest.mark.parametrize(
    "name, shape, causal, padded",
    CASES,
    ids=[f"{n}-" + case_id(Nq=s[0], Nk=s[1], D=s[2], Dv=s[3], causal=c, pad=p) for n, s, c, p in CASES],
)
def test_exact_attention_matches_reference(name, shape, causal, padded):
    n_q, n_k, d, dv = shape
    q, k, v = make_qkv(b=2, h=3, n_q=n_q, n_k=n_k, d=d, dv=dv)
    kpm = make_padding(2, n_k) if padded else None
    out = variants.build(name)(q, k, v, causal=causal, key_padding_mask=kpm)
    assert out.shape == (2, 3, n_q, dv)
    assert_close_with_grads(out, ref_full(q, k, v, causal, kpm), (q, k, v))


def test_custom_scale():
    q, k, v = make_qkv()
    out = variants.build("full", scale=0.3)(q, k, v)
    assert_close_with_grads(out, ref_full(q, k, v, scale=0.3), (q, k, v))


def test_full_keeps_to_fused_kernel_when_dv_differs():
    # D != Dv must not fall back to torch's score-materializing math kernel: `full` zero-pads to the
    # fused kernel's shape. Measured, as test_complexity does: at N = 4096 one head's scores are 64 MiB.
    from helpers import peak_bytes

    n = 4096
    dv_differs = peak_bytes("full", n, False, dv=16)
    assert dv_differs < n * n * 4 / 4, (
        f"full with Dv != D: peak {dv_differs / 2**20:.0f} MiB at N={n} (scores: {n * n * 4 / 2**20:.0f} MiB)"
    )


def test_full_with_dv_differing_is_exact():
    q, k, v = make_qkv(n_q=40, d=8, dv=5)
    assert_close_with_grads(variants.build("full")(q, k, v), ref_full(q, k, v), (q, k, v))
