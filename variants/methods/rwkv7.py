"""RWKV-7 "Goose": Peng et al. 2025, "RWKV-7 'Goose' with Expressive Dynamic State Evolution".

The generalised delta rule: a decay per key channel w_t and an in-context learning rate a_t per channel,

    S_t = (diag(w_t) − (a_t ⊙ κ̂_t) κ̂_tᵀ) S_{t-1} + k_t v_tᵀ,      o_t = scale · q_tᵀ S_t

(S is D x Dv here, rows over key dims; the paper writes its transpose.) κ̂_t = normalise(k_t ⊙ ξ_h) is the
removal key: the state forgets, per channel, a fraction a_t of what it stored along κ̂_t, then adds the new
association — a diagonal-plus-rank-one transition (DPLR), more expressive than the delta rule's. The gates:

    w_t = exp(−e^−½ σ(k_t W_w,h + b_w,h)),   a_t = σ(k_t W_a,h + b_a,h)       (from the keys, per head)

Computed chunk-wise (`dplr_chunks`, after fla's chunked DPLR form: one triangular solve a chunk, the
state carried across chunks), `dplr_steps` beside it as the position-by-position reference; groups of
GROUP positions are rebuilt by a backward. RWKV-7's token shift, lerp and output gate are the layer's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, register
from .._utils import pad_to_multiple
from ._recurrence import _GroupedScan, _chunked, _scan_groups

GROUP = 256  # positions a backward recomputes at once
CHUNK = 64  # positions of a chunk
MAX_CHUNK = 128  # the factors exp(±C/2 · 0.61) of a chunk's decay ratios stay inside float32 up to it
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


def dplr_chunks(q, k, v, log_w, alpha, kappa, state, chunk):
    """`dplr_steps`' recurrence, S_t = diag(w_t) S_{t-1} + α_t (κ̂_tᵀ S_{t-1}) + k_t v_tᵀ with α_t = −a_t ⊙ κ̂_t,
    chunk by chunk: q (B, Hkv, G, L, D) already scaled, k, log_w, α, κ̂ (B, Hkv, L, D), v (B, Hkv, L, Dv), L a
    multiple of `chunk`, from state (B, Hkv, D, Dv). Returns the outputs (B, Hkv, G, L, Dv), the state after.

    Inside a chunk, with γ_t = Π_{r<=t} w_r from its start and the unknown reads x_t = κ̂_tᵀ S_{t-1}, it is a
    gated recurrence with two writes, so the reads solve one unit-triangular system:

        S_t = diag(γ_t) S_0 + Σ_{s<=t} diag(γ_t / γ_s) (α_s x_sᵀ + k_s v_sᵀ)
        X = (I − M_α)⁻¹ (diag(γ_{t-1}) κ̂ S_0 + M_k V),   M_y[t, s] = Σ_d κ̂_td (γ_{t-1} / γ_s)_d y_sd  (s < t)
        O = diag(γ) Q S_0 + (Q ⊙ Γ) [Aᵀ; Kᵀ] [X; V]  (s <= t),   S_C = γ_C S_0 + Σ_s (γ_C / γ_s) (α_s x_sᵀ + k_s v_sᵀ)

    Since w_t >= 0.545, each ratio γ_t / γ_s is split at the chunk's middle: factors within exp(±C/2 · 0.61)
    (C = 64: exp(±19.4), inside float32)."""
    kc, vc, ac, kappa_c, lw = _chunked(k, v, alpha, kappa, log_w, chunk=chunk)  # (B, Hkv, c, C, ·)
    qc = q.unflatten(3, (-1, chunk))  # (B, Hkv, G, c, C, D)
    b = lw.cumsum(3)  # log γ_t, inclusive
    before = b - lw  # log γ_{t-1}
    mid = b[:, :, :, chunk // 2 : chunk // 2 + 1]
    into = (mid - b).exp()  # 1 / γ_s, relative to the middle
    a_in, k_in = ac * into, kc * into
    reads = kappa_c * (before - mid).exp()  # κ̂_t γ_{t-1}, relative to the middle
    m_a = torch.matmul(reads, a_in.transpose(-1, -2)).tril_(-1)  # (B, Hkv, c, C, C), s < t
    m_k = torch.matmul(reads, k_in.transpose(-1, -2)).tril_(-1)
    q_mid = qc * (b - mid).exp()[:, :, None]
    q_a = torch.matmul(q_mid, a_in[:, :, None].transpose(-1, -2)).tril_()  # (B, Hkv, G, c, C, C), s <= t
    q_k = torch.matmul(q_mid, k_in[:, :, None].transpose(-1, -2)).tril_()
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device).expand_as(m_a)
    solve = torch.linalg.solve_triangular(-m_a, eye, upper=False, unitriangular=True)  # (I − M_α)⁻¹
    w_read = torch.matmul(solve, kappa_c * before.exp())  # X = W S_0 + U'
    u_known = torch.matmul(solve, torch.matmul(m_k, vc))
    q_gamma = qc * b.exp()[:, :, None]
    out = torch.matmul(q_k, vc[:, :, None])  # (B, Hkv, G, c, C, Dv): the writes of v inside the chunk
    total = b[:, :, :, -1]  # (B, Hkv, c, D)
    to_end = (total[:, :, :, None] - b).exp()
    a_out = (ac * to_end).transpose(-1, -2)
    writes = torch.matmul((kc * to_end).transpose(-1, -2), vc)  # (B, Hkv, c, D, Dv)
    for i in range(kc.shape[2]):  # across chunks: the state
        x = torch.matmul(w_read[:, :, i], state) + u_known[:, :, i]  # the reads κ̂_tᵀ S_{t-1}: (B, Hkv, C, Dv)
        seen = torch.matmul(q_gamma[:, :, :, i], state[:, :, None]) + torch.matmul(q_a[:, :, :, i], x[:, :, None])
        out[:, :, :, i] += seen
        state = total[:, :, i, :, None].exp() * state + torch.matmul(a_out[:, :, i], x) + writes[:, :, i]
    return out.flatten(3, 4), state


@register
class RWKV7(AttentionVariant):
    """Grouped-query inputs are computed natively: the gates, the writes and the state are per K/V head, read by
    the group's query heads. Padding skips a position (no decay, no write). Half precision runs in float32."""

    spec = VariantSpec(
        name="rwkv7",
        kind="recurrent",
        summary="RWKV-7: the generalised delta rule, a per-channel decay and in-context learning rate (DPLR), chunked; D x Dv state",
        style=("#bd9e39", "h"),
        reference="Peng et al. 2025, \"RWKV-7 'Goose' with Expressive Dynamic State Evolution\"",
        time_complexity="O(N C D + N D Dv)",
        memory_complexity="O(N Dv) + one group's graph",
        supports_non_causal=False,
        why_not_non_causal="a recurrence over positions: the state at t holds positions <= t only",
        subquadratic=True,
        notes="causal only; needs num_heads and head_dim (gates per head from the keys); decodes with a constant "
        "D x Dv state",
        examples=((("group", 4),), (("chunk_size", 4),), (("chunk_size", 3), ("group", 8))),
    )
    state_kind = "recurrent"

    def __init__(self, *, group: int = GROUP, chunk_size: int = CHUNK, **base):
        """
        Args:
            group: positions a backward recomputes at once. A tuning knob: the result does not depend on it.
            chunk_size: C, positions of a chunk (the C x C form inside, the state across); at most MAX_CHUNK
                (128), past which the ratios of decays inside a chunk would leave float32. A tuning knob, as group.
            scale: factor of q in o_t = scale · q_tᵀ S_t; None means D ** -0.5.
        """
        super().__init__(**base)
        self._check_int("group", group, 1)
        self._check_int("chunk_size", chunk_size, 1)
        if chunk_size > MAX_CHUNK:
            raise ValueError(
                f"rwkv7: option chunk_size={chunk_size} is invalid; expected an int in 1..{MAX_CHUNK} (the decays "
                f"inside a chunk are taken relative to its middle: their factors exp(±C/2 · 0.61) stay inside "
                f"float32 up to {MAX_CHUNK})"
            )
        self._require_head_shape("its gates are parameters per head over the key dims")
        self.group, self.chunk_size = group, chunk_size
        self.gates = DplrGates(self._kv_parameter_heads(), self.head_dim)

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        return self._kv_parameters_reason(kv_heads, "its gates are")

    def _scan(self, q, k, v, keep, state):
        """Outputs (B, H, L, Dv) of positions q, k, v from `state`, and the state after them: _recurrence.py's
        groups (with a gradient, each rebuilt in the backward from the state before it)."""
        params = tuple(p for p in self.parameters() if p.requires_grad)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, state, *params))
        if not grad:
            return _scan_groups(self, q, k, v, keep, state, self.chunk_size, self.group)
        return _GroupedScan.apply(self, self.chunk_size, self.group, keep, state, q, k, v, *params)

    def _group(self, q, k, v, keep, state, chunk=None):
        """One group's positions (q: (B, H, L, D), each K/V head's group of query heads reading its state): in
        chunks of `chunk` (the last padded with skipped positions), or position by position (chunk None, or
        fewer positions than a chunk)."""
        log_w, a, removal = self.gates(k)
        if keep is not None:  # a skipped position: no decay, no removal, no write
            log_w, a, k = log_w * keep[..., None], a * keep[..., None], k * keep[..., None]
        qg = q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))
        scale, n = float(self._scale(q)), k.shape[2]
        if chunk is None or n < chunk:
            out, state = dplr_steps(qg, k, v, log_w, a, removal, keep, state, scale)
            return out.flatten(1, 2), state
        padded = [pad_to_multiple(x, chunk, dim=-2)[0] for x in (k, v, log_w, -a * removal, removal)]
        out, state = dplr_chunks(pad_to_multiple(qg * scale, chunk, dim=-2)[0], *padded, state, chunk)
        return out[..., :n, :].flatten(1, 2), state

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
        """The same recurrence position by position (`dplr_steps`), in one group, no recomputation: what the
        chunked and grouped forward must equal."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        q = F.pad(q, (0, 0, n_k - n_q, 0))
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :].to(k.dtype)
        state = k.new_zeros(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1])
        return self._group(q, k, v, keep, state, chunk=None)[0][:, :, n_k - n_q :]

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
        # the chunked form, per position: four C-wide products over the key dims (M_α, M_k, the query's two) and
        # four over the values, the triangular solve, the state read and written (8 D Dv), the gates' two D x D maps
        c = min(self.chunk_size, n_k)
        return n_k * (8.0 * c * (d + dv) + c * (d + dv) + 8.0 * d * dv + 4.0 * d * d)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        c = min(self.chunk_size, n_k)  # one group's chunk matrices (C x C) and its gates and factors (D, Dv)
        group = batch * heads * min(n_k, self.group) * (4 * c + 12 * d + 4 * dv) * 4 * (4 if backward else 2)
        edges = batch * heads * d * dv * 4 * (math.ceil(n_k / self.group) if backward else 2)
        return int(group + edges) + super().memory_estimate(
            batch, heads, n_q, n_k, d, dv, element_size, causal, backward
        )

    def extra_repr(self) -> str:
        return f"group={self.group}, chunk_size={self.chunk_size}"
