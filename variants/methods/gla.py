"""Gated Linear Attention: Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient Training".

A decay per key dimension, data-dependent:

    α_t = σ(k_t W_α,h + b_α,h)^(1/16)   (a vector of D gates; log α_t = logsigmoid(·) / 16)
    S_t = diag(α_t) S_{t-1} + k_t v_tᵀ,   o_t = scale · q_tᵀ S_t

so each key dimension forgets at its own rate: o_t = Σ_{s<=t} Σ_d q_td k_sd Π_{s<r<=t} α_rd v_s. The
exponent 1/16 keeps the gates near 1 (σ(0)^(1/16) = 0.958), as the paper's normaliser τ = 16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._base import VariantSpec, register
from ._recurrence import WHY_CAUSAL_ONLY, RecurrentAttention

LOG_DECAY_FLOOR = -5.0  # log α_t >= this: the chunked form's factors stay inside float32 (module docstring)
GATE_NORMALIZER = 16  # α = σ(·)^(1/16)


@register
class GatedLinearAttention(RecurrentAttention):
    """Computed chunk-wise (_recurrence.py): a per-dimension decay cannot be split into a query and a key
    factor that are both <= 1 inside a chunk, so it is taken relative to the chunk's middle position;
    with log α_t floored at −5 (α >= 0.0067: it bites only where σ(·) < e^-80, i.e. logits below −80)
    the factors stay within exp(±40) for chunks of up to 16 positions, the default here (flash-linear-
    attention's GLA kernels split their chunks into sub-chunks of 16 for the same reason).

    The gates come from the keys (learned W_α (H, D, D), b_α per head), since the interface hands a
    variant q, k, v only; the GLA layer computes them from the hidden state through a low-rank
    projection. Causal by nature. `scale` (D^-½ by default) multiplies q, as in the paper.
    """

    spec = VariantSpec(
        name="gla",
        kind="recurrent",
        summary=(
            "gated linear attention: a data-dependent decay per key dim, σ(k W_α + b_α)^(1/16); chunked, D x Dv state"
        ),
        style=("#8c6d31", "P"),
        reference="Yang et al. 2024, 'Gated Linear Attention Transformers with Hardware-Efficient Training'",
        time_complexity="O(N C D + N D Dv)",
        memory_complexity="O(N (D + Dv)) + one group of chunks",
        supports_non_causal=False,
        why_not_non_causal=WHY_CAUSAL_ONLY,
        subquadratic=True,
        notes="causal only; needs num_heads and head_dim (gates per head from the keys); chunk_size <= 16; "
        "log α floored at −5; decodes with a constant D x Dv state",
        function_options=("feature_map", "feature_dim", "feature_inputs", "rope_theta", "feature_init", "query_scaled"),
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
            chunk_size: C, positions per chunk (at most 16, see the module docstring). A tuning knob: the
                result does not depend on it.
        """
        super().__init__(chunk_size=chunk_size, **options)
        heads, key_dim = self._require_shape_hints()
        self.w_alpha = nn.Parameter(torch.randn(heads, key_dim, key_dim) * key_dim**-0.5)
        self.b_alpha = nn.Parameter(torch.zeros(heads, key_dim))

    def _inputs(self, q, k, v):
        logits = torch.matmul(k, self.w_alpha.to(k.dtype)) + self.b_alpha.to(k.dtype)[:, None]  # (B, H, L, D)
        log_decay = (F.logsigmoid(logits) / GATE_NORMALIZER).clamp_min(LOG_DECAY_FLOOR)  # (B, H, L, D)
        return {"q": q, "k": k, "v": v, "log_decay": log_decay}

    def step_reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """S_t = diag(α_t) S_{t-1} + k_t v_tᵀ, o_t = scale · q_tᵀ S_t, a position at a time: the recurrence the
        parallel form, `reference()`, equals. q is scaled and K/V repeated
        to the query heads by `reference_inputs`."""
        x, n_q = self.reference_inputs(q, k, v, key_padding_mask)  # log_decay: log α_t, (B, H, N, D)
        state, out = 0.0, []
        for t in range(x["k"].shape[2]):
            a = x["log_decay"][:, :, t, :, None].exp()  # α_t: a decay per key dim (rows of S)
            state = a * state + x["k"][:, :, t, :, None] * x["v"][:, :, t, None, :]
            out.append(x["q"][:, :, t, None] @ state)
        return torch.cat(out, 2)[:, :, -n_q:]
