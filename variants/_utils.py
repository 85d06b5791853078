"""Small helpers shared by the variants."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def pad_to_multiple(x: Tensor, multiple: int, dim: int = -2, value: float = 0.0) -> tuple[Tensor, int]:
    """Pad `x` along `dim` up to a multiple of `multiple`; returns (padded, pad_amount)."""
    n = x.shape[dim]
    pad = (-n) % multiple
    if pad == 0:
        return x, 0
    dim = dim % x.dim()
    widths = [0, 0] * (x.dim() - dim - 1) + [0, pad]
    return F.pad(x, widths, value=value), pad


def spans(n: int, size: int) -> list[slice]:
    """Slices of [0, n) of `size` positions each (the last may be shorter): the groups, tiles and chunks
    the variants take a sequence in."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def masked_softmax(scores: Tensor, allowed: Tensor | None, dim: int = -1) -> Tensor:
    """Softmax over `dim` where `allowed` is False gives weight 0; a row with nothing allowed gives all zeros.

    Half-precision scores are normalized in float32 and returned in their own dtype.
    """
    s = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    row_max = s.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    p = torch.exp(s - row_max)
    p = p / p.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    return p.to(scores.dtype)


def dead_query_rows(key_padding_mask: Tensor | None, n_q: int, causal: bool) -> Tensor | None:
    """(B, Nq) bool: queries that may see no key at all (every key padded, or, causal, every key up to
    the query's position padded; query i sits at Nk - Nq + i).

    For full attention these rows have an empty softmax; the variants return zeros there.
    None when no row can be dead.
    """
    if key_padding_mask is None:
        return None
    if causal:  # query i sees keys j <= Nk - Nq + i: dead while no real token has appeared yet
        n_k = key_padding_mask.shape[-1]
        dead = key_padding_mask.cumsum(dim=-1)[:, n_k - n_q :] == 0
    else:
        dead = ~key_padding_mask.any(dim=-1, keepdim=True).expand(-1, n_q)
    if torch.compiler.is_compiling():  # traced (torch.export, torch.compile, ONNX): no branch on the data
        return dead
    return dead if bool(dead.any()) else None


def zero_rows(out: Tensor, dead: Tensor | None) -> Tensor:
    """Zero the output rows of dead queries; `out` is (B, H, Nq, Dv), `dead` (B, Nq) or None."""
    if dead is None:
        return out
    return out.masked_fill(dead[:, None, :, None], 0.0)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    """softmax(q kᵀ · scale, masked by `allowed`) v, materializing every score: for checks at small N only.

    allowed: bool, broadcastable to (B, H, Nq, Nk), or None. Rows with nothing allowed give zeros. k and v of
    fewer heads than q (grouped-query) serve groups of H / Hkv query heads (query head h reads h // (H / Hkv)).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads:  # (B, Hkv, G, Nq, ·) against (B, Hkv, 1, Nk, ·): no repeated K, V
        q, k, v = q.unflatten(1, (kv_heads, heads // kv_heads)), k[:, :, None], v[:, :, None]
        if allowed is not None and allowed.dim() >= 3:
            allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
            allowed = allowed.unflatten(1, (kv_heads, -1)) if allowed.shape[1] == heads else allowed[:, :, None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    out = torch.matmul(masked_softmax(scores, allowed), v)
    return out if kv_heads == heads else out.flatten(1, 2)
