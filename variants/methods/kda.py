"""Kimi Delta Attention: Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture".

Gated DeltaNet with its scalar decay refined to one decay per key channel:

    log α_t = max(−exp(A_log_h) softplus(k_t W_h + b_h), −5)      (a vector over the D key dims)
    β_t = σ(k_t·w_β,h + b_β,h),   q_t, k_t L2-normalised
    S_t = (I − β_t k_t k_tᵀ) diag(α_t) S_{t-1} + β_t k_t v_tᵀ,      o_t = scale · q_tᵀ S_t

Each key channel forgets at its own data-dependent rate (GLA's fine-grained gate) before the delta rule
corrects the value stored at k_t (DeltaNet's precise overwrite). Computed chunk-wise (_recurrence.py): the
WY form with the per-channel decay taken relative to each chunk's middle, as gla's, so chunks are at most 16
positions and log α is floored at −5 (the factors stay inside exp(±40)). The gates come from the raw keys
(learned per head): the interface hands a variant q, k, v; Kimi Linear computes them from the hidden state.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base import register
from ._recurrence import inverse_softplus
from .deltanet import DeltaNet
from .gla import LOG_DECAY_FLOOR


class ChannelDecay(nn.Module):
    """log α_t = max(−exp(A_log_h) softplus(k_t W_h + b_h), LOG_DECAY_FLOOR), per head, position and key dim.

    Initialised as Mamba-2's scalar decay spread over the channels: A over [1, 16] by head, softplus(b) over
    [0.001, 0.1] (log-spaced) by channel, W small."""

    def __init__(self, heads: int, key_dim: int):
        super().__init__()
        self.a_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, heads)))
        self.w = nn.Parameter(torch.randn(heads, key_dim, key_dim) * key_dim**-0.5 * 0.1)
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), key_dim))
        self.b = nn.Parameter(inverse_softplus(dt).expand(heads, key_dim).clone())

    def forward(self, k: Tensor) -> Tensor:
        dt = F.softplus(torch.matmul(k, self.w.to(k.dtype)) + self.b.to(k.dtype)[:, None])  # (B, H, L, D)
        return (-self.a_log.to(k.dtype).exp()[:, None, None] * dt).clamp_min(LOG_DECAY_FLOOR)


@register
class KimiDeltaAttention(DeltaNet):
    spec = replace(
        DeltaNet.spec,
        name="kda",
        summary=(
            "Kimi Delta Attention: the gated delta rule with a decay per key channel (Kimi Linear); chunked (WY), D x "
            "Dv state"
        ),
        style=("#3182bd", "p"),
        reference="Kimi Team 2025, 'Kimi Linear: An Expressive, Efficient Attention Architecture'",
        notes="causal only; needs num_heads and head_dim (gates per head from the keys); chunk_size <= 16; "
        "log α floored at −5; decodes with a constant D x Dv state",
        examples=(
            (("chunk_size", 4),),
            (("chunk_size", 16),),
            (("chunk_size", 4), ("feature_map", "hedgehog"), ("feature_dim", 3)),
        ),
    )

    max_chunk = 16

    def __init__(self, *, chunk_size: int = 16, **options):
        """
        Args:
            chunk_size: C, positions per chunk (at most 16: the per-channel decay's factors, module docstring).
                A tuning knob: the result does not depend on it.
        """
        super().__init__(chunk_size=chunk_size, **options)  # DeltaNet's β
        heads, key_dim = self._require_shape_hints()
        self.decay = ChannelDecay(heads, key_dim)

    def _inputs(self, q, k, v):
        return {**super()._inputs(q, k, v), "log_decay": self.decay(k)}

    def step_reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """S'_t = diag(a_t) S_{t-1}, S_t = S'_t + β_t k_t (v_t − S'_tᵀ k_t)ᵀ, o_t = scale · q_tᵀ S_t, a position at a
        time: the recurrence the parallel form, `reference()`, equals."""
        x, n_q = self.reference_inputs(q, k, v, key_padding_mask)  # log_decay: log a_t, (B, H, N, D)
        state = x["k"].new_zeros(*x["k"].shape[:2], x["k"].shape[-1], x["v"].shape[-1])
        out = []
        for t in range(x["k"].shape[2]):
            k_t, v_t, beta = x["k"][:, :, t], x["v"][:, :, t], x["beta"][:, :, t, None]
            state = x["log_decay"][:, :, t, :, None].exp() * state  # diag(a_t) S_{t-1}: a decay per key dim
            error = v_t - (k_t[..., None, :] @ state)[..., 0, :]  # v_t − S'_tᵀ k_t: what the state gets wrong
            state = state + k_t[..., :, None] * (beta * error)[..., None, :]  # ... stored with strength β_t
            out.append(x["q"][:, :, t, None] @ state)
        return torch.cat(out, 2)[:, :, -n_q:]
