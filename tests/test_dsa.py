"""DeepSeek Sparse Attention's two ways of reading the chosen keys (every key scored and masked, or the chosen
gathered) against its definition computed query by query (conftest's reference), outputs and gradients."""

import pytest
import torch

import variants
from variants.methods import dsa

from conftest import independent_reference


@pytest.mark.parametrize("span", [0, 10**9], ids=["gathered", "dense"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_both_paths_equal_the_definition(monkeypatch, span, kv_heads):
    monkeypatch.setattr(dsa, "DENSE_SPAN", span)
    torch.manual_seed(0)
    attn = variants.build("dsa", num_heads=4, head_dim=8, num_kv_heads=kv_heads, top_k=5, index_heads=2, block=6)
    with torch.no_grad():
        attn.indexer.w_q.normal_(), attn.indexer.w_k.normal_(), attn.indexer.u.normal_()
    attn = attn.double()
    q = torch.randn(2, 4, 23, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 23, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pad = torch.ones(2, 23, dtype=torch.bool)
    pad[1, 3:9] = False
    grad = torch.randn(2, 4, 23, 8, dtype=torch.float64)
    got = attn(q, k, v, causal=True, key_padding_mask=pad)
    want = independent_reference("dsa", attn, q, k, v, True, pad)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_the_gate_reaches_queries_with_more_keys_than_top_k():
    attn = variants.build("dsa", num_heads=2, head_dim=8, top_k=100, block=16)
    n = attn.check_length(10)
    assert n > attn.top_k + attn.block  # the last block's queries choose among more keys than top_k


def test_the_indexer_warm_up_is_the_kl_to_the_dense_attention_query_by_query():
    """transfer_loss against its definition, one query at a time (float64); then a few steps of it on the
    indexer alone bring the chosen keys' output closer to dense softmax (DeepSeek-V3.2's dense warm-up)."""
    torch.manual_seed(0)
    attn = variants.build("dsa", num_heads=4, head_dim=8, num_kv_heads=2, top_k=3, index_heads=2, block=4).double()
    with torch.no_grad():
        attn.indexer.w_q.normal_(), attn.indexer.w_k.normal_(), attn.indexer.u.normal_()
    q, k, v = torch.randn(1, 4, 12, 8, dtype=torch.float64), *torch.randn(2, 1, 2, 12, 8, dtype=torch.float64)
    want = []
    index = attn.indexer.scores(q.unflatten(1, (2, 2)).mean(2), attn.indexer.keys(k))  # (its own test: above)
    for g in range(2):
        for t in range(12):
            p = sum(torch.softmax(q[0, h, t] @ k[0, g, : t + 1].T * 8**-0.5, -1) for h in (2 * g, 2 * g + 1)) / 2
            want.append((p * (p.log() - torch.log_softmax(index[0, g, t, : t + 1], -1))).sum())
    torch.testing.assert_close(attn.transfer_loss(q, k, v, None), torch.stack(want).mean())

    full = variants.build("full")(q, k, v, causal=True)
    error = lambda: float((attn(q, k, v, causal=True) - full).pow(2).mean().detach())  # noqa: E731
    before, first = error(), float(attn.transfer_loss(q, k, v, None).detach())
    optimizer = torch.optim.Adam(attn.indexer.parameters(), lr=0.05)
    for _ in range(100):
        optimizer.zero_grad()
        attn.transfer_loss(q, k, v, None).backward()
        optimizer.step()
    assert float(attn.transfer_loss(q, k, v, None).detach()) < 0.5 * first
    assert error() < before
