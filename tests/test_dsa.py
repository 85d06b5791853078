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
