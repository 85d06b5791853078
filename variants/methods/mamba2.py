"""Mamba-2's SSD as attention: Dao & Gu 2024, "Transformers are SSMs" (state space duality).

A scalar, data-dependent decay per head and position, and values scaled by the step size:

    Δ_t = softplus(k_t·w_Δ,h + b_Δ,h),   a_t = exp(−exp(A_log_h) · Δ_t)
    S_t = a_t S_{t-1} + k_t (Δ_t v_t)ᵀ,  o_t = scale · q_tᵀ S_t

(Mamba's C, B, x are our q, k, v.) Its parallel form is masked attention (Q Kᵀ ⊙ L) (Δ V) with
L_ts = Π_{s<r<=t} a_r, "1-semiseparable"; computed chunk-wise with a D x Dv state (_recurrence.py).
A small Δ keeps the state (a ≈ 1) and writes little; a large Δ forgets and writes strongly.
"""

from __future__ import annotations

import torch

from .._base import VariantSpec, register
from ._recurrence import WHY_CAUSAL_ONLY, RecurrentAttention, SSDDecay


@register
class Mamba2(RecurrentAttention):
    """The gates come from the keys (learned w_Δ, b_Δ, A_log per head), since the interface hands a variant
    q, k, v only; Mamba-2 computes Δ from the layer's input x. Initialised as Mamba-2: A over [1, 16],
    softplus(b_Δ) over [0.001, 0.1]. Mamba-2 has no softmax scale; `scale` (D^-½ by default, as the
    other methods here) multiplies q. Causal by nature; the short convolution and gating of the Mamba-2
    block are the layer's.
    """

    spec = VariantSpec(
        position_study=True,
        name="mamba2",
        kind="recurrent",
        family="decaying recurrences",
        summary=(
            "Mamba-2's SSD as attention: scalar data-dependent decay exp(−A Δ_t), values scaled by Δ_t; chunked, D x "
            "Dv state"
        ),
        style=("#637939", "H"),
        reference=(
            "Dao & Gu 2024, 'Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured "
            "State Space Duality'"
        ),
        time_complexity="O(N C D + N D Dv)",
        memory_complexity="O(N Dv) + one group of chunks",
        supports_non_causal=False,
        why_not_non_causal=WHY_CAUSAL_ONLY,
        subquadratic=True,
        notes=(
            "causal only; needs num_heads and head_dim (gates per head from the keys); decodes with a constant D x Dv "
            "state"
        ),
        function_options=("feature_map", "feature_dim", "feature_inputs", "rope_theta", "feature_init", "query_scaled"),
        examples=(
            (("chunk_size", 4),),
            (("chunk_size", 64),),
            (("chunk_size", 4), ("feature_map", "hedgehog"), ("feature_dim", 3)),
            (("chunk_size", 4), ("feature_map", "hedgehog"), ("feature_inputs", "pre_rope")),
            (("chunk_size", 4), ("feature_map", "hedgehog"), ("feature_init", "kaiming"), ("query_scaled", False)),
        ),
    )

    def __init__(self, **options):
        super().__init__(**options)
        heads, key_dim = self._require_shape_hints()
        self.dt = SSDDecay(heads, key_dim)

    def _inputs(self, q, k, v):
        log_decay, dt = self.dt(k)
        return {"q": q, "k": k, "v": v * dt[..., None], "log_decay": log_decay}

    def step_reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """S_t = a_t S_{t-1} + k_t (Δ_t v_t)ᵀ, o_t = scale · q_tᵀ S_t, a position at a time: the recurrence the
        parallel form, `reference()`, equals. q is scaled and K/V repeated to the query heads by
        `reference_inputs`; a small Δ_t keeps S (a_t ≈ 1) and writes little, a large one rewrites it."""
        x, n_q = self.reference_inputs(q, k, v, key_padding_mask)  # v: Δ_t v_t; log_decay: −exp(A_log) Δ_t
        state, out = 0.0, []
        for t in range(x["k"].shape[2]):
            a = x["log_decay"][:, :, t, None, None].exp()  # a_t = exp(−exp(A_log) Δ_t), a scalar per head
            state = a * state + x["k"][:, :, t, :, None] * x["v"][:, :, t, None, :]
            out.append(x["q"][:, :, t, None] @ state)
        return torch.cat(out, 2)[:, :, -n_q:]
