"""The low-rank approximations of softmax: Linformer's learned projections and Nyströmformer's landmarks."""

from __future__ import annotations

import pytest
import torch

import variants
from conftest import INDEPENDENT_REFERENCES, assert_close_with_grads, case_id, make_padding, make_qkv, ref_full

SIZES = [(n_q, n_k) for n_q, n_k in ((1, 1), (7, 7), (64, 64), (300, 300), (9, 30), (30, 9))]


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("n_q, n_k", SIZES, ids=[case_id(Nq=a, Nk=b) for a, b in SIZES])
def test_linformer_matches_its_definition(n_q, n_k, padded):
    q, k, v = make_qkv(n_q=n_q, n_k=n_k, dv=5)
    kpm = make_padding(2, n_k) if padded else None
    attn = variants.build("linformer", rank=6, max_len=400, num_heads=2).double()
    out = attn(q, k, v, key_padding_mask=kpm)
    ref = INDEPENDENT_REFERENCES["linformer"](attn, q, k, v, False, kpm)
    assert_close_with_grads(out, ref, (q, k, v, attn.e, attn.f), atol=1e-8)


def test_linformer_refuses_causal_and_long_inputs_clearly():
    attn = variants.build("linformer", rank=4, max_len=16, num_heads=2)
    q, k, v = make_qkv(n_q=8, dtype=torch.float32, requires_grad=False)
    with pytest.raises(
        ValueError,
        match=r"linformer: causal=True is not supported by this variant: each projected key mixes all N positions",
    ):
        attn(q, k, v, causal=True)
    q, k, v = make_qkv(n_q=17, dtype=torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match=r"linformer: Nq=17, Nk=17 is not supported: Nk=17 > max_len=16"):
        attn(q, k, v)
    with pytest.raises(ValueError, match=r"linformer: option num_heads is required"):
        variants.build("linformer")
    with pytest.raises(ValueError, match=r"linformer: option rank=0 is invalid"):
        variants.build("linformer", rank=0, num_heads=1)


NYSTROM = [(n_q, n_k, m) for n_q, n_k in ((7, 7), (64, 64), (300, 300), (9, 30), (30, 9)) for m in (1, 3, 7)]


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("n_q, n_k, m", NYSTROM, ids=[case_id(Nq=a, Nk=b, m=m) for a, b, m in NYSTROM])
def test_nystrom_matches_its_definition(n_q, n_k, m, padded):
    q, k, v = make_qkv(n_q=n_q, n_k=n_k, dv=5)
    kpm = make_padding(2, n_k) if padded else None
    attn = variants.build("nystrom", landmarks=m).double()
    out = attn(q, k, v, key_padding_mask=kpm)
    ref = INDEPENDENT_REFERENCES["nystrom"](attn, q, k, v, False, kpm)
    assert_close_with_grads(out, ref, (q, k, v), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_nystrom_with_a_landmark_per_position_is_softmax_attention(padded):
    # m = N: Q̃ = Q, K̃ = K and S pinv(S) S = S; exact up to the iterative pseudo-inverse's error
    q, k, v = make_qkv(n_q=24, dv=5, requires_grad=False)
    q, k = q * 0.3, k * 0.3  # a well-conditioned softmax matrix: the iteration converges in a few dozen steps
    kpm = make_padding(2, 24, all_padded_row=False) if padded else None
    exact = ref_full(q, k, v, kpm=kpm)
    errors = {}
    for iterations in (6, 30):
        out = variants.build("nystrom", landmarks=24, pinv_iterations=iterations).double()(
            q, k, v, key_padding_mask=kpm
        )
        errors[iterations] = (out - exact).abs().max().item()
    assert errors[30] < 1e-8, errors
    assert errors[6] > errors[30]


def test_nystrom_refuses_causal_and_too_many_landmarks_clearly():
    attn = variants.build("nystrom", landmarks=8)
    q, k, v = make_qkv(n_q=6, dtype=torch.float32, requires_grad=False)
    with pytest.raises(
        ValueError,
        match=r"nystrom: causal=True is not supported by this variant: each landmark averages a whole segment",
    ):
        attn(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"nystrom: Nq=6, Nk=6 is not supported: landmarks=8 > N=6"):
        attn(q, k, v)
    with pytest.raises(ValueError, match=r"nystrom: option pinv_iterations=0 is invalid"):
        variants.build("nystrom", pinv_iterations=0)
