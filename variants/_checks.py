"""The checks every call passes before computing, and the masks of exact attention.

`check_inputs` raises a ValueError or TypeError naming the argument, the value and what is allowed;
`dense_mask` and `causal_mask` are the masks of the dense definitions (bottom-right causal alignment).
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_positive_int(owner: str, name: str, value) -> None:
    """ValueError naming `owner`'s argument unless `value` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def check_model_input(owner: str, name: str, x: Tensor, d_model: int) -> None:
    """ValueError naming `owner`'s input unless `x` is a float (B, N, d_model) tensor."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != d_model or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{owner}: {name} must be a float tensor of shape (B, N, d_model={d_model}), got {got}")


def dense_mask(n_q: int, n_k: int, causal: bool, key_padding_mask: Tensor | None, device) -> Tensor | None:
    """Bool (B|1, 1, Nq, Nk) mask of exact attention: True = query i may attend key j."""
    allowed = None
    if causal:
        allowed = causal_mask(n_q, n_k, device)[None, None]
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, None, :]
        allowed = pad if allowed is None else allowed & pad
    return allowed


def causal_mask(n_q: int, n_k: int, device) -> Tensor:
    """Bool (Nq, Nk), bottom-right aligned: query i sits at position Nk - Nq + i and sees keys j <= it."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)


def distances(n_q: int, n_k: int, device) -> Tensor:
    """(Nq, Nk) long: query position − key position, bottom-right aligned (query i at Nk − Nq + i): what a score
    bias (ALiBi, T5's relative bias) is a function of."""
    return torch.arange(n_k - n_q, n_k, device=device)[:, None] - torch.arange(n_k, device=device)[None, :]


def check_inputs(attn, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None) -> None:
    """Raise a ValueError/TypeError naming the argument, the value and what is allowed (`attn`: the variant
    called, an AttentionVariant)."""
    name = attn.spec.name
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor of shape (B, H, N, D), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must have 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: {arg} must be a floating-point tensor, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in attn.spec.devices:
        raise RuntimeError(
            f"{name}: inputs are on {q.device}, but this variant runs on {', '.join(attn.spec.devices)} only"
        )
    reason = attn.dtype_unsupported_reason(q.device.type, str(q.dtype).removeprefix("torch."))
    if reason:
        raise TypeError(f"{name}: {reason}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"{name}: q, k, v must share the batch dim, and k, v their heads: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{name}: q has H={q.shape[1]} heads, k and v Hkv={k.shape[1]}: grouped-query attention needs H "
            f"a multiple of Hkv (each K/V head serving H / Hkv query heads)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{name}: q and k must share the head dim D, got q D={q.shape[-1]}, k D={k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{name}: k and v must share the key length Nk, got k Nk={k.shape[-2]}, v Nk={v.shape[-2]}")
    if q.shape[-1] == 0 or k.shape[-2] == 0:
        raise ValueError(
            f"{name}: head dim D and key length Nk must be >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    check_shape_hints(attn, q.shape[1], q.shape[-1], k.shape[1])
    reason = attn.kv_heads_unsupported_reason(k.shape[1])
    if reason:
        raise ValueError(f"{name}: k and v with Hkv={k.shape[1]} heads are not supported: {reason}")
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal and not attn.spec.supports_causal:
        raise ValueError(
            f"{name}: causal=True is not supported by this variant"
            + (f": {attn.spec.why_not_causal}" if attn.spec.why_not_causal else "")
        )
    if not causal and not attn.spec.supports_non_causal:
        why = attn.spec.why_not_non_causal
        raise ValueError(
            f"{name}: causal=False is not supported: the method is causal only"
            + (f" ({why})" if why else "")
            + "; call it with causal=True"
        )
    if causal and n_q > n_k:
        raise ValueError(
            f"{name}: causal=True needs Nq <= Nk (the queries are the last Nq of the Nk positions), "
            f"got Nq={n_q}, Nk={n_k}"
        )
    reason = attn.length_unsupported_reason(n_q, n_k)
    if reason:
        raise ValueError(f"{name}: Nq={n_q}, Nk={n_k} is not supported: {reason}")
    if n_q != n_k and not causal and not attn.spec.supports_cross_attention:
        raise ValueError(
            f"{name}: cross-attention (Nq={n_q} != Nk={n_k}, causal=False) is not supported; this variant "
            f"needs Nq == Nk, or causal=True with Nq <= Nk (the queries are the last Nq positions)"
        )
    if key_padding_mask is not None:
        if not attn.spec.supports_key_padding_mask:
            raise ValueError(f"{name}: key_padding_mask is not supported by this variant")
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            got = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
            raise TypeError(f"{name}: key_padding_mask must be a bool tensor (True = real token), got {got}")
        if tuple(key_padding_mask.shape) != (q.shape[0], n_k):
            raise ValueError(
                f"{name}: key_padding_mask must have shape (B, Nk) = {(q.shape[0], n_k)}, got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"{name}: key_padding_mask is on {key_padding_mask.device}, q on {q.device}")


def check_shape_hints(attn, heads: int, head_dim: int, kv_heads: int | None = None) -> None:
    """ValueError when the heads, K/V heads or head dim of inputs (or of a decoding state) differ from those the
    variant was built for (its num_heads, num_kv_heads, head_dim hints: per-head parameters are sized by them)."""
    if attn.num_heads is not None and heads != attn.num_heads:
        raise ValueError(f"{attn.spec.name}: built for num_heads={attn.num_heads}, got H={heads}")
    if attn.head_dim is not None and head_dim != attn.head_dim:
        raise ValueError(f"{attn.spec.name}: built for head_dim={attn.head_dim}, got D={head_dim}")
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(
            f"{attn.spec.name}: H={heads} query heads is not a multiple of Hkv={kv_heads} K/V heads "
            f"(grouped-query attention: each K/V head serves H / Hkv query heads)"
        )
    if kv_heads is not None and attn.num_kv_heads is not None and kv_heads != attn.num_kv_heads:
        raise ValueError(f"{attn.spec.name}: built for num_kv_heads={attn.num_kv_heads}, got Hkv={kv_heads}")
