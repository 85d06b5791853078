"""Independent dense references (float64) and input factories shared by the tests.

Nothing here imports the variants' own helpers: these are the sources of truth the variants are
compared against.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def make_qkv(b=2, h=2, n_q=16, n_k=None, d=8, dv=None, dtype=torch.float64, seed=0, requires_grad=True):
    """Random q (B,H,Nq,D), k (B,H,Nk,D), v (B,H,Nk,Dv)."""
    n_k = n_q if n_k is None else n_k
    dv = d if dv is None else dv
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, h, n_k, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, h, n_k, dv, generator=g, dtype=torch.float64).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def make_padding(b, n, seed=1, all_padded_row=True):
    """bool (B, N), True = real token; batch row 1 all padding when asked (and B > 1)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, n, generator=g) > 0.3
    if all_padded_row and b > 1:
        mask[1] = False
    return mask


def ref_attention(q, k, v, allowed=None, scale=None):
    """softmax(q kᵀ · scale) v in float64 with a bool mask; rows with nothing allowed -> 0."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # all -inf rows
    return torch.einsum("bhij,bhjd->bhid", p, v)


def causal_and_padding(n_q, n_k, causal, kpm):
    """Causal with Nq < Nk: the queries are the last Nq positions (query i at Nk - Nq + i sees j <= it)."""
    allowed = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        i = torch.arange(n_k - n_q, n_k)[:, None]
        allowed = torch.arange(n_k)[None, :] <= i
    allowed = allowed[None, None]
    if kpm is not None:
        allowed = allowed & kpm[:, None, None, :]
    return allowed


def ref_full(q, k, v, causal=False, kpm=None, scale=None):
    return ref_attention(q, k, v, causal_and_padding(q.shape[-2], k.shape[-2], causal, kpm), scale)


def ref_sliding_window(q, k, v, window, n_global=0, causal=False, kpm=None):
    n_q, n = q.shape[-2], k.shape[-2]
    i = torch.arange(n - n_q, n)[:, None]  # query positions
    j = torch.arange(n)[None, :]
    allowed = (i - j).abs() <= window
    if n_global:
        allowed = allowed | (i < n_global) | (j < n_global)
    return ref_attention(q, k, v, allowed[None, None] & causal_and_padding(n_q, n, causal, kpm))


def ref_linear(q, k, v, causal=False, kpm=None, eps=1e-6):
    """A = φ(Q) φ(K)ᵀ (masked), rows normalized by their sums + eps, times V; φ = elu + 1."""
    q, k, v = q.double(), k.double(), v.double()
    a = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)
    a = a * causal_and_padding(q.shape[-2], k.shape[-2], causal, kpm)
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def ref_memory_compressed(q, k, v, module, causal=False, kpm=None):
    """The module's conv applied with F.conv1d (groups = heads), then dense attention with the slot mask."""
    b, h, n, d = k.shape
    c = module.compression
    k, v = k.double(), v.double()
    if kpm is not None:
        k = k * kpm[:, None, :, None]
        v = v * kpm[:, None, :, None]
    pad = (-n) % c

    def conv(x, weight, bias):
        x = F.pad(x, (0, 0, 0, pad))  # (B, H, N', D)
        bx, hx, nx, dx = x.shape
        y = F.conv1d(x.permute(0, 1, 3, 2).reshape(bx, hx * dx, nx), weight.double(), bias.double(), stride=c, groups=hx)
        return y.view(bx, hx, -1, y.shape[-1]).permute(0, 1, 3, 2)  # (B, H, M, Dout)

    kc, vc = conv(k, module.k_weight, module.k_bias), conv(v, module.v_weight, module.v_bias)
    m = kc.shape[2]
    real = torch.ones(b, n + pad, dtype=torch.bool)
    real[:, n:] = False
    if kpm is not None:
        real[:, :n] = kpm
    slot_ok = real.view(b, m, c).any(-1)  # a slot of padding only is masked
    n_q = q.shape[-2]
    if not causal:
        return ref_attention(q, kc, vc, slot_ok[:, None, None, :].expand(b, 1, n_q, m))
    i = torch.arange(n - n_q, n)[:, None]  # query positions: the last Nq
    visible_slot = ((torch.arange(m)[None, :] + 1) * c - 1 <= i)[None, None] & slot_ok[:, None, None, :]
    j = torch.arange(n)[None, :]
    own_block = ((j >= ((i + 1) // c) * c) & (j <= i))[None, None]
    if kpm is not None:
        own_block = own_block & kpm[:, None, None, :]
    keys, values = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
    return ref_attention(q, keys, values, torch.cat([visible_slot.expand(b, 1, n_q, m), own_block.expand(b, 1, n_q, n)], -1))


def assert_close_with_grads(out, ref, inputs, atol=1e-9, rtol=1e-7, seed=3):
    """Outputs equal, and the gradients of a random projection of them equal, for every input."""
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    inputs = [t for t in inputs if t.requires_grad]
    got = torch.autograd.grad(out, inputs, grad_out.to(out.dtype), retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(ref, inputs, grad_out.to(ref.dtype), allow_unused=True)
    for i, (a, b) in enumerate(zip(got, want)):
        a = torch.zeros_like(inputs[i]) if a is None else a
        b = torch.zeros_like(inputs[i]) if b is None else b
        torch.testing.assert_close(a.double(), b.double(), atol=atol * 10, rtol=rtol * 10, msg=lambda m: f"grad of input {i}: {m}")


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from torch's seed 0 (the thread count is left as torch set it)."""
    torch.manual_seed(0)
    yield


def case_id(**kw) -> str:
    """Readable parametrize ids: N257-w64-causal."""
    parts = []
    for key, val in kw.items():
        if isinstance(val, bool):
            if val:
                parts.append(key)
        else:
            parts.append(f"{key}{val}")
    return "-".join(parts) or "base"
