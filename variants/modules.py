"""Modules that plug any registered attention variant into a model.

- `MultiHeadAttention`: projections W_q, W_k, W_v, W_o around a variant.
- `SinusoidalPositionalEncoding`: the fixed sin/cos table of Vaswani et al. 2017.
- `TransformerBlock`: attention + position-wise FFN, each with a residual and LayerNorm (pre or post).
- `swap_attention`: replace every `torch.nn.MultiheadAttention` in an existing model by a variant.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import AttentionVariant, build, variant_class


def _check_positive_int(owner: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def _check_model_input(owner: str, name: str, x: Tensor, d_model: int) -> None:
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != d_model or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{owner}: {name} must be a float tensor of shape (B, N, d_model={d_model}), got {got}")


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
) -> Tensor:
    """Project (B, N, E) inputs with ((W_q, b_q), (W_k, b_k), (W_v, b_v)), split heads, attend.

    Returns the concatenated heads, (B, Nq, num_heads * Dv), before the output projection.
    """
    (w_q, b_q), (w_k, b_k), (w_v, b_v) = projections
    q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def split_heads(x: Tensor) -> Tensor:  # (B, N, H*D) -> (B, H, N, D)
        b, n, e = x.shape
        return x.view(b, n, num_heads, e // num_heads).transpose(1, 2)

    out = attn(split_heads(q), split_heads(k), split_heads(v), causal=causal, key_padding_mask=key_padding_mask)
    b, h, n, dv = out.shape
    return out.transpose(1, 2).reshape(b, n, h * dv)  # (B, Nq, H*Dv)


class MultiHeadAttention(nn.Module):
    """Multi-head attention whose attention step is any registered variant.

    out = W_o · concat_h variant(q W_q^h, k W_k^h, v W_v^h). `dropout` applies to the attention
    output before W_o (a generic variant exposes no attention weights to drop).

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
        **variant_options,
    ):
        super().__init__()
        _check_positive_int("MultiHeadAttention", "d_model", d_model)
        _check_positive_int("MultiHeadAttention", "num_heads", num_heads)
        if d_model % num_heads:
            raise ValueError(f"MultiHeadAttention: d_model={d_model} must be divisible by num_heads={num_heads}")
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout!r}")
        self.d_model, self.num_heads = d_model, num_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        variant_options.setdefault("num_heads", num_heads)
        variant_options.setdefault("head_dim", d_model // num_heads)
        self.attention = build(variant, **variant_options)

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
            _check_model_input("MultiHeadAttention", name, x, self.d_model)
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
        )
        return self.out_proj(self.dropout(out))


