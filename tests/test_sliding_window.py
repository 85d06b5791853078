"""Sliding-window attention (blocked and FlexAttention) against the dense band(+global) reference."""

from __future__ import annotations


import pytest
import torch

import variants
from conftest import assert_close_with_grads, case_id, make_padding, make_qkv, ref_sliding_window

CASES = [  # (n, window, global_tokens, block_size)
    (1, 4, 0, None),
    (7, 2, 0, None),
    (7, 2, 2, None),
    (64, 16, 0, None),  # window divides N
    (64, 5, 3, 8),  # window does not divide N or the block
    (257, 64, 0, None),
    (257, 31, 4, 16),
    (1000, 100, 0, None),
    (1000, 33, 2, 64),
    (50, 50, 0, None),  # w >= N: full attention
    (50, 500, 0, 16),
]


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("n, window, g, block", CASES, ids=[case_id(N=n, w=w, g=g, b=b or "auto") for n, w, g, b in CASES])
def test_blocked_matches_reference(n, window, g, block, causal, padded):
    q, k, v = make_qkv(b=2, h=2, n_q=n, d=8, dv=6)
    kpm = make_padding(2, n) if padded else None
    attn = variants.build("sliding_window", window=window, global_tokens=g, block_size=block)
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    ref = ref_sliding_window(q, k, v, window, g, causal, kpm)
    assert_close_with_grads(out, ref, (q, k, v))
    with torch.no_grad():  # the inference path gives the same
        torch.testing.assert_close(attn(q, k, v, causal=causal, key_padding_mask=kpm), ref)


def test_window_at_least_n_equals_full_attention():
    q, k, v = make_qkv(n_q=40)
    for causal in (False, True):
        out = variants.build("sliding_window", window=40)(q, k, v, causal=causal)
        torch.testing.assert_close(out, variants.build("full")(q, k, v, causal=causal))


def test_causal_output_ignores_future_tokens():
    q, k, v = make_qkv(b=1, h=2, n_q=300, requires_grad=False)
    attn = variants.build("sliding_window", window=20, global_tokens=2)
    before = attn(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 150:] += 5.0
    v2[:, :, 150:] -= 3.0
    after = attn(q, k2, v2, causal=True)
    assert torch.equal(before[:, :, :150], after[:, :, :150])


FLEX_CASES = [  # each distinct shape compiles once (seconds on CPU): keep this list short
    (257, 5, 3, True, True),
    (300, 64, 0, False, False),
    (1000, 100, 2, False, True),
]


@pytest.mark.parametrize(
    "n, window, g, causal, padded", FLEX_CASES, ids=[case_id(N=n, w=w, g=g, causal=c, pad=p) for n, w, g, c, p in FLEX_CASES]
)
def test_flex_matches_reference_forward(n, window, g, causal, padded):
    q, k, v = make_qkv(b=2, h=2, n_q=n, d=16, dtype=torch.float32, requires_grad=False)
    kpm = make_padding(2, n) if padded else None
    out = variants.build("sliding_window_flex", window=window, global_tokens=g)(q, k, v, causal=causal, key_padding_mask=kpm)
    torch.testing.assert_close(out.double(), ref_sliding_window(q, k, v, window, g, causal, kpm), atol=2e-5, rtol=2e-5)


def test_flex_backward_on_cpu_is_a_clear_error():
    q, k, v = make_qkv(n_q=32, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"sliding_window_flex has no backward on cpu \(backward runs on: cuda\)"):
        variants.build("sliding_window_flex", window=4)(q, k, v)


def test_flex_spec_says_where_backward_runs():
    spec = variants.variant_class("sliding_window_flex").spec
    assert "cpu" in spec.devices and "cpu" not in spec.backward_devices
