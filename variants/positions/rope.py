"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position
Embedding"): q and k of every head are rotated by their position before the scores are formed. Channel i of the
first half and channel i + D/2 make a plane (the half-split layout of GPT-NeoX and Llama), turned by t·θ_i:

    θ_i = base^(−2i/D),  i = 0 .. D/2 − 1
    R_t x = [x₁ cos tθ − x₂ sin tθ,  x₁ sin tθ + x₂ cos tθ]     (x₁ = x[:D/2], x₂ = x[D/2:])

Rotations compose, R_tᵀ R_s = R_{s−t}, so (R_t q)·(R_s k) = q·R_{s−t} k depends on t − s only: a relative
encoding that needs no score access. Every method can carry it (it changes q and k, not how they are combined);
inside a feature map φ(R_t q)·φ(R_s k) the kernel is no longer a function of t − s alone.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

ROPE_BASE = 10000.0  # Su et al.'s and Llama's base


class RotaryEmbedding(nn.Module):
    """R_t applied to (B, H, N, D) queries or keys at positions `positions` (N,).

    Example:
        >>> rope = RotaryEmbedding(8)
        >>> x = torch.randn(1, 2, 5, 8)
        >>> torch.allclose(rope(x, torch.arange(5)).norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths
        True
    """

    def __init__(self, head_dim: int, base: float = ROPE_BASE):
        super().__init__()
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim={head_dim!r} must be an even int >= 2 (planes of 2 channels)")
        if not (isinstance(base, (int, float)) and base > 1):
            raise ValueError(f"RotaryEmbedding: base={base!r} must be a number > 1")
        self.head_dim, self.base = head_dim, float(base)

    def angles(self, positions: Tensor) -> Tensor:
        """t·θ_i, (N, D/2), in float64."""
        inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        return positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        if x.shape[-1] != self.head_dim or x.shape[-2] != positions.shape[-1]:
            raise ValueError(
                f"RotaryEmbedding: x of shape {tuple(x.shape)} must end in (N={positions.shape[-1]}, "
                f"head_dim={self.head_dim})"
            )
        a = self.angles(positions)
        cos, sin = a.cos().to(x.dtype), a.sin().to(x.dtype)
        x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"
