"""Exact softmax attention through PyTorch's fused kernel (`scaled_dot_product_attention`).

softmax(Q Kᵀ · scale) V, computed by the fused SDPA kernel (FlashAttention-style on CPU and CUDA),
so the Nq × Nk score matrix is never stored: extra memory is linear in N, time quadratic.
Vaswani et al. 2017, "Attention Is All You Need"; Dao et al. 2022, "FlashAttention".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._base import AttentionVariant, VariantSpec, causal_mask, dense_mask, distances, register
from .._utils import dead_query_rows, zero_rows


def full_attention_pairs(n_q: int, n_k: int, causal: bool) -> int:
    """Number of (query, key) pairs exact attention scores: all of them, or (causal, queries the last Nq
    of the Nk positions) the keys up to each query."""
    return n_q * (n_k - n_q) + n_q * (n_q + 1) // 2 if causal else n_q * n_k


def padding_and_causal_mask(key_padding_mask: Tensor, n_q: int, causal: bool, dead: Tensor | None) -> Tensor:
    """Bool mask for SDPA-style kernels, True = may attend: (B, 1, 1, Nk), or (B, 1, Nq, Nk) when causal.

    Dead query rows (no key to see) are opened to every key so no kernel produces NaN;
    the caller zeroes those rows afterwards.
    """
    mask = key_padding_mask[:, None, None, :]  # (B, 1, 1, Nk)
    if causal:  # the only case that needs a full Nq x Nk mask (bool, one byte a pair)
        mask = mask & causal_mask(n_q, key_padding_mask.shape[-1], key_padding_mask.device)  # (B, 1, Nq, Nk)
    if dead is not None:
        mask = mask | dead[:, None, :, None]
    return mask


CPU_FLASH_MIN_KEYS = (
    16  # below this many keys torch's CPU flash kernel (2.13) gives zeros, not NaN, for a NaN score row
)


def sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """`scaled_dot_product_attention` that keeps to the fused kernel when D != Dv, and propagates NaN.

    The CPU flash kernel needs one head dim for q, k and v; otherwise torch falls back to the math
    kernel, which materializes the score matrix. Zero-padding the smaller of D, Dv changes no score
    and no output value, only which kernel runs. Over fewer than CPU_FLASH_MIN_KEYS keys on the CPU
    the scores (at most Nq x 15) are computed as written instead: that kernel returns zeros there for
    a row whose scores hold NaN.
    """
    if q.device.type == "cpu" and k.shape[-2] < CPU_FLASH_MIN_KEYS:
        return written_out(q, k, v, **kwargs)
    if k.shape[1] != q.shape[1]:  # grouped-query: the kernel reads each K/V head for its group of query heads
        kwargs["enable_gqa"] = True
    d, dv = q.shape[-1], v.shape[-1]
    if d == dv:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    kwargs.setdefault("scale", d**-0.5)
    if d < dv:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    else:
        v = F.pad(v, (0, d - dv))
    return F.scaled_dot_product_attention(q, k, v, **kwargs)[..., :dv]


def written_out(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """`scaled_dot_product_attention`'s function with its scores stored (is_causal aligned top-left, as SDPA's; a
    bool mask True = may attend, a float mask added; k, v of Hkv heads serve groups of q's): for short key
    sequences only."""
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    b, h, n_q, d = q.shape
    qg = q.view(b, k.shape[1], h // k.shape[1], n_q, d)  # (B, Hkv, G, Nq, D): each K/V head's group of query heads
    s = torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -torch.inf)
    if attn_mask is not None:
        mask = attn_mask
        if attn_mask.dim() == 4:  # (B|1, H|1, Nq, Nk) -> (B|1, Hkv|1, G|1, Nq, Nk), as the scores are grouped
            per_head = attn_mask.shape[1] == h and h > 1
            groups = (k.shape[1], h // k.shape[1]) if per_head else (1, 1)
            mask = attn_mask.view(attn_mask.shape[0], *groups, *attn_mask.shape[2:])
        s = s.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else s + mask
    return torch.matmul(torch.softmax(s, dim=-1), v[:, :, None]).flatten(1, 2).to(dtype)


def biased_sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask, score_bias, scale: float) -> Tensor:
    """Exact attention with score_bias(distance) added to the scores: the bias and the masks (-inf) as one float
    (B|1, H, Nq, Nk) mask of the fused kernel, which differentiates it (a learned bias trains)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    bias = score_bias(distances(n_q, n_k, q.device), causal).to(q.dtype)[None]  # (1, H, Nq, Nk)
    allowed = dense_mask(n_q, n_k, causal, key_padding_mask, q.device)  # (B|1, 1, Nq, Nk) or None
    dead = dead_query_rows(key_padding_mask, n_q, causal)
    if allowed is not None:
        if dead is not None:  # rows with no key to see: opened to every key, zeroed after
            allowed = allowed | dead[:, None, :, None]
        bias = bias.masked_fill(~allowed, float("-inf"))
    return zero_rows(sdpa(q, k, v, attn_mask=bias, scale=scale), dead)


@register
class FullAttention(AttentionVariant):
    spec = VariantSpec(
        position_study=True,
        name="full",
        kind="exact",
        family="exact softmax",
        baseline=True,
        lm_defaults=((),),
        summary="exact softmax attention, fused SDPA kernel (scores never stored)",
        style=("#1f77b4", "o"),
        reference="Vaswani et al. 2017; torch.nn.functional.scaled_dot_product_attention",
        time_complexity="O(Nq Nk D)",
        memory_complexity="O(N D) (key padding with causal, or causal with 1 < Nq < Nk: an Nq x Nk bool mask; "
        "a score bias: an H x Nq x Nk float mask)",
        carries_score_bias=True,
    )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None, score_bias=None
    ) -> Tensor:
        scale = self._scale(q)
        if score_bias is not None:
            return biased_sdpa(q, k, v, causal, key_padding_mask, score_bias, scale)
        n_q, n_k = q.shape[-2], k.shape[-2]
        if key_padding_mask is None:
            if causal and n_q == 1:  # the last position sees every key
                return sdpa(q, k, v, scale=scale)
            if causal and n_q != n_k:  # SDPA's is_causal aligns top-left; the interface's causal is bottom-right
                return sdpa(q, k, v, attn_mask=causal_mask(n_q, n_k, q.device), scale=scale)
            return sdpa(q, k, v, is_causal=causal, scale=scale)
        dead = dead_query_rows(key_padding_mask, q.shape[-2], causal)
        mask = padding_and_causal_mask(key_padding_mask, q.shape[-2], causal, dead)
        out = sdpa(q, k, v, attn_mask=mask, scale=scale)
        return zero_rows(out, dead)

    def flops(self, n_q: int, n_k: int, d: int, dv: int, causal: bool) -> float:
        return 2.0 * full_attention_pairs(n_q, n_k, causal) * (d + dv)

    def kernel_name(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, backward: bool = False
    ) -> str | None:
        """The SDPA backend torch picks for this call without a mask (flash, efficient, cudnn, math...)."""
        from torch.nn.attention import SDPBackend

        with torch.set_grad_enabled(backward):
            choice = torch._fused_sdp_choice(q, k, v, is_causal=causal, scale=self._scale(q))
        names = {
            int(b): b.name
            for b in (
                SDPBackend.ERROR,
                SDPBackend.MATH,
                SDPBackend.FLASH_ATTENTION,
                SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.CUDNN_ATTENTION,
                SDPBackend.OVERRIDEABLE,
            )
        }
        return names.get(int(choice), str(choice)).lower()
