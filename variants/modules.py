"""Modules that plug any registered attention variant into a model.

- `MultiHeadAttention`: projections W_q, W_k, W_v, W_o around a variant.
- `TransformerBlock`: attention + position-wise FFN, each with a residual and LayerNorm (pre or post).

`swap_attention` (variants/swap.py) replaces the attention of an existing `torch.nn` model instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import check_model_input, check_positive_int
from ._registry import build
from ._variant import AttentionVariant
from .positions import ENCODINGS, attention_encoding, encoding_unsupported_reason
from .positions.rope import RotaryEmbedding


def head_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    projections: tuple[tuple[Tensor, Tensor | None], ...],
    num_heads: int,
    causal: bool,
    positions: nn.Module | None,
) -> tuple[Tensor, Tensor, Tensor, dict]:
    """(q, k, v, the variant's extra arguments): the (B, N, E) inputs projected, split into (B, H, N, D) heads, q and
    k rotated where `positions` is a `RotaryEmbedding`; any other `positions` module is a score bias to hand on."""
    (w_q, b_q), (w_k, b_k), (w_v, b_v) = projections
    q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def split_heads(x: Tensor) -> Tensor:  # (B, N, H*D) -> (B, H, N, D)
        b, n, e = x.shape
        return x.view(b, n, num_heads, e // num_heads).transpose(1, 2)

    q, k, v = split_heads(q), split_heads(k), split_heads(v)
    if isinstance(positions, RotaryEmbedding):
        n_q, n_k = q.shape[-2], k.shape[-2]
        q = positions(q, torch.arange(n_k - n_q if causal else 0, n_k if causal else n_q, device=q.device))
        k = positions(k, torch.arange(n_k, device=k.device))
        return q, k, v, {}
    return q, k, v, {} if positions is None else {"score_bias": positions}


def multi_head_attend(
    attn: AttentionVariant,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    projections: tuple[tuple[Tensor, Tensor | None], ...],
    num_heads: int,
    *,
    causal: bool,
    key_padding_mask: Tensor | None,
    positions: nn.Module | None = None,
) -> Tensor:
    """Project (B, N, E) inputs with ((W_q, b_q), (W_k, b_k), (W_v, b_v)), split heads, attend.

    positions: an attention's position encoding (variants/positions): a `RotaryEmbedding` turns q and k by their
    positions (causal with Nq < Nk: the queries are the last Nq), any other module is a score bias the variant adds.
    Returns the concatenated heads, (B, Nq, num_heads * Dv), before the output projection.
    """
    q, k, v, bias = head_inputs(query, key, value, projections, num_heads, causal, positions)
    out = attn(q, k, v, causal=causal, key_padding_mask=key_padding_mask, **bias)
    b, h, n, dv = out.shape
    return out.transpose(1, 2).reshape(b, n, h * dv)  # (B, Nq, H*Dv)


class MultiHeadAttention(nn.Module):
    """Multi-head attention whose attention step is any registered variant.

    out = W_o · concat_h variant(q W_q^h, k W_k^h, v W_v^h). `dropout` applies to the attention
    output before W_o (a generic variant exposes no attention weights to drop). With `output_gate`, the
    concatenated heads are multiplied elementwise by σ(query W_g) first (Qwen3-Next's gated attention: Qiu et
    al. 2025, "Gated Attention for Large Language Models"), whatever the variant. `positions` names an encoding
    the attention applies (variants/positions): "rope" for every variant, "alibi" or "relative" (score biases)
    for a variant that forms its scores; an encoding of the inputs ("sinusoidal", "learned") is the model's.

    Example:
        >>> mha = MultiHeadAttention(64, 4, variant="full")
        >>> x = torch.randn(2, 10, 64)
        >>> mha(x, causal=True).shape
        torch.Size([2, 10, 64])
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        variant: str = "full",
        dropout: float = 0.0,
        bias: bool = True,
        output_gate: bool = False,
        positions: str | None = None,
        **variant_options,
    ):
        super().__init__()
        check_positive_int("MultiHeadAttention", "d_model", d_model)
        if not isinstance(output_gate, bool):
            raise ValueError(f"MultiHeadAttention: output_gate must be a bool, got {output_gate!r}")
        check_positive_int("MultiHeadAttention", "num_heads", num_heads)
        if d_model % num_heads:
            raise ValueError(f"MultiHeadAttention: d_model={d_model} must be divisible by num_heads={num_heads}")
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout!r}")
        self.d_model, self.num_heads = d_model, num_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.gate_proj = nn.Linear(d_model, d_model, bias=bias) if output_gate else None
        self.dropout = nn.Dropout(dropout)
        variant_options.setdefault("num_heads", num_heads)
        variant_options.setdefault("head_dim", d_model // num_heads)
        self.attention = build(variant, **variant_options)
        if positions is not None and positions not in ENCODINGS or ENCODINGS.get(positions) == "input":
            raise ValueError(
                f"MultiHeadAttention: positions={positions!r} is not an encoding an attention applies; choose "
                f"{', '.join(n for n, where in ENCODINGS.items() if where in ('rotation', 'bias'))} or None "
                "(an input encoding is added to the embeddings by the model)"
            )
        if positions is not None and encoding_unsupported_reason(variant, positions):
            raise ValueError(
                f"MultiHeadAttention: positions={positions!r}: {encoding_unsupported_reason(variant, positions)}"
            )
        self.positions = attention_encoding(positions, num_heads, d_model // num_heads)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """query: (B, Nq, d_model); key, value: (B, Nk, d_model), default query. Returns (B, Nq, d_model)."""
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            check_model_input("MultiHeadAttention", name, x, self.d_model)
        projections = tuple((p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = multi_head_attend(
            self.attention,
            query,
            key,
            value,
            projections,
            self.num_heads,
            causal=causal,
            key_padding_mask=key_padding_mask,
            positions=self.positions,
        )
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(query))
        return self.out_proj(self.dropout(out))

    @torch.no_grad()
    def attention_weights(self, query: Tensor, *, causal: bool = False) -> Tensor:
        """(B, H, N, N): the weights this module's attention applies to the values of self-attention over `query`
        (out = weights @ v per head; every variant is linear in v), its positions included. For linear attention and
        the recurrences, the matrix their computation implies (`AttentionVariant.attention_matrix`)."""
        check_model_input("MultiHeadAttention", "query", query, self.d_model)
        projections = tuple((p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, _, bias = head_inputs(query, query, query, projections, self.num_heads, causal, self.positions)
        return self.attention.attention_matrix(q, k, causal=causal, **bias)


class TransformerBlock(nn.Module):
    """Residual attention + residual position-wise FFN, LayerNorm before ("pre") or after ("post") each.

    Example:
        >>> block = TransformerBlock(32, 4, 64, variant="full", norm="pre")
        >>> block(torch.randn(2, 7, 32), causal=True).shape
        torch.Size([2, 7, 32])
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        variant: str = "full",
        norm: str = "pre",
        dropout: float = 0.0,
        output_gate: bool = False,
        positions: str | None = None,
        **variant_options,
    ):
        super().__init__()
        if norm not in ("pre", "post"):
            raise ValueError(f"TransformerBlock: norm must be 'pre' or 'post', got {norm!r}")
        check_positive_int("TransformerBlock", "d_ff", d_ff)
        self.norm = norm
        self.attn = MultiHeadAttention(
            d_model,
            num_heads,
            variant=variant,
            dropout=dropout,
            output_gate=output_gate,
            positions=positions,
            **variant_options,
        )
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None) -> Tensor:
        """x: (B, N, d_model) -> (B, N, d_model)."""

        def attend(h: Tensor) -> Tensor:
            return self.dropout(self.attn(h, causal=causal, key_padding_mask=key_padding_mask))

        def feed_forward(h: Tensor) -> Tensor:
            return self.dropout(self.ff(h))

        if self.norm == "pre":
            x = x + attend(self.norm1(x))
            return x + feed_forward(self.norm2(x))
        x = self.norm1(x + attend(x))
        return self.norm2(x + feed_forward(x))
