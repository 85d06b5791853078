"""Linear attention (elu + 1 feature map) against the explicit O(N²) form."""

from __future__ import annotations

import pytest
import torch

import variants
from conftest import assert_close_with_grads, case_id, make_padding, make_qkv, ref_linear

CASES = [(n, chunk) for n in (1, 7, 64, 257, 1000) for chunk in (1, 5, 64)] + [(2100, 64)]  # 2100: several groups


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("n, chunk", CASES, ids=[case_id(N=n, C=c) for n, c in CASES])
def test_linear_matches_explicit_form(n, chunk, causal, padded):
    q, k, v = make_qkv(b=2, h=2, n_q=n, d=8, dv=5)
    kpm = make_padding(2, n) if padded else None
    out = variants.build("linear", chunk_size=chunk)(q, k, v, causal=causal, key_padding_mask=kpm)
    assert_close_with_grads(out, ref_linear(q, k, v, causal, kpm), (q, k, v), atol=1e-8)


def test_linear_cross_attention():
    q, k, v = make_qkv(n_q=9, n_k=30, d=8, dv=3)
    kpm = make_padding(2, 30)
    out = variants.build("linear")(q, k, v, key_padding_mask=kpm)
    assert_close_with_grads(out, ref_linear(q, k, v, False, kpm), (q, k, v), atol=1e-8)


def test_linear_causal_ignores_future_tokens():
    q, k, v = make_qkv(b=1, n_q=500, requires_grad=False)
    attn = variants.build("linear", chunk_size=32)
    before = attn(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 200:] *= -2
    v2[:, :, 200:] += 1
    assert torch.equal(before[:, :, :200], attn(q, k2, v2, causal=True)[:, :, :200])


def test_feature_map_is_elu_plus_one_with_its_gradient():
    from variants.methods.linear import elu_feature_map

    x = torch.tensor([-3.0, -0.5, -0.0, 0.0, 1e-12, 2.0], dtype=torch.float64, requires_grad=True)
    y = elu_feature_map(x)
    x2 = x.detach().clone().requires_grad_()
    y2 = torch.nn.functional.elu(x2) + 1
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(y2.sum(), x2)[0])
