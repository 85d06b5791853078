"""Retention (RetNet): Sun et al. 2023, "Retentive Network: A Successor to Transformer for Large Language Models".

Linear attention with a fixed exponential decay per head, no normaliser:

    S_t = γ_h S_{t-1} + k_t v_tᵀ,   o_t = scale · q_tᵀ S_t,   γ_h = 1 − 2^(−5−h)  (h = 0 … H−1)

so o_t = Σ_{s<=t} γ_h^(t−s) (q_t·k_s) v_s: the parallel form (Q Kᵀ ⊙ D) V with D_ts = γ^(t−s), the
recurrent form one D x Dv state per head, and the chunked form between them (_recurrence.py). Head 0
forgets fastest (γ = 0.969, a reach of ~32 positions), head 7 slowest (γ = 0.99976, ~4096).

Causal by nature. RetNet's xPos rotation of q and k and its GroupNorm of the outputs belong to the
layer around the attention (the model's positions and norms), not to this interface; `scale`
(D^-½ by default) multiplies q, as RetNet scales k by D^-½. Grouped-query inputs: the decays follow the
K/V heads (γ_g, g < Hkv, shared by the group's query heads), with or without a feature map (which
repeats K first, so it needs `num_kv_heads` for grouped inputs).
"""

from __future__ import annotations


import torch

from .._base import VariantSpec, register
from ._recurrence import WHY_CAUSAL_ONLY, RecurrentAttention


@register
class Retention(RecurrentAttention):
    spec = VariantSpec(
        name="retention",
        kind="recurrent",
        summary=(
            "RetNet's retention: linear attention with a fixed decay γ_h = 1 − 2^(−5−h) per head; chunked, D x Dv state"
        ),
        style=("#393b79", "h"),
        reference="Sun et al. 2023, 'Retentive Network: A Successor to Transformer for Large Language Models'",
        time_complexity="O(N C D + N D Dv)",
        memory_complexity="O(N Dv) + one group of chunks",
        supports_non_causal=False,
        why_not_non_causal=WHY_CAUSAL_ONLY,
        subquadratic=True,
        notes=(
            "causal only; decodes with a constant D x Dv state per head; grouped K/V: the decays follow the K/V heads"
        ),
        function_options=("feature_map", "feature_dim", "feature_inputs", "rope_theta", "feature_init", "query_scaled"),
        examples=(
            (("chunk_size", 4),),
            (("chunk_size", 64),),
            (("chunk_size", 4), ("feature_map", "hedgehog"), ("feature_dim", 3)),
        ),
    )

    def decay(self, heads: int) -> torch.Tensor:
        """γ_h = 1 − 2^(−5−h) for h = 0 … H−1 (float64)."""
        return 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float64))

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        if self.feature_map is not None and self.num_kv_heads is None and self.num_heads not in (None, kv_heads):
            return (
                f"its decays follow the K/V heads, and a feature map repeats K to the query heads before the decays "
                f"are read: build it with num_kv_heads={kv_heads} for grouped-query inputs"
            )
        return super().kv_heads_unsupported_reason(kv_heads)

    def _inputs(self, q, k, v):
        b, h, n, _ = k.shape  # h: the K/V heads, or the query heads where a feature map repeated K to them
        kv_heads = self.num_kv_heads or h
        decay = self.decay(kv_heads).repeat_interleave(h // kv_heads)  # γ of each head's K/V head
        log_decay = torch.log(decay).to(k.dtype).to(k.device)[None, :, None].expand(b, h, n)
        return {"q": q, "k": k, "v": v, "log_decay": log_decay}

    def step_reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """S_t = γ S_{t-1} + k_t v_tᵀ, o_t = scale · q_tᵀ S_t, a position at a time: the recurrence the parallel
        form, `reference()`, equals. q is scaled and K/V repeated
        to the query heads by `reference_inputs`."""
        x, n_q = self.reference_inputs(q, k, v, key_padding_mask)  # log_decay: log γ of each head
        state, out = 0.0, []
        for t in range(x["k"].shape[2]):
            a = x["log_decay"][:, :, t, None, None].exp()  # γ (1 at a padded position, whose k is 0)
            state = a * state + x["k"][:, :, t, :, None] * x["v"][:, :, t, None, :]  # S_t = γ S_{t-1} + k_t v_tᵀ
            out.append(x["q"][:, :, t, None] @ state)
        return torch.cat(out, 2)[:, :, -n_q:]
