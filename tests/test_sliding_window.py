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


@pytest.mark.parametrize("dv", [6, 8], ids=["dv6-written", "dv8-flash"])  # the CPU flash kernels need Dv = D
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize(
    "n, window, g, block", CASES, ids=[case_id(N=n, w=w, g=g, b=b or "auto") for n, w, g, b in CASES]
)
def test_blocked_matches_reference(n, window, g, block, causal, padded, dv):
    from variants.methods.sliding_window import _flash_cpu

    q, k, v = make_qkv(b=2, h=2, n_q=n, d=8, dv=dv)
    assert _flash_cpu(q, v) == (dv == 8)
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
    (700, 300, 130, True, False),  # window > tile: full tiles (no mask evaluated), global rows span a tile
]


@pytest.mark.parametrize(
    "n, window, g, causal, padded",
    FLEX_CASES,
    ids=[case_id(N=n, w=w, g=g, causal=c, pad=p) for n, w, g, c, p in FLEX_CASES],
)
def test_flex_matches_reference_forward(n, window, g, causal, padded):
    q, k, v = make_qkv(b=2, h=2, n_q=n, d=16, dtype=torch.float32, requires_grad=False)
    kpm = make_padding(2, n) if padded else None
    out = variants.build("sliding_window_flex", window=window, global_tokens=g)(
        q, k, v, causal=causal, key_padding_mask=kpm
    )
    torch.testing.assert_close(out.double(), ref_sliding_window(q, k, v, window, g, causal, kpm), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "n, window, g, causal",
    [
        (5, 2, 0, False),
        (300, 3, 2, False),
        (1000, 300, 130, True),
        (1000, 129, 0, False),
        (1024, 255, 0, True),
        (1024, 383, 200, False),
        (129, 1000, 0, False),
    ],
)
def test_flex_tile_coverage_is_the_pattern_per_tile(n, window, g, causal):
    """touched = some pair of the tile is in the pattern; full = all are (never on the ragged end)."""
    from variants.methods.sliding_window_flex import TILE, tile_coverage

    touched, full = tile_coverage(n, window, g, causal, "cpu")
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    dense = ((i - j).abs() <= window) | (i < g) | (j < g)
    if causal:
        dense = dense & (j <= i)
    tiles = -(-n // TILE)
    padded = torch.zeros(tiles * TILE, tiles * TILE, dtype=torch.bool)
    padded[:n, :n] = dense
    per_tile = padded.view(tiles, TILE, tiles, TILE).permute(0, 2, 1, 3).flatten(2)  # (T, T, TILE * TILE)
    assert torch.equal(touched, per_tile.any(-1))
    inner = tiles if n % TILE == 0 else tiles - 1  # the ragged last tile is never full
    complete = torch.zeros_like(full)
    complete[:inner, :inner] = per_tile[:inner, :inner].all(-1)
    assert torch.equal(full, complete)


def test_flex_small_head_dim_is_exact():
    """torch's compiled CPU flex kernel is wrong below D = 32 on AVX2 machines: the variant pads D."""
    q, k, v = make_qkv(b=1, h=1, n_q=24, d=8, dv=16, dtype=torch.float32, requires_grad=False)
    out = variants.build("sliding_window_flex", window=3, global_tokens=2)(q, k, v)
    assert out.shape == (1, 1, 24, 16)
    torch.testing.assert_close(out.double(), ref_sliding_window(q, k, v, 3, 2), atol=2e-5, rtol=2e-5)


def test_flex_padding_masks_do_not_recompile():
    """A new padding mask per call must reuse the compiled kernel (Dynamo's fall-back past the limit is eager, N x N)."""
    from torch._dynamo.utils import counters

    q, k, v = make_qkv(b=2, h=2, n_q=257, d=32, dtype=torch.float32, requires_grad=False)
    attn = variants.build("sliding_window_flex", window=5, global_tokens=3)
    attn(q, k, v, causal=True, key_padding_mask=make_padding(2, 257, seed=0))
    graphs = counters["stats"]["unique_graphs"]
    for seed in range(1, 12):
        kpm = make_padding(2, 257, seed=seed)
        out = attn(q, k, v, causal=True, key_padding_mask=kpm)
        torch.testing.assert_close(out.double(), ref_sliding_window(q, k, v, 5, 3, True, kpm), atol=2e-5, rtol=2e-5)
    assert counters["stats"]["unique_graphs"] == graphs


def test_flex_backward_on_cpu_is_a_clear_error():
    q, k, v = make_qkv(n_q=32, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"sliding_window_flex has no backward on cpu \(backward runs on: cuda\)"):
        variants.build("sliding_window_flex", window=4)(q, k, v)


def test_flex_spec_says_where_backward_runs():
    spec = variants.variant_class("sliding_window_flex").spec
    assert "cpu" in spec.devices and "cpu" not in spec.backward_devices


def test_flex_non_finite_check_sees_through_sums():
    """The flex wrapper's first check is one sum per input: finite inputs whose sum overflows still keep their
    output, and +inf beside -inf (a NaN sum) still poisons exactly the rows that attend them."""
    from variants.methods.sliding_window_flex import propagate_non_finite

    g = torch.Generator().manual_seed(0)
    k, v, out = (torch.randn(1, 1, 64, 32, generator=g) for _ in range(3))
    huge = torch.full((1, 1, 64, 32), 3e38)  # finite; its sum is inf
    assert torch.equal(propagate_non_finite(out, huge, k, v, 4, 0, False, None), out)
    assert torch.equal(
        propagate_non_finite(out.half(), huge.clamp_max(6e4).half(), k.half(), v.half(), 4, 0, False, None), out.half()
    )  # a float16 sum of finite values is formed in float32
    both = k.clone()
    both[0, 0, 10, 0], both[0, 0, 40, 0] = float("inf"), float("-inf")
    poisoned = propagate_non_finite(out, k, both, v, 4, 0, False, None)[0, 0].isnan().any(-1)
    want = torch.zeros(64, dtype=torch.bool)
    want[6:15] = want[36:45] = True  # |i - j| <= 4 of either key
    assert torch.equal(poisoned, want)


@pytest.mark.parametrize("n, g", [(256, 0), (250, 3)], ids=["whole-blocks", "ragged-global"])
def test_blocked_gradients_are_exact_buffers(n, g):
    """The backward's dq, dk, dv are contiguous buffers of exactly the inputs' shapes: a view of a padded
    buffer would keep the padding alive and make autograd copy it into the leaf's .grad."""
    q, k, v = make_qkv(b=1, h=2, n_q=n, d=8, dv=6)
    out = variants.build("sliding_window", window=40, global_tokens=g, block_size=32)(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for grad, x in zip(grads, (q, k, v)):
        assert grad.shape == x.shape and grad.is_contiguous()
        assert grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()


def test_blocked_written_backward_with_equal_head_dims(monkeypatch):
    """The backward written out (what runs off the CPU) with Dv = D too, where the CPU would call its flash kernels."""
    from variants.methods import sliding_window

    monkeypatch.setattr(sliding_window, "_flash_cpu", lambda q, v: False)
    for causal, g, padded in ((False, 0, False), (True, 3, True)):
        q, k, v = make_qkv(b=2, h=2, n_q=257, d=8, dv=8)
        kpm = make_padding(2, 257) if padded else None
        out = variants.build("sliding_window", window=31, global_tokens=g, block_size=16)(
            q, k, v, causal=causal, key_padding_mask=kpm
        )
        assert_close_with_grads(out, ref_sliding_window(q, k, v, 31, g, causal, kpm), (q, k, v))
