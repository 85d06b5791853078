"""Textbook softmax attention, softmax(Q Kᵀ · scale) V, materializing the Nq × Nk score matrix.

The O(N²)-memory baseline every efficient method is charted against (Vaswani et al. 2017).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._base import AttentionVariant, VariantSpec, causal_mask, distances, register
from .._utils import masked_softmax
from .full import full_attention_pairs


@register
class NaiveFullAttention(AttentionVariant):
    spec = VariantSpec(
        name="full_naive",
        kind="exact",
        summary="exact softmax attention, textbook form: the Nq x Nk score matrix is materialized",
        style=("#7f7f7f", "x"),
        reference="Vaswani et al. 2017, 'Attention Is All You Need'",
        time_complexity="O(Nq Nk D)",
        memory_complexity="O(Nq Nk) per head",
        same_function_as="full",
        carries_score_bias=True,
    )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None, score_bias=None
    ) -> Tensor:
        # 16-bit inputs: the scores are formed in float32 (as fused kernels accumulate them); a bf16
        # product of large logits is off by whole units before the softmax sees it
        q32, k32 = (q.float(), k.float()) if q.dtype in (torch.float16, torch.bfloat16) else (q, k)
        groups = q.shape[1] // k.shape[1]  # grouped-query: query heads h of group h // groups share a K/V head
        if groups > 1:
            q32 = q32.unflatten(1, (k.shape[1], groups))  # (B, Hkv, G, Nq, D)
            k32, v = k32[:, :, None], v[:, :, None]  # (B, Hkv, 1, Nk, ·): read by the group, never copied
        scores = torch.matmul(q32, k32.transpose(-1, -2)) * self._scale(q)  # (B, H, Nq, Nk) or (B, Hkv, G, Nq, Nk)
        if score_bias is not None:  # (H, Nq, Nk), grouped as the scores are
            bias = score_bias(distances(*scores.shape[-2:], q.device), causal).to(scores.dtype)
            scores = scores + (bias.unflatten(0, (k.shape[1], groups)) if groups > 1 else bias)
        allowed = None
        if causal:
            allowed = causal_mask(*scores.shape[-2:], q.device)  # (Nq, Nk), bottom-right aligned
        if key_padding_mask is not None:
            pad = key_padding_mask.view(key_padding_mask.shape[0], *[1] * (scores.dim() - 2), -1)  # (B, 1, ..., 1, Nk)
            allowed = pad if allowed is None else allowed & pad
        weights = masked_softmax(scores, allowed).to(v.dtype)  # rows with no allowed key are all zeros
        out = torch.matmul(weights, v)
        return out.flatten(1, 2) if groups > 1 else out

    def flops(self, n_q: int, n_k: int, d: int, dv: int, causal: bool) -> float:
        # the textbook form computes every score, masked or not
        return 2.0 * full_attention_pairs(n_q, n_k, False) * (d + dv)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        # scores, exp and weights (+ their gradients in backward), each Nq x Nk per head
        scores = batch * heads * n_q * n_k * max(element_size, 4)
        return int(
            scores * (6 if backward else 3)
            + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward)
        )
