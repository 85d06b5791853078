"""Exact softmax attention through xformers' `memory_efficient_attention` (CUDA only).

Rabe & Staats 2021, "Self-attention Does Not Need O(n²) Memory"; xformers (Lefaudeux et al.).
xformers is imported only when this variant is built for a CUDA device, never at `import variants`.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch
from torch import Tensor

from .._base import AttentionVariant, VariantSpec, register
from .._utils import dead_query_rows, zero_rows
from .full import full_attention_pairs, padding_and_causal_mask


XFORMERS_EXTRA = "install the 'xformers' extra (pip install -e '.[xformers]') on a CUDA machine"


@functools.lru_cache(maxsize=1)
def _xformers_installed() -> str | None:
    """None when xformers is installed, else why not — found without importing it: importing
    xformers.ops probes the GPU, and the harness's parent process must never initialize CUDA."""
    try:
        found = importlib.util.find_spec("xformers") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"xformers is not installed; {XFORMERS_EXTRA}"


@functools.lru_cache(maxsize=1)
def _xformers_ops():
    """Import xformers.ops quietly (only where a CUDA call needs it); returns (module, None) or (None, reason)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import xformers.ops as xops  # noqa: PLC0415 — optional, CUDA-only dependency
    except Exception as err:  # ImportError, or its extensions failing to load
        return None, f"xformers cannot be imported ({type(err).__name__}: {err}); {XFORMERS_EXTRA}"
    return xops, None


def _causal_bias(xops, q: Tensor, k: Tensor):
    """xformers' causal bias for the interface's alignment: bottom-right when Nq < Nk."""
    if q.shape[-2] == k.shape[-2]:
        return xops.LowerTriangularMask()
    return xops.fmha.attn_bias.LowerTriangularFromBottomRightMask()


@register
class XformersFullAttention(AttentionVariant):
    spec = VariantSpec(
        why_no_score_bias="xformers takes an attn_bias, but this path is not wired for one (full carries it)",
        name="full_xformers",
        kind="exact",
        repeats_kv="xformers' grouped layout (B, M, G, H, K) is not wired here: K, V are repeated (CUDA only, and untested on hardware here)",
        summary="exact softmax attention, xformers memory_efficient_attention kernel",
        style=("#17becf", "D"),
        reference="Rabe & Staats 2021; facebookresearch/xformers",
        time_complexity="O(Nq Nk D)",
        memory_complexity="O(N D) (key padding: an Nq x Nk additive bias)",
        devices=("cuda",),
        backward_devices=("cuda",),
        dtypes=("float32", "float16", "bfloat16"),
        same_function_as="full",
    )

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        reason = super().unavailable_reason(device)
        if reason:
            return reason
        return _xformers_installed()

    def kernel_name(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, backward: bool = False
    ) -> str | None:
        """The xformers operator its dispatcher picks for this call (e.g. fa2F, cutlassF-pt)."""
        xops = _xformers_ops()[0]
        if xops is None:
            return None
        from xformers.ops import fmha

        bias = _causal_bias(xops, q, k) if causal else None
        inp = fmha.Inputs(
            query=q.transpose(1, 2),
            key=k.transpose(1, 2),
            value=v.transpose(1, 2),
            attn_bias=bias,
            scale=self._scale(q),
        )
        return fmha.dispatch._dispatch_fw(inp, backward).NAME

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        xops = _xformers_ops()[0]
        if xops is None:
            raise RuntimeError(f"full_xformers is unavailable: {_xformers_ops()[1]}")
        # xformers takes (B, N, H, D)
        q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
        bias, dead = None, None
        if key_padding_mask is not None:
            dead = dead_query_rows(key_padding_mask, q.shape[-2], causal)
            allowed = padding_and_causal_mask(key_padding_mask, q.shape[-2], causal, dead)
            n_q, n_k = q.shape[-2], k.shape[-2]
            # xformers wants the bias's last dim stored with a stride that is a multiple of 8: allocate wider, slice
            storage = torch.zeros(*allowed.shape[:-2], n_q, -(-n_k // 8) * 8, dtype=q.dtype, device=q.device)
            bias = storage[..., :n_k].masked_fill_(~allowed.expand(*allowed.shape[:-2], n_q, n_k), float("-inf"))
            bias = bias.expand(q.shape[0], q.shape[1], n_q, n_k)
        elif causal:
            bias = _causal_bias(xops, q, k)
        out = xops.memory_efficient_attention(q_, k_, v_, attn_bias=bias, scale=self._scale(q))
        return zero_rows(out.transpose(1, 2), dead)

    def flops(self, n_q: int, n_k: int, d: int, dv: int, causal: bool) -> float:
        return 2.0 * full_attention_pairs(n_q, n_k, causal) * (d + dv)