class SinusoidalPositionalEncoding(nn.Module):
    """Adds PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) to (B, N, d) inputs.

    Example:
        >>> pe = SinusoidalPositionalEncoding(16, max_len=128)
        >>> pe(torch.zeros(1, 5, 16))[0, 0, :2]
        tensor([0., 1.])
    """

    def __init__(self, d_model: int, max_len: int = 8192):
        super().__init__()
        _check_positive_int("SinusoidalPositionalEncoding", "d_model", d_model)
        _check_positive_int("SinusoidalPositionalEncoding", "max_len", max_len)
        self.d_model, self.max_len = d_model, max_len
        pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
        inv_freq = torch.exp(
            -math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model
        )  # (ceil(d/2),)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * inv_freq)
        pe[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
        self.register_buffer("pe", pe.float(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        _check_model_input("SinusoidalPositionalEncoding", "x", x, self.d_model)
        n = x.shape[1]
        if n > self.max_len:
            raise ValueError(f"SinusoidalPositionalEncoding: sequence length {n} exceeds max_len={self.max_len}")
        return x + self.pe[:n].to(x.dtype)


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
        **variant_options,
    ):
        super().__init__()
        if norm not in ("pre", "post"):
            raise ValueError(f"TransformerBlock: norm must be 'pre' or 'post', got {norm!r}")
        _check_positive_int("TransformerBlock", "d_ff", d_ff)
        self.norm = norm
        self.attn = MultiHeadAttention(d_model, num_heads, variant=variant, dropout=dropout, **variant_options)
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


# -- swapping the attention of an existing model -----------------------------------------------


class VariantMultiheadAttention(nn.Module):
    """Drop-in for a `torch.nn.MultiheadAttention`: same weights (shared, not copied), same call, a variant inside.

    Accepts `attn_mask` only when it is a causal mask (or `is_causal=True`); returns `(output, None)`,
    since a generic variant has no attention weights to return.
    """

    # torch's fused encoder fast path would read the weights and bypass the variant; it checks this flag
    _qkv_same_embed_dim = False

    def __init__(self, original: nn.MultiheadAttention, variant: str, **variant_options):
        super().__init__()
        if original.bias_k is not None or original.add_zero_attn:
            raise ValueError("swap_attention: nn.MultiheadAttention with add_bias_kv or add_zero_attn is not supported")
        self.embed_dim, self.num_heads, self.batch_first = original.embed_dim, original.num_heads, original.batch_first
        self.head_dim = original.head_dim
        if original._qkv_same_embed_dim:
            self.in_proj_weight = original.in_proj_weight  # (3E, E), shared Parameter
            self.q_proj_weight = self.k_proj_weight = self.v_proj_weight = None
        else:
            self.in_proj_weight = None
            self.q_proj_weight, self.k_proj_weight, self.v_proj_weight = (
                original.q_proj_weight,
                original.k_proj_weight,
                original.v_proj_weight,
            )
        self.in_proj_bias = original.in_proj_bias
        self.out_proj = original.out_proj
        self.dropout = nn.Dropout(original.dropout)
        self.switch(variant, **variant_options)
        self.train(original.training)  # an eval-mode model stays in eval mode (no dropout appears)

    def switch(self, variant: str, **variant_options) -> None:
        """Use another variant from now on (the projection weights stay)."""
        variant_options.setdefault("num_heads", self.num_heads)
        variant_options.setdefault("head_dim", self.head_dim)
        self.attention = build(variant, device=self.out_proj.weight.device, **variant_options).train(self.training)

    def _projections(self) -> tuple[tuple[Tensor, Tensor | None], ...]:
        e = self.embed_dim
        biases = (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.split(e)
        if self.in_proj_weight is not None:
            weights = self.in_proj_weight.split(e)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        return tuple(zip(weights, biases))

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, None]:
        unbatched = query.dim() == 2
        if unbatched:  # (N, E) -> (1, N, E) whatever batch_first says
            query, key, value = query[None], key[None], value[None]
            key_padding_mask = key_padding_mask[None] if key_padding_mask is not None else None
        elif not self.batch_first:  # (N, B, E) -> (B, N, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        causal = is_causal or _is_causal_mask(attn_mask, query.shape[1], key.shape[1])
        keep = _keep_mask_from_torch_padding(key_padding_mask)
        out = multi_head_attend(
            self.attention, query, key, value, self._projections(), self.num_heads, causal=causal, key_padding_mask=keep
        )
        out = self.out_proj(self.dropout(out))
        if unbatched:
            out = out[0]
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, None


def _is_causal_mask(attn_mask: Tensor | None, n_q: int, n_k: int) -> bool:
    """True for a causal mask (bool True = blocked, or float -inf = blocked) above the diagonal; with
    Nq < Nk the variants' causal is bottom-right (queries = the last Nq positions), so only that mask is."""
    if attn_mask is None:
        return False
    if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (n_q, n_k):
        raise ValueError(
            f"swap_attention: attn_mask must be a causal ({n_q}, {n_k}) mask, got shape {tuple(attn_mask.shape)}"
        )
    upper = torch.ones(n_q, n_k, dtype=torch.bool, device=attn_mask.device).triu(n_k - n_q + 1)
    if attn_mask.dtype == torch.bool:
        blocked, ok_values = attn_mask, True
    else:
        blocked = torch.isneginf(attn_mask)
        ok_values = bool((attn_mask[~blocked] == 0).all())
    if ok_values and torch.equal(blocked, upper):
        return True
    raise ValueError(
        "swap_attention: attention variants accept only a causal attn_mask (or is_causal=True), not an arbitrary mask"
    )


def _keep_mask_from_torch_padding(key_padding_mask: Tensor | None) -> Tensor | None:
    """torch's key_padding_mask (bool True = pad, or float -inf = pad) -> ours (bool True = real token)."""
    if key_padding_mask is None:
        return None
    if key_padding_mask.dtype == torch.bool:
        return ~key_padding_mask
    pad = torch.isneginf(key_padding_mask)
    if not bool((key_padding_mask[~pad] == 0).all()):
        raise ValueError("swap_attention: a float key_padding_mask must hold only 0 (keep) and -inf (pad)")
    return ~pad


def swap_attention(model: nn.Module, variant: str, **options) -> nn.Module:
    """Replace every `torch.nn.MultiheadAttention` inside `model` by a `variant`-backed module, in place.

    The new modules share the original weights and accept the same call, so a
    `torch.nn.TransformerEncoder` keeps working unchanged. Returns `model` (or the replacement,
    when `model` itself is a `MultiheadAttention`). Swapping an already swapped model switches its
    attention to the new variant (the weights stay). ValueError for an unknown variant, and for a
    model with no attention to swap.

    Example:
        >>> layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        >>> enc = swap_attention(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), "full")
        >>> enc(torch.randn(2, 9, 32), mask=nn.Transformer.generate_square_subsequent_mask(9), is_causal=True).shape
        torch.Size([2, 9, 32])
    """
    variant_class(variant)  # an unknown name fails here, whatever the model holds
    if isinstance(model, nn.MultiheadAttention):
        return VariantMultiheadAttention(model, variant, **options)
    if isinstance(model, VariantMultiheadAttention):
        model.switch(variant, **options)
        return model
    targets = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if isinstance(child, nn.MultiheadAttention)
    ]
    swapped = [module for module in model.modules() if isinstance(module, VariantMultiheadAttention)]
    if not targets and not swapped:
        raise ValueError(f"swap_attention: {type(model).__name__} contains no torch.nn.MultiheadAttention to swap")
    for module in swapped:  # swapped before: switch to the new variant
        module.switch(variant, **options)
    for parent, child_name, child in targets:
        setattr(parent, child_name, VariantMultiheadAttention(child, variant, **options))
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False  # nested tensors would bypass the swapped attention
    return model
