"""Gated DeltaNet: Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(the linear attention of Qwen3-Next).

DeltaNet's delta rule with Mamba-2's scalar decay in front of it:

    β_t = σ(k_t·w_β,h + b_β,h),   log α_t = −exp(A_log_h) softplus(k_t·w_Δ,h + b_Δ,h),   q_t, k_t L2-normalised
    S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,   o_t = scale · q_tᵀ S_t

α_t erases the whole memory quickly when the context changes (Mamba-2's strength), β_t rewrites one
association precisely (DeltaNet's). Computed chunk-wise (_recurrence.py): the WY form with the decay
inside each chunk's triangular system.

The gates come from the raw keys (learned per head), since the interface hands a variant q, k, v
only; the published layer computes them from the hidden state. Initialised as Mamba-2's decay.
Causal by nature; `scale` (D^-½ by default) multiplies the normalised q.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .._base import register
from .deltanet import DeltaNet
from ._recurrence import SSDDecay


@register
class GatedDeltaNet(DeltaNet):
    spec = replace(
        DeltaNet.spec,
        position_study=True,
        name="gated_deltanet",
        family="delta rules",
        summary=(
            "Gated DeltaNet: the delta rule with a scalar data-dependent decay (Qwen3-Next); chunked (WY), D x Dv state"
        ),
        style=("#ad494a", "d"),
        reference="Yang, Kautz & Hatamizadeh 2025, 'Gated Delta Networks: Improving Mamba2 with Delta Rule'",
        notes=(
            "causal only; needs num_heads and head_dim (gates per head from the keys); decodes with a constant D x Dv "
            "state"
        ),
    )

    def __init__(self, **options):
        super().__init__(**options)  # DeltaNet's β
        heads, key_dim = self._require_shape_hints()
        self.decay = SSDDecay(heads, key_dim)  # and Mamba-2's decay in front of the delta rule

    def _inputs(self, q, k, v):
        log_decay, _ = self.decay(k)
        return {**super()._inputs(q, k, v), "log_decay": log_decay}

    def step_reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """S'_t = a_t S_{t-1}, S_t = S'_t + β_t k_t (v_t − S'_tᵀ k_t)ᵀ, o_t = scale · q_tᵀ S_t, a position at a time:
        the recurrence the parallel form, `reference()`, equals."""
        x, n_q = self.reference_inputs(q, k, v, key_padding_mask)  # log_decay: log a_t, a scalar per head
        state = x["k"].new_zeros(*x["k"].shape[:2], x["k"].shape[-1], x["v"].shape[-1])
        out = []
        for t in range(x["k"].shape[2]):
            k_t, v_t, beta = x["k"][:, :, t], x["v"][:, :, t], x["beta"][:, :, t, None]
            state = x["log_decay"][:, :, t, None, None].exp() * state  # a_t S_{t-1}: forget, then correct
            error = v_t - (k_t[..., None, :] @ state)[..., 0, :]  # v_t − S'_tᵀ k_t: what the state gets wrong
            state = state + k_t[..., :, None] * (beta * error)[..., None, :]  # ... stored with strength β_t
            out.append(x["q"][:, :, t, None] @ state)
        return torch.cat(out, 2)[:, :, -n_q:]
