"""The classic score functions: Luong's bilinear q W kᵀ and Bahdanau's additive v·tanh(q W_q + k W_k),
against their dense definitions with random (trained-looking) parameters, and the tiles of additive."""

from __future__ import annotations

import pytest
import torch

import variants
from conftest import INDEPENDENT_REFERENCES, assert_close_with_grads, case_id, make_padding, make_qkv, ref_full
from helpers import peak_bytes, side_by_side


def randomized(attn, seed=0):
    """The variant with its parameters drawn at random (not their initial values), in float64."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return attn.double()


def test_bilinear_starts_as_scaled_dot_product():
    q, k, v = make_qkv(requires_grad=False)
    attn = variants.build("bilinear", num_heads=2, head_dim=8).double()
    torch.testing.assert_close(attn(q, k, v, causal=True), ref_full(q, k, v, causal=True))


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("n_q, n_k", [(13, 13), (4, 13), (1, 9)], ids=["self", "last4", "decode"])
def test_bilinear_with_a_learned_matrix(n_q, n_k, causal, padded):
    q, k, v = make_qkv(n_q=n_q, n_k=n_k, dv=5)
    kpm = make_padding(2, n_k) if padded else None
    attn = randomized(variants.build("bilinear", num_heads=2, head_dim=8))
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    ref = INDEPENDENT_REFERENCES["bilinear"](attn, q, k, v, causal, kpm)
    assert_close_with_grads(out, ref, (q, k, v, attn.weight), atol=1e-8)


TILED = [(n_q, n_k, tile) for n_q, n_k in ((13, 13), (40, 40), (7, 40), (1, 40)) for tile in (1, 4, 16)]


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("n_q, n_k, tile", TILED, ids=[case_id(Nq=a, Nk=b, tile=t) for a, b, t in TILED])
def test_additive_tiles_match_the_naive_form(monkeypatch, n_q, n_k, tile, causal, padded):
    # small tiles: many query and key tiles, causal ones skipped, rows that see nothing in a tile
    import variants.methods.additive as additive

    monkeypatch.setattr(additive, "KEY_TILE", tile)
    monkeypatch.setattr(additive, "TILE_ELEMENTS", 2 * 2 * tile * 5 * 3)  # 3 queries a tile (B = H = 2, A = 5)
    q, k, v = make_qkv(n_q=n_q, n_k=n_k, dv=6)
    kpm = make_padding(2, n_k, seed=5) if padded else None
    attn = randomized(variants.build("additive", num_heads=2, head_dim=8, attn_dim=5))
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    ref = INDEPENDENT_REFERENCES["additive"](attn, q, k, v, causal, kpm)
    assert_close_with_grads(out, ref, (q, k, v, attn.w_q, attn.w_k, attn.v), atol=1e-8)


def test_additive_scale_multiplies_the_scores():
    q, k, v = make_qkv(requires_grad=False)
    attn = randomized(variants.build("additive", num_heads=2, head_dim=8, scale=0.3))
    plain = randomized(variants.build("additive", num_heads=2, head_dim=8))
    with torch.no_grad():
        plain.v.mul_(0.3)  # score = v·tanh(...): scaling v scales the score
    torch.testing.assert_close(attn(q, k, v, causal=True), plain(q, k, v, causal=True))


def test_additive_memory_grows_linearly_not_with_the_pairs():
    # O(N²·A) time, O(N·A + tile) memory: 4x N (16x the pairs) may grow the peak about 4x, forward and backward
    mib = 2**20
    short, long = 1024, 4096  # long enough that the fixed-size tile (4 MiB) is far below N x N floats (64 MiB)
    measured = side_by_side(  # (forward and backward, two fresh processes at a time)
        [
            lambda backward=backward: peak_bytes(
                "additive", [short, long], backward, causal=[False], threads=1, num_heads=1, head_dim=32
            )
            for backward in (False, True)
        ]
    )
    for backward, peaks in zip((False, True), measured):
        assert peaks[1] <= 5 * peaks[0] + 4 * mib, (backward, [p / mib for p in peaks])
        assert peaks[1] < long * long * 32 * 4 / 32, (
            backward,
            [p / mib for p in peaks],
        )  # the naive form holds N x N x A


def test_score_functions_need_their_shapes():
    for name in ("bilinear", "additive"):
        with pytest.raises(ValueError, match=rf"{name}: options num_heads and head_dim are required"):
            variants.build(name)
    with pytest.raises(ValueError, match=r"additive: option attn_dim=0 is invalid"):
        variants.build("additive", num_heads=1, head_dim=4, attn_dim=0)
