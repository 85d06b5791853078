"""`swap_attention`: replace every `torch.nn.MultiheadAttention` in an existing model by a variant, its weights
shared (not copied), its call unchanged."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._registry import build, variant_class
from .modules import multi_head_attend


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
