"""Causal attention with Nq <= Nk: the queries are the last Nq positions (bottom-right alignment).

Query i sits at position Nk - Nq + i and sees the keys up to it — the convention of FlashAttention
>= 2.1 and transformers, and what decoding with a KV cache needs (Nq = 1). Every variant is checked
against the float64 references of conftest (outputs and gradients) and against its own `reference`.
"""

from __future__ import annotations

import pytest
import torch

import variants
from conftest import (
    assert_close_with_grads,
    build_case,
    independent_reference,
    make_padding,
    make_qkv,
    ref_sliding_window,
    registry_cases,
)

N_K = 13
CASES = registry_cases(
    causal=True
)  # every registered causal CPU variant with a backward, with each example of its spec


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("n_q", [1, 3, 7, N_K])
@pytest.mark.parametrize("name, options", CASES)
def test_last_queries_match_the_references(name, options, n_q, padded):
    attn = build_case(name, options)
    q, k, v = make_qkv(b=2, h=2, n_q=n_q, n_k=N_K, d=8)
    kpm = make_padding(2, N_K, seed=4) if padded else None  # batch row 1: every key padded
    out = attn(q, k, v, causal=True, key_padding_mask=kpm)
    assert out.shape == (2, 2, n_q, 8)
    assert torch.isfinite(out).all()
    assert_close_with_grads(out, independent_reference(name, attn, q, k, v, causal=True, kpm=kpm), (q, k, v))
    torch.testing.assert_close(out, attn.reference(q, k, v, causal=True, key_padding_mask=kpm))


@pytest.mark.parametrize("name, options", CASES)
def test_decoding_one_position_at_a_time_equals_the_whole_sequence(name, options):
    # what generate() with a KV cache does: each step, the newest query against every key so far
    attn = build_case(name, options)
    q, k, v = make_qkv(b=1, h=2, n_q=N_K, d=8, requires_grad=False)
    whole = attn(q, k, v, causal=True)
    steps = torch.cat(
        [attn(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], causal=True) for i in range(N_K)], 2
    )
    torch.testing.assert_close(steps, whole)


def test_flex_last_queries_match_the_reference():
    # forward only on the CPU: Nq = 3 against 13 keys (w = 3: the last 6 keys are kept), and decoding one
    # position at a time, where every step has the same shape (w + 1 keys, padded ones masked while
    # fewer exist): one compilation for all of them, not one per step
    attn = variants.build("sliding_window_flex", window=3)
    q, k, v = make_qkv(b=2, h=2, n_q=3, n_k=N_K, d=8, dtype=torch.float32, requires_grad=False)
    kpm = make_padding(2, N_K, seed=4)
    out = attn(q, k, v, causal=True, key_padding_mask=kpm)
    torch.testing.assert_close(
        out.double(), ref_sliding_window(q, k, v, 3, 0, causal=True, kpm=kpm), atol=2e-5, rtol=2e-5
    )
    shapes = []
    inner = attn._attend_self
    attn._attend_self = lambda q_, *rest: shapes.append(tuple(q_.shape)) or inner(q_, *rest)
    for i in range(N_K):
        step = attn(q[:, :, -1:], k[:, :, : i + 1], v[:, :, : i + 1], causal=True, key_padding_mask=kpm[:, : i + 1])
        want = ref_sliding_window(
            q[:, :, -1:], k[:, :, : i + 1], v[:, :, : i + 1], 3, 0, causal=True, kpm=kpm[:, : i + 1]
        )
        torch.testing.assert_close(step.double(), want, atol=2e-5, rtol=2e-5)
    assert set(shapes[1:]) == {(2, 2, 4, 8)}  # (the first step, Nq = Nk = 1, is a prompt of one token)


@pytest.mark.parametrize("name", ["full", "sliding_window", "linear"])
def test_more_queries_than_keys_with_causal_is_a_clear_error(name):
    attn = variants.build(name)
    q, _, _ = make_qkv(b=1, h=1, n_q=6, d=4, requires_grad=False)
    _, k, v = make_qkv(b=1, h=1, n_q=4, d=4, requires_grad=False)
    with pytest.raises(
        ValueError,
        match=rf"{name}: causal=True needs Nq <= Nk \(the queries are the last Nq of the Nk positions\), got Nq=6, Nk=4",
    ):
        attn(q, k, v, causal=True)
