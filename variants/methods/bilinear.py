"""Bilinear ("general") attention: Luong et al. 2015, "Effective Approaches to Attention-based Neural Machine Translation".

Luong's general score puts a learned matrix between query and key, one per head:

    score(i, j) = q_i W_h k_jᵀ · scale,   out = softmax(score) V

Since q W kᵀ = (q W) kᵀ, the whole method is exact softmax attention on q' = q W: one (N, D) x (D, D)
matmul per head, then the fused SDPA kernel (full.py), so the extra memory is O(N·D) and the score
matrix is never stored. W starts as the identity, so at initialisation the variant is scaled dot
product attention (`full`) exactly; training moves it away. (Luong's "dot" score is `full` with
scale=1; his "concat" score is `additive`.)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._base import VariantSpec, dense_mask, register
from .._utils import dense_attention
from .full import FullAttention


@register
class BilinearAttention(FullAttention):
    spec = VariantSpec(
        why_no_score_bias="a bias could be added to its scores; not implemented here",
        name="bilinear",
        kind="exact",
        summary="Luong's general score q W_h kᵀ (learned D x D per head, identity at init); fused SDPA on q W",
        style=("#bcbd22", "d"),
        reference="Luong et al. 2015, 'Effective Approaches to Attention-based Neural Machine Translation'",
        time_complexity="O(Nq Nk D + Nq D^2)",
        memory_complexity="O(N D)",
        notes="needs num_heads and head_dim (W is a parameter of shape (H, D, D))",
    )

    def __init__(self, **base):
        """
        Args:
            scale: factor of the scores q W kᵀ before the softmax; None means D ** -0.5.
        """
        super().__init__(**base)
        self._require_head_shape("W is a parameter of shape (num_heads, head_dim, head_dim)")
        self.weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.copy_(torch.eye(self.head_dim).expand_as(self.weight))  # scaled dot product at init

    def project(self, q: Tensor) -> Tensor:
        """q W_h per head: (B, H, Nq, D) -> (B, H, Nq, D)."""
        return torch.matmul(q, self.weight.to(q.dtype))

    def _attend(self, q, k, v, causal, key_padding_mask):
        return super()._attend(self.project(q), k, v, causal, key_padding_mask)

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """softmax(q W kᵀ · scale) V with every score stored."""
        allowed = dense_mask(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device)
        return dense_attention(self.project(q), k, v, allowed, self._scale(q))

    def flops(self, n_q, n_k, d, dv, causal):
        return super().flops(n_q, n_k, d, dv, causal) + 2.0 * n_q * d * d

    def kernel_name(self, q, k, v, *, causal=False, backward=False):
        return super().kernel_name(self.project(q), k, v, causal=causal, backward=backward)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}"
