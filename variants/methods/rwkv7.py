"""RWKV-7 "Goose": Peng et al. 2025, "RWKV-7 'Goose' with Expressive Dynamic State Evolution".

The generalised delta rule: a decay per key channel w_t and an in-context learning rate a_t per channel,

    S_t = (diag(w_t) − (a_t ⊙ κ̂_t) κ̂_tᵀ) S_{t-1} + k_t v_tᵀ,      o_t = scale · q_tᵀ S_t

(S is D x Dv here, rows over key dims; the paper writes its transpose.) κ̂_t = normalise(k_t ⊙ ξ_h) is the
removal key: the state forgets, per channel, a fraction a_t of what it stored along κ̂_t, then adds the new
association — a diagonal-plus-rank-one transition (DPLR), more expressive than the delta rule's. The gates:

    w_t = exp(−e^−½ σ(k_t W_w,h + b_w,h)),   a_t = σ(k_t W_a,h + b_a,h)       (from the keys, per head)

Computed as the recurrence it is, position by position (a D x Dv update each: O(N D Dv)), in groups of
GROUP positions that a backward recomputes from the state before them (memory: the states at the groups'
edges and one group's graph). RWKV-7's token shift, its key's lerp with a and its output gate are the layer's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, register
from ._recurrence import _GroupedScan, _scan_groups

GROUP = 256  # positions a backward recomputes at once
DECAY_SCALE = math.exp(-0.5)  # w = exp(−e^−½ σ(·)) lies in [0.545, 1]


class DplrGates(nn.Module):
    """log w_t, a_t (B, H, N, D) and the removal key κ̂_t of keys (B, H, N, D), per head: the weights start small
    (the gates near their biases), b_w spread so channels forget at rates from fast to slow, a = σ(0) = ½."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.w_w = nn.Parameter(torch.randn(heads, head_dim, head_dim) * head_dim**-0.5 * 0.1)
        self.b_w = nn.Parameter(torch.linspace(-6.0, 2.0, head_dim).expand(heads, head_dim).clone())
        self.w_a = nn.Parameter(torch.randn(heads, head_dim, head_dim) * head_dim**-0.5 * 0.1)
        self.b_a = nn.Parameter(torch.zeros(heads, head_dim))
        self.xi = nn.Parameter(torch.ones(heads, head_dim))

    def forward(self, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        log_w = -DECAY_SCALE * torch.sigmoid(torch.matmul(k, self.w_w.to(k.dtype)) + self.b_w.to(k.dtype)[:, None])
        a = torch.sigmoid(torch.matmul(k, self.w_a.to(k.dtype)) + self.b_a.to(k.dtype)[:, None])
        removal = F.normalize(k * self.xi.to(k.dtype)[:, None], dim=-1, eps=1e-6)
        return log_w, a, removal


def dplr_steps(q, k, v, log_w, a, removal, keep, state, scale):
    """The recurrence over the positions of q (B, Hkv, G, L, D) — each K/V head's group of queries — and k, v,
    log_w, a, removal (B, Hkv, L, ·) from state (B, Hkv, D, Dv); keep (B, 1, L) or None (0: skipped). Returns
    the outputs (B, Hkv, G, L, Dv) and the state after them."""
    outs = []
    for t in range(k.shape[2]):
        kk = removal[:, :, t]
        read = torch.einsum("bhd,bhde->bhe", kk, state)  # κ̂ᵀ S
        new = (
            log_w[:, :, t, :, None].exp() * state
            - (a[:, :, t] * kk)[..., None] * read[:, :, None, :]
            + k[:, :, t, :, None] * v[:, :, t, None, :]
        )
        state = new if keep is None else torch.where(keep[:, :, t, None, None] > 0, new, state)
        outs.append(torch.einsum("bhgd,bhde->bhge", q[:, :, :, t], state))
    return torch.stack(outs, dim=3) * scale, state


@register
class RWKV7(AttentionVariant):
    """Grouped-query inputs are computed natively: the gates, the writes and the state are per K/V head, read by
    the group's query heads. Padding skips a position (no decay, no write). Half precision runs in float32."""

    spec = VariantSpec(
        name="rwkv7",
        kind="recurrent",
        summary="RWKV-7: the generalised delta rule, a per-channel decay and in-context learning rate (DPLR); D x Dv state",
        style=("#bd9e39", "h"),
        reference="Peng et al. 2025, \"RWKV-7 'Goose' with Expressive Dynamic State Evolution\"",
        time_complexity="O(N D Dv)",
        memory_complexity="O(N Dv) + one group's graph",
        supports_non_causal=False,
        why_not_non_causal="a recurrence over positions: the state at t holds positions <= t only",
        subquadratic=True,
        notes="causal only; needs num_heads and head_dim (gates per head from the keys); decodes with a constant "
        "D x Dv state",
        examples=((("group", 4),), (("group", 64),)),
    )
    state_kind = "recurrent"

    def __init__(self, *, group: int = GROUP, **base):
        """
        Args:
            group: positions a backward recomputes at once. A tuning knob: the result does not depend on it.
            scale: factor of q in o_t = scale · q_tᵀ S_t; None means D ** -0.5.
        """
        super().__init__(**base)
        self._check_int("group", group, 1)
        self._require_head_shape("its gates are parameters per head over the key dims")
        self.group = group
        self.gates = DplrGates(self._kv_parameter_heads(), self.head_dim)

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        return self._kv_parameters_reason(kv_heads, "its gates are")

    def _scan(self, q, k, v, keep, state):
        """Outputs (B, H, L, Dv) of positions q, k, v from `state`, and the state after them: _recurrence.py's
        groups (with a gradient, each rebuilt in the backward from the state before it)."""
        params = tuple(p for p in self.parameters() if p.requires_grad)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, state, *params))
        if not grad:
            return _scan_groups(self, q, k, v, keep, state, None, self.group)
        return _GroupedScan.apply(self, None, self.group, keep, state, q, k, v, *params)

    def _group(self, q, k, v, keep, state, chunk=None):
        """One group's positions (q: (B, H, L, D), each K/V head's group of query heads reading its state)."""
        log_w, a, removal = self.gates(k)
        if keep is not None:  # a skipped position: no decay, no removal, no write
            log_w, a, k = log_w * keep[..., None], a * keep[..., None], k * keep[..., None]
        qg = q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))
        out, state = dplr_steps(qg, k, v, log_w, a, removal, keep, state, float(self._scale(q)))
        return out.flatten(1, 2), state

    def _attend(self, q, k, v, causal, key_padding_mask):
        if q.dtype in (torch.float16, torch.bfloat16):
            return self._attend(q.float(), k.float(), v.float(), causal, key_padding_mask).to(q.dtype)
        n_q, n_k = q.shape[-2], k.shape[-2]
        if n_q < n_k:  # the queries are the last Nq positions: zero queries before them build the state
            q = F.pad(q, (0, 0, n_k - n_q, 0))
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :].to(k.dtype)
        state = k.new_zeros(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1])
        return self._scan(q, k, v, keep, state)[0][:, :, n_k - n_q :]

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """The same recurrence in one group, no recomputation: what the grouped forward must equal."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        q = F.pad(q, (0, 0, n_k - n_q, 0))
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :].to(k.dtype)
        state = k.new_zeros(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1])
        return self._group(q, k, v, keep, state)[0][:, :, n_k - n_q :]

    # -- decoding: the state ------------------------------------------------------------------------
    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        return {"S": torch.zeros(batch, heads, head_dim, value_dim, dtype=dtype, device=device)}

    def _prefill(self, q, k, v, state, keep):
        return self._step(q, k, v, state, keep)[1]

    def _step(self, q, k, v, state, keep):
        s = state.tensors["S"]
        mask = None if keep is None else keep[:, None, :].float()
        if q.dtype in (torch.float16, torch.bfloat16):
            out, s = self._scan(q.float(), k.float(), v.float(), mask, s.float())
            out, s = out.to(q.dtype), s.to(q.dtype)
        else:
            out, s = self._scan(q, k, v, mask, s)
        return out, state.advanced(q.shape[2], S=s)

    # -- what the harness reads ------------------------------------------------------------------
    def flops(self, n_q, n_k, d, dv, causal):
        return n_k * (8.0 * d * dv + 4.0 * d * d)  # the state's update and read; the gates' two D x D maps

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        gates = batch * heads * n_k * d * 4 * 4
        group = batch * heads * min(n_k, self.group) * d * dv * 4 * (4 if backward else 0)
        edges = batch * heads * d * dv * 4 * (math.ceil(n_k / self.group) if backward else 2)
        return int(gates + group + edges) + super().memory_estimate(
            batch, heads, n_q, n_k, d, dv, element_size, causal, backward
        )

    def extra_repr(self) -> str:
        return f"group={self.group}"
