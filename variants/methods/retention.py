"""Retention (RetNet): Sun et al. 2023, "Retentive Network: A Successor to Transformer for Large Language Models".

Linear attention with a fixed exponential decay per head, no normaliser:

    S_t = γ_h S_{t-1} + k_t v_tᵀ,   o_t = scale · q_tᵀ S_t,   γ_h = 1 − 2^(−5−h)  (h = 0 … H−1)

so o_t = Σ_{s<=t} γ_h^(t−s) (q_t·k_s) v_s: the parallel form (Q Kᵀ ⊙ D) V with D_ts = γ^(t−s), the
recurrent form one D x Dv state per head, and the chunked form between them (_recurrence.py). Head 0
forgets fastest (γ = 0.969, a reach of ~32 positions), head 7 slowest (γ = 0.99976, ~4096).

Causal by nature. RetNet's xPos rotation of q and k and its GroupNorm of the outputs belong to the
layer around the attention (the model's positions and norms), not to this interface; `scale`
(D^-½ by default) multiplies q, as RetNet scales k by D^-½.
"""

from __future__ import annotations


import torch

from .._base import VariantSpec, register
from ._recurrence import WHY_CAUSAL_ONLY, RecurrentAttention


@register
class Retention(RecurrentAttention):
    spec = VariantSpec(
        name="retention",
        summary="RetNet's retention: linear attention with a fixed decay γ_h = 1 − 2^(−5−h) per head; chunked, D x Dv state",
        style=("#393b79", "h"),
        reference="Sun et al. 2023, 'Retentive Network: A Successor to Transformer for Large Language Models'",
        time_complexity="O(N C D + N D Dv)",
        memory_complexity="O(N Dv) + one group of chunks",
        supports_non_causal=False,
        why_not_non_causal=WHY_CAUSAL_ONLY,
        subquadratic=True,
        notes="causal only; decodes with a constant D x Dv state per head",
        function_options=("feature_map", "feature_dim"),
        examples=(
            (("chunk_size", 4),),
            (("chunk_size", 64),),
            (("chunk_size", 4), ("feature_map", "hedgehog"), ("feature_dim", 3)),
        ),
    )

    def decay(self, heads: int) -> torch.Tensor:
        """γ_h = 1 − 2^(−5−h) for h = 0 … H−1 (float64)."""
        return 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float64))

    def _inputs(self, q, k, v):
        b, h, n, _ = k.shape
        log_decay = torch.log(self.decay(h)).to(k.dtype).to(k.device)[None, :, None].expand(b, h, n)
        return {"q": q, "k": k, "v": v, "log_decay": log_decay}
