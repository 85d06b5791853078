"""The 2025-26 methods against flash-linear-attention's own plain-PyTorch references (`fla/ops/*/naive.py`),
loaded from their files so fla's Triton kernels are never imported (fla-core installs --no-deps: .ci/run).

Each method's gates are read from the variant and handed to fla's function with the same q, k, v (fla's
layers compute them around these kernels): the two must agree to 1e-5 in float32, grouped-query included."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import variants


def fla_naive(op: str):
    """The module fla/ops/<op>/naive.py, executed on its own (skips where fla-core or einops is missing)."""
    pytest.importorskip("einops")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (pip install --no-deps fla-core==0.5.2 einops)")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / op / "naive.py"
    module_spec = importlib.util.spec_from_file_location(f"fla_naive_{op}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def bthd(x):
    return x.transpose(1, 2).contiguous()  # (B, H, T, D) -> fla's (B, T, H, D)


@pytest.mark.parametrize("fused_span", [64.0, 0.0])  # one fused call, and query blocks with their own biases
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_forgetting_agrees_with_fla(kv_heads, fused_span):
    naive = fla_naive("forgetting_attn").naive_forgetting_attn
    torch.manual_seed(0)
    attn = variants.build(
        "forgetting", num_heads=4, head_dim=16, num_kv_heads=kv_heads, gate_bias=1.0, block=7, fused_span=fused_span
    )
    with torch.no_grad():
        attn.gate.w.mul_(10)  # (gates that differ by position)
    q = torch.randn(2, 4, 40, 16)
    k, v = torch.randn(2, kv_heads, 40, 16), torch.randn(2, kv_heads, 40, 16)
    ours = attn(q, k, v, causal=True)
    with torch.no_grad():
        g = attn.log_forget(k).repeat_interleave(4 // kv_heads, 1)  # fla takes the gate per query head
        theirs = naive(bthd(q), bthd(k), bthd(v), g.transpose(1, 2), scale=16**-0.5)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_kda_agrees_with_fla(kv_heads):
    """Our chunked KDA against fla's step-by-step naive_recurrent_kda on the recurrence's own inputs (the
    normalised q, k, the per-channel log decay and β: fla's layer computes those around its kernel)."""
    naive = fla_naive("kda").naive_recurrent_kda
    torch.manual_seed(0)
    attn = variants.build("kda", num_heads=4, head_dim=16, num_kv_heads=kv_heads, chunk_size=8)
    with torch.no_grad():
        attn.decay.w.mul_(30)  # (decays that differ by channel and position)
    q = torch.randn(2, 4, 40, 16)
    k, v = torch.randn(2, kv_heads, 40, 16), torch.randn(2, kv_heads, 40, 16)
    ours = attn(q, k, v, causal=True)
    with torch.no_grad():
        x = attn.recurrence_inputs(q, k, v)
        per_q = {n: x[n].repeat_interleave(4 // kv_heads, 1) for n in ("k", "v", "log_decay", "beta")}
        theirs, _ = naive(
            bthd(x["q"]),
            bthd(per_q["k"]),
            bthd(per_q["v"]),
            per_q["log_decay"].transpose(1, 2),
            per_q["beta"].transpose(1, 2),
            scale=x["scale"],
        )
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_dsa_agrees_with_fla():
    """DeepSeek Sparse Attention as DeepSeek runs it (one K/V head, MQA): fla's naive_dsa_indexer picks the same
    keys wherever the choice is not a tie among the ReLU's zeros, and naive_dsa over our selection gives our
    outputs."""
    naive = fla_naive("dsa")
    torch.manual_seed(0)
    attn = variants.build("dsa", num_heads=4, head_dim=16, num_kv_heads=1, top_k=4, index_heads=2, index_dim=8, block=7)
    with torch.no_grad():
        attn.indexer.w_q.normal_(), attn.indexer.w_k.normal_(), attn.indexer.w0.fill_(1.0)  # (positive weights)
    q, k, v = torch.randn(2, 4, 40, 16), torch.randn(2, 1, 40, 16), torch.randn(2, 1, 40, 16)
    ours = attn(q, k, v, causal=True)
    with torch.no_grad():
        index, valid = attn.selected(q, k)
        ix = attn.indexer
        q_mean = q.mean(1)  # (B, T, D): the K/V head's group is every query head
        q_idx = torch.einsum("btd,jde->btje", q_mean, ix.w_q[0])
        w_idx = torch.einsum("btd,jd->btj", q_mean, ix.u[0]) + ix.w0[0]
        theirs_index = naive.naive_dsa_indexer(q_idx, k[:, 0] @ ix.w_k[0], w_idx, topk=4, activation="relu")
        scores = ix.scores(q.mean(1, keepdim=True), ix.keys(k))[:, 0]  # (B, T, T)
        kth = scores.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), -torch.inf).topk(4, -1).values[..., -1]
        clear = kth > 0  # rows whose fourth-best key scores above the zeros
        assert clear.sum() > 40
        assert torch.equal(index[:, 0].sort(-1).values[clear], theirs_index.sort(-1).values[clear])
        given = index[:, 0].masked_fill(~valid[:, 0], -1)
        theirs = naive.naive_dsa(bthd(q), bthd(k), bthd(v), None, None, indices=given, topk=4, scale=16**-0.5)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_rwkv7_agrees_with_fla(kv_heads):
    """RWKV-7 against fla's generalised delta rule (dplr_recurrence: S_t = (diag(exp gk_t) + β_t α_tᵀ) S_{t-1} +
    k_t v_tᵀ, q scaled by D^-½ inside), with RWKV-7's α = −κ̂ and β = a ⊙ κ̂ (as fla's RWKV-7 layer passes them)."""
    naive = fla_naive("generalized_delta_rule/dplr").dplr_recurrence
    torch.manual_seed(0)
    attn = variants.build("rwkv7", num_heads=4, head_dim=16, num_kv_heads=kv_heads, group=7, chunk_size=3)
    with torch.no_grad():
        attn.gates.w_w.mul_(10), attn.gates.w_a.mul_(10), attn.gates.xi.uniform_(0.5, 1.5)
    q = torch.randn(2, 4, 40, 16)
    k, v = torch.randn(2, kv_heads, 40, 16), torch.randn(2, kv_heads, 40, 16)
    ours = attn(q, k, v, causal=True)
    with torch.no_grad():
        log_w, a, removal = (x.repeat_interleave(4 // kv_heads, 1) for x in attn.gates(k))
        kq, vq = k.repeat_interleave(4 // kv_heads, 1), v.repeat_interleave(4 // kv_heads, 1)
        theirs, _ = naive(q, kq, vq, -removal, a * removal, log_w)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_log_linear_agrees_with_fla(kv_heads):
    """Log-linear Mamba-2 against fla's naive_log_linear_attn (its H matrix: the decay times λ at the Fenwick
    level of each pair) on the same scaled q, k, Δ-scaled v, log decay and level weights."""
    naive = fla_naive("log_linear_attn").naive_log_linear_attn
    torch.manual_seed(0)
    attn = variants.build("log_linear", num_heads=4, head_dim=16, num_kv_heads=kv_heads, chunk_size=8, levels=7)
    with torch.no_grad():
        attn.w_level.mul_(20)  # (level weights that differ by query and level)
    q = torch.randn(2, 4, 40, 16)
    k, v = torch.randn(2, kv_heads, 40, 16), torch.randn(2, kv_heads, 40, 16)
    ours = attn(q, k, v, causal=True)
    with torch.no_grad():
        qg, ks, vs, log_a, lam = attn._inputs(q, k, v, None)
        rep = lambda x: x.repeat_interleave(4 // kv_heads, 1)  # noqa: E731  (fla: one head axis)
        theirs = naive(
            bthd(qg.flatten(1, 2)), bthd(rep(ks)), bthd(rep(vs)), rep(log_a).transpose(1, 2), bthd(lam.flatten(1, 2))
        )
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=1e-5, rtol=1e-5)
