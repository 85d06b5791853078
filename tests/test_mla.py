"""mla beyond the registry's contract (reference, gradients, decoding = forward, GQA: tests/test_interface.py and
tests/test_recurrent.py run every example): `fit` recovers keys and values of rank at most latent_dim exactly, so
the layer is then exact softmax attention; the decoding state is latent_dim + Hkv · rope_dim numbers a position,
a quarter of the KV cache by default; bad options named."""

from __future__ import annotations

import pytest
import torch

import variants


def test_fit_makes_low_rank_keys_and_values_exact():
    torch.manual_seed(0)
    attn = variants.build("mla", num_heads=4, head_dim=8, num_kv_heads=2, latent_dim=6, rope_dim=2).double()
    mix = torch.randn(6, 2 * (2 * 8 - 2), dtype=torch.float64)  # [k̂, v] of rank 6; the kept key dims free
    joint = torch.randn(3, 20, 6, dtype=torch.float64) @ mix
    k = torch.randn(3, 2, 20, 8, dtype=torch.float64)
    rest = attn.rest
    k[..., rest] = joint[..., : 2 * 6].view(3, 20, 2, 6).transpose(1, 2)
    v = joint[..., 2 * 6 :].view(3, 20, 2, 8).transpose(1, 2)
    assert attn.fit(k, v) == pytest.approx(1.0)
    q = torch.randn(3, 4, 20, 8, dtype=torch.float64)
    full = variants.build("full")
    torch.testing.assert_close(attn(q, k, v, causal=True), full(q, k, v, causal=True))
    state = attn.prefill(
        q[:, :, :19], k[:, :, :19], v[:, :, :19], attn.init_state(3, 4, 8, 8, torch.float64, kv_heads=2)
    )
    out, after = attn.step(q[:, :, 19:], k[:, :, 19:], v[:, :, 19:], state)  # the absorbed form
    torch.testing.assert_close(out, full(q, k, v, causal=True)[:, :, 19:])
    empty = attn.init_state(3, 4, 8, 8, torch.float64, kv_heads=2)
    out, _ = attn.step(
        q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], attn.prefill(q[:, :, :4], k[:, :, :4], v[:, :, :4], empty)
    )
    torch.testing.assert_close(out, full(q, k, v, causal=True)[:, :, 4:])  # 16 new queries: expanded (4·16 > 2·2·8)


def test_the_state_is_a_quarter_of_the_kv_cache_by_default():
    """SmolLM2-135M's shape (9 query heads, 3 K/V heads of 64 dims) at 8192 positions."""
    attn = variants.build("mla", num_heads=9, head_dim=64, num_kv_heads=3)
    kv = variants.build("full").init_state(1, 9, 64, 64, kv_heads=3)
    state = attn.init_state(1, 9, 64, 64, kv_heads=3)
    x = lambda h: torch.zeros(1, h, 8192, 64)  # noqa: E731
    state = attn.prefill(x(9), x(3), x(3), state)
    kv = variants.build("full").prefill(x(9), x(3), x(3), kv)
    assert state.nbytes() * 4 == kv.nbytes() == 8192 * 2 * 3 * 64 * 4


def test_bad_options_are_named():
    for options, match in (
        ({"latent_dim": 129}, r"latent_dim=129 is invalid; expected at most Hkv · D = 2 · 64 = 128"),
        ({"rope_dim": 3}, r"rope_dim=3 is invalid; expected an even int in 0..64"),
    ):
        with pytest.raises(ValueError, match=match):
            variants.build("mla", num_heads=4, head_dim=64, num_kv_heads=2, **options)
    with pytest.raises(ValueError, match=r"num_heads and head_dim are required"):
        variants.build("mla")


def test_mqar_probe_lossless_layout_starts_as_softmax():
    """scripts/mla_mqar_probe.py's lossless layout (a square orthonormal basis past the variant's own bound) passes
    keys and values through exactly before training: the probe's claim that a failure there is training's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "mla_mqar_probe.py"
    spec = importlib.util.spec_from_file_location("mla_mqar_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    torch.manual_seed(0)
    attn = variants.build("mla", num_heads=2, head_dim=8).double()
    probe.lossless(attn)
    assert attn.latent_dim == 2 * 2 * 8 and attn.down.shape == (32, 32)
    q, k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    full = variants.build("full")
    torch.testing.assert_close(attn(q, k, v, causal=True), full(q, k, v, causal=True))
