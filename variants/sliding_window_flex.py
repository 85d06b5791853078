"""Sliding-window + global-token attention (Longformer) through PyTorch's compiled FlexAttention.

The same pattern as `sliding_window` — |i - j| <= w, the first g positions global, causal optional —
given to `torch.nn.attention.flex_attention` as a block mask: only the 128 x 128 tiles that touch
the band (or a global row/column) are computed, and the exact pattern is applied inside them.
The block mask is built from tile indices directly (O((N/128)²) integers, never an N x N mask)
and cached per shape; the kernel is compiled once per shape by `torch.compile`.
CPU: forward only (torch 2.13 has no FlexAttention backward on CPU).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ._base import VariantSpec, register
from .sliding_window import LongformerPattern

TILE = 128  # FlexAttention's default block size


@functools.lru_cache(maxsize=1)
def compiled_flex_attention():
    """`flex_attention` compiled once per process (recompiled by torch per new shape)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def sliding_window_mask_mod(window: int, n_global: int, causal: bool, key_valid: Tensor | None):
    """mask_mod(b, h, q_idx, kv_idx) -> bool for the Longformer pattern (key_valid: (B, N) or None)."""

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = (q_idx - kv_idx).abs() <= window
        if n_global:
            allowed = allowed | (q_idx < n_global) | (kv_idx < n_global)
        if causal:
            allowed = allowed & (kv_idx <= q_idx)
        if key_valid is not None:
            allowed = allowed & key_valid[b, kv_idx]
        return allowed

    return mask_mod


def sliding_window_block_mask(n: int, window: int, n_global: int, causal: bool, key_valid: Tensor | None, device):
    """A BlockMask listing, per query tile, the key tiles the pattern touches."""
    from torch.nn.attention.flex_attention import BlockMask

    tiles = math.ceil(n / TILE)
    qt = torch.arange(tiles, device=device)[:, None]
    kt = torch.arange(tiles, device=device)[None, :]
    # tile pair touches the band if the smallest |i - j| between them is <= w
    gap = ((qt - kt).abs() - 1).clamp_min(0) * TILE + ((qt != kt) * 1)
    touch = gap <= window
    if n_global:
        g_tiles = math.ceil(n_global / TILE)
        touch = touch | (qt < g_tiles) | (kt < g_tiles)
    if causal:
        touch = touch & (kt <= qt)
    touch = touch[None, None]  # (1, 1, tiles, tiles)
    num = touch.sum(-1, dtype=torch.int32)
    # indices of touched tiles first, in ascending order
    order = torch.argsort((~touch).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    mask_mod = sliding_window_mask_mod(window, n_global, causal, key_valid)
    return BlockMask.from_kv_blocks(num, order, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(n, n))


@register
class FlexSlidingWindowAttention(LongformerPattern):
    spec = VariantSpec(
        name="sliding_window_flex",
        summary="Longformer sliding window + global tokens via compiled FlexAttention and a block mask",
        reference="Beltagy et al. 2020; torch.nn.attention.flex_attention (Dong et al. 2024)",
        time_complexity="O(N (w + g) D) (in 128 x 128 tiles)",
        memory_complexity="O(N D) + O((N/128)^2) tile indices",
        supports_cross_attention=False,
        backward_devices=("cuda",),
        dtypes=("float32", "float64", "float16", "bfloat16"),
        subquadratic=True,
        notes="CPU: forward only (no FlexAttention backward on CPU in torch 2.13); compiles once per shape",
    )

    def __init__(self, *, window: int = 256, global_tokens: int = 0, **base):
        super().__init__(window=window, global_tokens=global_tokens, **base)
        self._masks: dict[tuple, object] = {}  # block masks without key padding, per (N, causal, device)

    def _block_mask(self, n: int, causal: bool, key_padding_mask: Tensor | None, device):
        if key_padding_mask is not None:  # depends on the data: built per call (cheap: tile indices only)
            return sliding_window_block_mask(n, self.window, self.global_tokens, causal, key_padding_mask, device)
        key = (n, causal, str(device))
        if key not in self._masks:
            self._masks[key] = sliding_window_block_mask(n, self.window, self.global_tokens, causal, None, device)
        return self._masks[key]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        block_mask = self._block_mask(q.shape[-2], causal, key_padding_mask, q.device)
        return compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=self._scale(q))
