"""DeltaNet: Schlag et al. 2021, "Linear Transformers Are Secretly Fast Weight Programmers"; parallel
(chunked) form: Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length".

The state is a key -> value memory written by the delta rule instead of added to:

    β_t = σ(k_t·w_β,h + b_β,h),   k_t, q_t L2-normalised
    S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ
    o_t = scale · q_tᵀ S_t

(S is D x Dv here, rows over key dims; the papers write its transpose.) Each write moves the value
stored at k_t a fraction β_t of the way to v_t, so writing a key again replaces its value — why
DeltaNet recalls associations (MQAR) that additive linear attention blurs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._base import VariantSpec, register
from ._recurrence import NO_ONNX_SOLVE, WHY_CAUSAL_ONLY, RecurrentAttention, SigmoidGate

NORM_EPS = 1e-6  # ‖x‖ is read as at least this (an all-zero key stays zero)


def l2_normalised(x):
    """x / max(‖x‖, eps) over the head dim."""
    return F.normalize(x, dim=-1, eps=NORM_EPS)


@register
class DeltaNet(RecurrentAttention):
    """Computed chunk-wise (_recurrence.py): per chunk one triangular solve gives the chunk's corrected
    values (the WY / UT representation), then the state crosses chunks; no per-position loop.
    β comes from the raw keys (learned w_β, b_β per head), since the interface hands a variant q, k, v
    only; DeltaNet computes it from the hidden state. Causal by nature; `scale` (D^-½ by default)
    multiplies the normalised q.
    """

    spec = VariantSpec(
        name="deltanet",
        kind="recurrent",
        summary=(
            "DeltaNet: the delta rule S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ on L2-normalised q, k; chunked "
            "(WY), D x Dv state"
        ),
        style=("#7b4173", "X"),
        reference=(
            "Schlag et al. 2021, 'Linear Transformers Are Secretly Fast Weight Programmers'; Yang et al. 2024 "
            "(parallel form)"
        ),
        time_complexity="O(N C D + N D Dv)",
        memory_complexity="O(N Dv) + one group of chunks",
        supports_non_causal=False,
        why_not_non_causal=WHY_CAUSAL_ONLY,
        subquadratic=True,
        scale_is_query_factor=False,
        not_deployable=(NO_ONNX_SOLVE,),  # q is L2-normalised first: scale multiplies the normalised q
        notes=(
            "causal only; needs num_heads and head_dim (β per head from the keys); decodes with a constant D x Dv state"
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

    delta_rule = True

    def __init__(self, **options):
        super().__init__(**options)
        heads, key_dim = self._require_shape_hints()
        self.beta = SigmoidGate(heads, key_dim)

    def _inputs(self, q, k, v):
        return {"q": l2_normalised(q), "k": l2_normalised(k), "v": v, "beta": self.beta(k)}

    def step_reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ, o_t = scale · q_tᵀ S_t, a position at a time: the
        recurrence the parallel form, `reference()`, equals (the same as
        (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ)."""
        x, n_q = self.reference_inputs(q, k, v, key_padding_mask)  # q, k L2-normalised; beta: β_t
        state = x["k"].new_zeros(*x["k"].shape[:2], x["k"].shape[-1], x["v"].shape[-1])
        out = []
        for t in range(x["k"].shape[2]):
            k_t, v_t, beta = x["k"][:, :, t], x["v"][:, :, t], x["beta"][:, :, t, None]
            error = v_t - (k_t[..., None, :] @ state)[..., 0, :]  # v_t − S_{t-1}ᵀ k_t: what the state gets wrong
            state = state + k_t[..., :, None] * (beta * error)[..., None, :]  # ... stored with strength β_t
            out.append(x["q"][:, :, t, None] @ state)
        return torch.cat(out, 2)[:, :, -n_q:]
