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


# -- the other feature maps: the same scan, checked against each kernel written from its definition --

MAPS = [("relu", None), ("taylor", None), ("cosformer", None), ("cosformer", 3000)]
MAP_CASES = [(n, chunk) for n in (1, 7, 257) for chunk in (1, 5, 64)] + [
    (1100, 64)
]  # 1100: several groups (taylor: F = 73)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("n, chunk", MAP_CASES, ids=[case_id(N=n, C=c) for n, c in MAP_CASES])
@pytest.mark.parametrize("feature_map, max_len", MAPS, ids=[case_id(map=f, M=m) if m else f for f, m in MAPS])
def test_feature_maps_match_their_kernels(feature_map, max_len, n, chunk, causal, padded):
    q, k, v = make_qkv(b=2, h=2, n_q=n, d=8, dv=5)
    kpm = make_padding(2, n) if padded else None
    attn = variants.build("linear", feature_map=feature_map, max_len=max_len, chunk_size=chunk)
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    ref = ref_linear(q, k, v, causal, kpm, feature_map=feature_map, max_len=max_len)
    assert_close_with_grads(out, ref, (q, k, v), atol=1e-8)


@pytest.mark.parametrize("feature_map", ["relu", "taylor", "cosformer"])
def test_feature_maps_cross_attention(feature_map):
    q, k, v = make_qkv(n_q=9, n_k=30, d=4, dv=3)
    kpm = make_padding(2, 30)
    out = variants.build("linear", feature_map=feature_map)(q, k, v, key_padding_mask=kpm)
    assert_close_with_grads(out, ref_linear(q, k, v, False, kpm, feature_map=feature_map), (q, k, v), atol=1e-8)


def test_taylor_kernel_is_the_second_order_expansion_of_softmax():
    # φ(q)·φ(k) = 1 + s + s²/2 with s = q·k/√D: close to exp(s) while |s| is small
    from variants.methods.linear import TaylorFeatures

    q, k, _ = make_qkv(b=1, h=1, n_q=6, d=16, requires_grad=False)
    fmap = TaylorFeatures()
    assert fmap.apply(q, 0, {}, True).shape[-1] == 1 + 16 + 16 * 16
    kernel = fmap.apply(q, 0, {}, True) @ fmap.apply(k, 0, {}, False).transpose(-1, -2)
    s = q @ k.transpose(-1, -2) / 4
    torch.testing.assert_close(kernel, 1 + s + s * s / 2)
    small = 0.1 * s
    assert ((1 + small + small**2 / 2) - small.exp()).abs().max() < 2e-3


def test_cosformer_weighs_near_tokens_more_and_its_max_len_makes_decoding_exact():
    q, k, v = make_qkv(b=1, h=1, n_q=40, d=4, requires_grad=False)
    attn = variants.build("linear", feature_map="cosformer", max_len=64)
    whole = attn(q, k, v, causal=True)
    steps = torch.cat([attn(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], causal=True) for i in range(40)], 2)
    torch.testing.assert_close(steps, whole)
    with pytest.raises(
        ValueError, match=r"linear: Nq=65, Nk=65 is not supported: positions up to 65 pass cosformer's max_len=64"
    ):
        attn(*make_qkv(b=1, h=1, n_q=65, d=4, requires_grad=False))
    ones = torch.ones(1, 1, 50, 4, dtype=torch.float64)
    kernel = variants.build("linear", feature_map="cosformer").kernel(ones, ones)
    assert kernel[0, 0, 0, 1] > kernel[0, 0, 0, 25] > kernel[0, 0, 0, 49] > 0  # decays with distance


def test_feature_map_options_are_checked():
    with pytest.raises(
        ValueError, match=r"feature_map='softmax' is invalid; allowed: 'elu', 'relu', 'taylor', 'cosformer'"
    ):
        variants.build("linear", feature_map="softmax")
    with pytest.raises(ValueError, match=r"max_len=8 is for feature_map='cosformer' only, got feature_map='elu'"):
        variants.build("linear", max_len=8)
    with pytest.raises(ValueError, match=r"option eps=nan is invalid"):
        variants.build("linear", eps=float("nan"))
    # finding 15 of issue 23: eps=1e30 gave outputs of 1e-28, "ok" in bench run
    with pytest.raises(
        ValueError,
        match=r"option eps=1e\+30 is invalid; expected a number in \[0, 1.0\] \(it is added to the normalizer",
    ):
        variants.build("linear", eps=1e30)


def test_linear_exports_with_torch_export():
    # the scan has no out= arguments (torch.export refused `div(out=...)` under autograd before)
    q, k, v = make_qkv(b=1, h=2, n_q=20, d=8, dtype=torch.float32, requires_grad=False)
    attn = variants.build("linear", chunk_size=4)

    class Wrap(torch.nn.Module):
        def forward(self, q, k, v):
            return attn(q, k, v, causal=True)

    exported = torch.export.export(Wrap(), (q, k, v))
    torch.testing.assert_close(exported.module()(q, k, v), attn(q, k, v, causal=True))


def test_feature_dim_takes_the_first_dims_of_q_and_k():
    q, k, v = make_qkv(n_q=11, d=8, dv=6)
    attn = variants.build("linear", feature_map="taylor", feature_dim=3, chunk_size=4)
    out = attn(q, k, v, causal=True)
    ref = ref_linear(q[..., :3], k[..., :3], v, True, None, feature_map="taylor")
    assert_close_with_grads(out, ref, (q, k, v), atol=1e-8)
    assert attn.flops(11, 11, 8, 6, False) == variants.build("linear", feature_map="taylor").flops(11, 11, 3, 6, False)
    with pytest.raises(ValueError, match=r"linear: feature_dim=3 > the inputs' head dim D=2"):
        attn(*make_qkv(n_q=4, d=2, requires_grad=False))
    with pytest.raises(ValueError, match=r"linear: option feature_dim=9 is invalid; expected an int <= head_dim=8"):
        variants.build("linear", feature_dim=9, head_dim=8)


@pytest.mark.parametrize("norm", [1.0, 4.0, 8.0])
def test_performer_causal_is_as_safe_in_float32_as_bidirectional_at_large_norms(norm):
    # each query's stabilizer is the largest logit of the keys it sees: the running max when causal. With one max
    # over all N keys, float32 lost the early queries' keys (13% error at 8 x randn, against 1e-6 bidirectionally)
    torch.manual_seed(0)
    attn = variants.build("performer", num_heads=2, head_dim=64)
    twin = variants.build("performer", num_heads=2, head_dim=64).double()
    q, k, v = (torch.randn(1, 2, 512, 64) * s for s in (norm, norm, 1.0))
    errors = {}
    for causal in (False, True):
        with torch.no_grad():
            out = attn(q, k, v, causal=causal)
            want = twin(q.double(), k.double(), v.double(), causal=causal)
        errors[causal] = float((out.double() - want).norm() / want.norm())
    assert errors[True] < 1e-5 and errors[False] < 1e-5, errors
    state = attn.init_state(1, 2, 64, 64)  # and the decoder, which keeps its running max
    outs = []
    for t in range(0, 512, 64):
        out, state = attn.step(q[:, :, t : t + 64], k[:, :, t : t + 64], v[:, :, t : t + 64], state)
        outs.append(out)
    assert float((torch.cat(outs, 2).double() - want).norm() / want.norm()) < 1e-5
