"""Memory-compressed attention against conv1d + dense attention with the slot mask."""

from __future__ import annotations

import pytest
import torch

import variants
from conftest import assert_close_with_grads, case_id, make_padding, make_qkv, ref_memory_compressed

CASES = [(n, c) for n in (1, 2, 7, 64, 257, 1000) for c in (1, 2, 3, 5)]


def build(c, h=2, d=8, dv=6):
    return variants.build("memory_compressed", compression=c, num_heads=h, head_dim=d, value_dim=dv).double()


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("n, c", CASES, ids=[case_id(N=n, c=c) for n, c in CASES])
def test_matches_conv_then_dense_reference(n, c, causal, padded):
    q, k, v = make_qkv(b=2, h=2, n_q=n, d=8, dv=6)
    kpm = make_padding(2, n) if padded else None
    attn = build(c)
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    ref = ref_memory_compressed(q, k, v, attn, causal, kpm)
    params = (q, k, v, attn.k_weight, attn.k_bias, attn.v_weight, attn.v_bias)
    assert_close_with_grads(out, ref, params, atol=1e-8)
    with torch.no_grad():  # the inference path (causal: one phase's pieces at a time) gives the same
        torch.testing.assert_close(
            attn(q, k, v, causal=causal, key_padding_mask=kpm), ref.detach(), atol=1e-8, rtol=1e-7
        )


def test_cross_attention():
    q, k, v = make_qkv(n_q=11, n_k=31, d=8, dv=6)
    attn = build(3)
    kpm = make_padding(2, 31)
    assert_close_with_grads(
        attn(q, k, v, key_padding_mask=kpm), ref_memory_compressed(q, k, v, attn, False, kpm), (q, k, v)
    )


def test_parameters_are_registered_per_head():
    attn = variants.build("memory_compressed", compression=4, num_heads=3, head_dim=8)
    shapes = {name: tuple(p.shape) for name, p in attn.named_parameters()}
    assert shapes == {"k_weight": (24, 8, 4), "k_bias": (24,), "v_weight": (24, 8, 4), "v_bias": (24,)}


@pytest.mark.parametrize("c", [1, 3, 4])
def test_causal_output_ignores_future_tokens(c):
    q, k, v = make_qkv(b=1, h=2, n_q=100, d=8, dv=6, requires_grad=False)
    attn = build(c)
    before = attn(q, k, v, causal=True)
    for t in range(0, 100, 7):  # perturb everything from t on: outputs before t must not move at all
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, t:] += 1.0
        k2[:, :, t:] -= 2.0
        v2[:, :, t:] *= 3.0
        assert torch.equal(before[:, :, :t], attn(q2, k2, v2, causal=True)[:, :, :t]), f"position >= {t} leaked"


def test_causal_mha_ignores_future_tokens():
    torch.manual_seed(0)
    mha = variants.MultiHeadAttention(32, 4, variant="memory_compressed", compression=3).double()
    x = torch.randn(2, 50, 32, dtype=torch.float64)
    before = mha(x, causal=True)
    for t in (1, 10, 24, 49):
        x2 = x.clone()
        x2[:, t:] = torch.randn_like(x2[:, t:])
        assert torch.equal(before[:, :t], mha(x2, causal=True)[:, :t])


def test_trains_under_bfloat16_autocast():
    # under autocast the block matmul runs in bf16 while its weight stays float32: the backward must mix them
    torch.manual_seed(0)
    attn = variants.build("memory_compressed", compression=3, num_heads=2, head_dim=8)
    q, k, v = (torch.randn(2, 2, 20, 8, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    out.float().square().sum().backward()
    want = attn(q, k, v, causal=True)
    torch.testing.assert_close(out.float(), want, atol=0.1, rtol=0.1)
    for p in attn.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_value_dim_other_than_built_is_a_clear_error(causal):
    q, k, v = make_qkv(n_q=12, d=8, dv=6)
    with pytest.raises(ValueError, match="built for value dim 8, got Dv=6"):
        build(3, dv=8)(q, k, v, causal=causal)
