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

from .._base import VariantSpec, register
from ._recurrence import NO_ONNX_SOLVE, WHY_CAUSAL_ONLY, RecurrentAttention, SSDDecay, SigmoidGate
from .deltanet import l2_normalised


@register
class GatedDeltaNet(RecurrentAttention):
    spec = VariantSpec(
        name="gated_deltanet",
        summary="Gated DeltaNet: the delta rule with a scalar data-dependent decay (Qwen3-Next); chunked (WY), D x Dv state",
        style=("#ad494a", "d"),
        reference="Yang, Kautz & Hatamizadeh 2025, 'Gated Delta Networks: Improving Mamba2 with Delta Rule'",
        time_complexity="O(N C D + N D Dv)",
        memory_complexity="O(N Dv) + one group of chunks",
        supports_non_causal=False,
        why_not_non_causal=WHY_CAUSAL_ONLY,
        subquadratic=True,
        scale_is_query_factor=False,
        not_deployable=(NO_ONNX_SOLVE,),  # q is L2-normalised first: scale multiplies the normalised q
        notes="causal only; needs num_heads and head_dim (gates per head from the keys); decodes with a constant D x Dv state",
        function_options=("feature_map", "feature_dim"),
        examples=((("chunk_size", 4),), (("chunk_size", 64),), (("chunk_size", 4), ("feature_map", "hedgehog"), ("feature_dim", 3))),
    )

    delta_rule = True

    def __init__(self, **options):
        super().__init__(**options)
        heads, key_dim = self._require_shape_hints()
        self.beta = SigmoidGate(heads, key_dim)
        self.decay = SSDDecay(heads, key_dim)

    def _inputs(self, q, k, v):
        log_decay, _ = self.decay(k)
        return {"q": l2_normalised(q), "k": l2_normalised(k), "v": v, "beta": self.beta(k), "log_decay": log_decay}
