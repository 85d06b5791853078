"""Sliding-window + global-token attention (Longformer) through PyTorch's compiled FlexAttention.

The same pattern as `sliding_window` — |i - j| <= w, the first g positions global, causal optional —
given to `torch.nn.attention.flex_attention` as a block mask over 128 x 128 tiles: tiles the pattern
does not touch are skipped, tiles it covers entirely are "full" (no mask is evaluated inside them),
and only the tiles on the band's edges evaluate the exact pattern (`mask_mod`) per element.
The block mask is built from tile indices directly (O((N/128)²) integers, never an N x N mask)
and cached per shape; the kernel is compiled once per shape by `torch.compile`.
CPU: forward only (torch 2.13 has no FlexAttention backward on CPU).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._base import VariantSpec, register
from .sliding_window import LongformerPattern

TILE = 128  # FlexAttention's default block size
# the smallest head dim each backend computes correctly: torch 2.13's CPU template gives wrong
# results (even NaN) for D < 32 on AVX2 machines; the CUDA template needs D >= 16. Smaller heads
# are zero-padded (exact: zero columns add nothing to q·k, and padded value columns are cut off).
MIN_HEAD_DIM = {"cpu": 32, "cuda": 16}
RECOMPILE_LIMIT = 64  # shapes per process; past it, fail loudly instead of Dynamo's silent eager fallback


@functools.lru_cache(maxsize=None)
def compiled_flex_attention(device_type: str):
    """`flex_attention` compiled once per process and device type (recompiled by torch per new shape)."""
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


def tile_coverage(n: int, window: int, n_global: int, causal: bool, device) -> tuple[Tensor, Tensor]:
    """(touched, full): bool (T, T) over query tile x key tile, T = ceil(N / 128).

    touched: some (i, j) of the tile pair is in the pattern; full: every (i, j) of it is (so the
    kernel may skip the mask there). Tiles holding the ragged end of the sequence are never full.
    """
    tiles = math.ceil(n / TILE)
    qt = torch.arange(tiles, device=device)[:, None]
    kt = torch.arange(tiles, device=device)[None, :]
    dist = (qt - kt).abs()
    # smallest and largest |i - j| between two tiles
    touched = (dist - 1).clamp_min(0) * TILE + (dist > 0) <= window
    full = (dist + 1) * TILE - 1 <= window
    if n_global:
        touched = touched | (qt * TILE < n_global) | (kt * TILE < n_global)
        full = full | ((qt + 1) * TILE <= n_global) | ((kt + 1) * TILE <= n_global)
    if causal:
        touched = touched & (kt <= qt)
        full = full & (kt < qt)
    if n % TILE:
        full = full & (qt < tiles - 1) & (kt < tiles - 1)
    return touched, full


def _kv_blocks(select: Tensor) -> tuple[Tensor, Tensor]:
    """(count (1, 1, T), indices (1, 1, T, T)): per query tile, the selected key tiles first, ascending."""
    select = select[None, None]
    num = select.sum(-1, dtype=torch.int32)
    order = torch.argsort((~select).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, order


def sliding_window_block_mask(n: int, window: int, n_global: int, causal: bool, key_valid: Tensor | None, device):
    """A BlockMask listing, per query tile, the key tiles the pattern touches and those it fills."""
    from torch.nn.attention.flex_attention import BlockMask

    touched, full = tile_coverage(n, window, n_global, causal, device)
    if key_valid is not None:  # padding may fall anywhere: every touched tile evaluates the mask
        full = torch.zeros_like(full)
    partial_num, partial_idx = _kv_blocks(touched & ~full)
    full_num, full_idx = _kv_blocks(full)
    mask_mod = sliding_window_mask_mod(window, n_global, causal, key_valid)
    return BlockMask.from_kv_blocks(
        partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(n, n)
    )


@register
class FlexSlidingWindowAttention(LongformerPattern):
    spec = VariantSpec(
        why_no_score_bias="FlexAttention's score_mod could add one; not implemented here (sliding_window carries it)",
        name="sliding_window_flex",
        kind="local and sparse",
        repeats_kv="its block mask and its NaN propagation are built per query head (flex_attention's enable_gqa is not used)",
        state_repeats_kv="",  # (sliding_window's decoding: the window kept per K/V head)
        summary="Longformer sliding window + global tokens via compiled FlexAttention and a block mask",
        style=("#98df8a", "^"),
        reference="Beltagy et al. 2020; torch.nn.attention.flex_attention (Dong et al. 2024)",
        time_complexity="O(N (w + g) D) (in 128 x 128 tiles)",
        memory_complexity="O(N D) + O((N/128)^2) tile indices",
        supports_cross_attention=False,
        backward_devices=("cuda",),
        dtypes=("float32", "float16", "bfloat16"),
        subquadratic=True,
        notes="CPU: forward only (no FlexAttention backward on CPU in torch 2.13); CUDA: no float64; "
        "compiles once per shape; head dims below 32 (CPU) / 16 (CUDA) are zero-padded",
        same_function_as="sliding_window",
        reach_option="window",
        function_options=("window", "global_tokens"),
        not_deployable=(
            (
                "onnx",
                "torch.onnx has no conversion for aten.sort.stable, which FlexAttention's block mask "
                "(create_block_mask) is built with",
            ),
        ),
        examples=((("window", 3),), (("window", 3), ("global_tokens", 2))),
    )

    def __init__(self, *, window: int = 256, global_tokens: int = 0, **base):
        """Options: those of the pattern (window, global_tokens); no tuning knob of its own."""
        super().__init__(window=window, global_tokens=global_tokens, **base)
        self._masks: dict[tuple, object] = {}  # block masks without key padding, per (N, causal, device)

    @classmethod
    def dtype_unsupported_reason(cls, device: str, dtype: str) -> str | None:
        if dtype == "float64":  # compiled FlexAttention refuses it on both (an InductorError from deep in torch before)
            return (
                f"sliding_window_flex has no float64 on {torch.device(device).type} (FlexAttention's compiled kernels "
                f"take float32, float16, bfloat16)"
            )
        return super().dtype_unsupported_reason(device, dtype)

    def _block_mask(self, n: int, causal: bool, key_padding_mask: Tensor | None, device):
        if key_padding_mask is not None:  # depends on the data: built per call (cheap: tile indices only)
            return sliding_window_block_mask(n, self.window, self.global_tokens, causal, key_padding_mask, device)
        key = (n, causal, str(device))
        if key not in self._masks:
            self._masks[key] = sliding_window_block_mask(n, self.window, self.global_tokens, causal, None, device)
        return self._masks[key]

    def _attend_self(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        if not torch.is_grad_enabled():  # inference: flex refuses CPU inputs that require grad, even under no_grad
            q, k, v = q.detach(), k.detach(), v.detach()
        block_mask = self._block_mask(q.shape[-2], causal, key_padding_mask, q.device)
        scale = self._scale(q)  # of the real head dim, before any padding
        d, dv = q.shape[-1], v.shape[-1]
        min_d = MIN_HEAD_DIM.get(q.device.type, 16)
        if d < min_d:  # (B, H, N, D) -> (B, H, N, min_d)
            q, k = F.pad(q, (0, min_d - d)), F.pad(k, (0, min_d - d))
        if dv < min_d:
            v = F.pad(v, (0, min_d - dv))
        # a hard error, never Dynamo's silent fall-back to eager flex (which materializes N x N scores)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            out = compiled_flex_attention(q.device.type)(q, k, v, block_mask=block_mask, scale=scale)
        return propagate_non_finite(out[..., :dv], q, k, v, self.window, self.global_tokens, causal, key_padding_mask)


def _finite_rows(x: Tensor, group: int = 4096) -> Tensor:
    """(B, H, N) bool: rows of x (B, H, N, D) with every value finite, checked `group` positions at a
    time so the elementwise temporary stays O(group·D), not O(N·D)."""
    return torch.cat([torch.isfinite(part).all(-1) for part in x.split(group, dim=2)], dim=2)


def _all_finite(*tensors: Tensor) -> bool:
    """True when a sum of each tensor is finite, so every value is (accumulated in float32 at least: a float16
    sum of finite values overflows at 65504). False may still mean every value is finite (a sum that overflowed)."""
    acc = torch.promote_types(tensors[0].dtype, torch.float32)
    return bool(torch.isfinite(torch.stack([t.sum(dtype=acc) for t in tensors])).all())


def propagate_non_finite(
    out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    n_global: int,
    causal: bool,
    key_padding_mask: Tensor | None,
) -> Tensor:
    """NaN in every output row whose query, or one of whose attended keys/values, is not finite.

    FlexAttention's kernel turns such rows into finite numbers (zeros); exact attention gives NaN,
    and a benchmark must not hide a poisoned input. First one sum per tensor: a sum is finite only if
    every term is (NaN and ±inf propagate; +inf and -inf give NaN), so finite inputs cost three
    reductions and no temporary. Only when a sum is not finite (a bad value, or a finite overflow)
    are the rows checked: O(N·D) to check, O(N) to place.
    """
    if not torch.compiler.is_compiling() and _all_finite(q, k, v):
        return out
    bad_q = ~_finite_rows(q)  # (B, H, N)
    bad_kv = ~(_finite_rows(k) & _finite_rows(v))
    if key_padding_mask is not None:
        bad_kv = bad_kv & key_padding_mask[:, None, :]  # padded keys are never attended
    if not torch.compiler.is_compiling() and not bool(bad_q.any() | bad_kv.any()):  # (traced: no branch on the data)
        return out
    n = q.shape[-2]
    seen = F.pad(bad_kv.to(torch.int32).cumsum(-1), (1, 0))  # seen[..., j] = bad keys before j
    i = torch.arange(n, device=q.device)
    lo = (i - window).clamp_min(0)
    hi = i + 1 if causal else (i + window + 1).clamp_max(n)
    rows = (seen[..., hi] - seen[..., lo]) > 0  # a bad key in the band
    g = min(n_global, n)
    if g:
        first_bad_global = torch.where(bad_kv[..., :g], i[:g], n).amin(-1, keepdim=True)  # (B, H, 1)
        rows = rows | (i >= first_bad_global if causal else (first_bad_global < n))
        upto = seen[..., 1:] if causal else seen[..., -1:].expand(*seen.shape[:-1], n)
        rows = rows | ((i < g) & (upto > 0))  # global rows see every (earlier) key
    return out.masked_fill((rows | bad_q)[..., None], float("nan"))
