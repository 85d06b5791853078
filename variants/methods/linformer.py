"""Linformer: Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity".

The N x N attention matrix is close to low rank, so keys and values are projected along the
sequence to k = `rank` rows by learned matrices E_h, F_h (one pair per head):

    out = softmax(Q (E_h K)ᵀ · scale) (F_h V),   E_h, F_h: (rank, N)

E and F are parameters of shape (H, rank, max_len); a call of N keys uses their first N columns.
Time O(N·rank·D), extra memory O(N·D + rank·D) (the fused SDPA kernel over rank keys; the N x rank
scores are never stored). Padded keys are zeroed before the projection, so they add nothing to
any row of E K or F V.

Not causal: every projected row mixes all N positions, future ones included (the paper's method
is for encoders). Cross-attention (Nq != Nk) works: only the keys are projected.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, register
from .._utils import dead_query_rows, dense_attention, zero_rows
from .full import full_attention_pairs, sdpa


@register
class Linformer(AttentionVariant):
    spec = VariantSpec(
        name="linformer",
        kind="low-rank and compressed",
        repeats_kv="E and F, its projections of K and V along N, are learned per query head",
        summary="keys and values projected along N to `rank` rows by learned E, F per head; SDPA over them",
        style=("#8c564b", ">"),
        reference="Wang et al. 2020, 'Linformer: Self-Attention with Linear Complexity'",
        time_complexity="O(N rank D)",
        memory_complexity="O(N D + rank D)",
        supports_causal=False,
        subquadratic=True,
        why_not_causal="each projected key mixes all N positions, future ones too",
        notes="N <= max_len; needs num_heads",
        function_options=("rank", "max_len"),
        max_len_option="max_len",
        examples=((("rank", 4), ("max_len", 40)),),
    )

    def __init__(self, *, rank: int = 256, max_len: int = 16384, **base):
        """
        Args:
            rank: k, rows keys and values are projected to (the rank of the attention matrix).
            max_len: the longest N: E and F hold this many columns, a call of N keys uses the first N.
            scale: factor of the scores before the softmax; None means D ** -0.5.
        """
        super().__init__(**base)
        self._check_int("rank", rank, 1)
        self._check_int("max_len", max_len, 1)
        if self.num_heads is None:
            raise ValueError(
                "linformer: option num_heads is required (E and F are parameters of shape "
                "(num_heads, rank, max_len)), got num_heads=None"
            )
        self.rank, self.max_len = rank, max_len
        self.e = nn.Parameter(torch.empty(self.num_heads, rank, max_len))
        self.f = nn.Parameter(torch.empty(self.num_heads, rank, max_len))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.rank)  # as the authors' code: uniform(±1/√k)
        for p in (self.e, self.f):
            nn.init.uniform_(p, -bound, bound)

    def length_unsupported_reason(self, n_q: int, n_k: int) -> str | None:
        if n_k > self.max_len:
            return f"Nk={n_k} > max_len={self.max_len} (E and F have max_len columns; build with a larger max_len)"
        return None

    def check_length(self, n: int) -> int:
        return min(n, self.max_len)  # a check past max_len would be refused

    def projected_kv(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """(E K (B, H, rank, D), F V (B, H, rank, Dv)), padded keys zeroed first."""
        n = k.shape[-2]
        if key_padding_mask is not None:
            keep = key_padding_mask[:, None, :, None].to(k.dtype)
            k, v = k * keep, v * keep
        # (H, rank, N); at N = max_len the parameters themselves, so their gradients accumulate in place
        # (a slice's backward would first build a zero tensor of the parameter's size, H·rank·max_len)
        e, f = (self.e, self.f) if n == self.max_len else (self.e[:, :, :n], self.f[:, :, :n])
        e, f = e.to(k.dtype), f.to(v.dtype)
        return torch.matmul(e, k), torch.matmul(f, v)

    def _attend(self, q, k, v, causal, key_padding_mask):
        kp, vp = self.projected_kv(k, v, key_padding_mask)
        # a batch element with no real key: its projected keys and values are all zero; its rows read 0
        return zero_rows(sdpa(q, kp, vp, scale=self._scale(q)), dead_query_rows(key_padding_mask, q.shape[-2], False))

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """softmax(Q (E K)ᵀ · scale) (F V) with every score stored; rows of an all-padding element 0."""
        k, v = self._grouped_kv(q, k, v)  # grouped K/V: repeated to the query heads, as the forward repeats them
        kp, vp = self.projected_kv(k, v, key_padding_mask)
        out = dense_attention(q, kp, vp, None, self._scale(q))
        if key_padding_mask is not None:
            out = out * key_padding_mask.any(-1)[:, None, None, None].to(out.dtype)
        return out

    def flops(self, n_q, n_k, d, dv, causal):
        return 2.0 * self.rank * n_k * (d + dv) + 2.0 * full_attention_pairs(n_q, self.rank, False) * (d + dv)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        projected = batch * heads * self.rank * (d + dv) * element_size * (3 if backward else 1)
        return int(projected + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward))

    def extra_repr(self) -> str:
        return f"rank={self.rank}, max_len={self.max_len}, num_heads={self.num_heads}"
