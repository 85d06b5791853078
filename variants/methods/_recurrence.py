"""The chunked engine of the gated linear recurrences (retention, mamba2, gla, deltanet, gated_deltanet, kda).

Each of those methods is a recurrence over positions t of a state S_t, a D x Dv matrix per head
(rows: key dims), read by the query: o_t = scale · q_tᵀ S_t. Two families:

    gated:       S_t = diag(a_t) S_{t-1} + k_t v_tᵀ                       (retention, mamba2, gla)
    delta rule:  S_t = (I − β_t k_t k_tᵀ) diag(a_t) S_{t-1} + β_t k_t v_tᵀ  (deltanet: a_t = 1; gated_deltanet; kda)

with a_t = exp(log_decay_t) a scalar per head and position, or (gla, kda) a vector over the key dims. The
delta rule writes S_t = a_t S_{t-1} + k_t u_tᵀ with u_t = β_t (v_t − a_t S_{t-1}ᵀ k_t): it stores the
error of the state's prediction of v_t for k_t, so writing a key twice replaces its value.

How this file computes them: the comments above `decay_matrix` and `_scan_groups`, and `RecurrentAttention`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base import AttentionVariant
from .._utils import pad_to_multiple, spans
from .linear import MapInputs, learned_feature_maps

WHY_CAUSAL_ONLY = (
    "a recurrence over positions: the state at t holds positions <= t only"  # each spec's why_not_non_causal
)
NO_ONNX_SOLVE = ("onnx", "torch.onnx has no conversion for aten.linalg_solve_triangular, the chunks' triangular solve")
GROUP_POSITIONS = (
    512  # positions computed at once (a multiple of the chunk); 1024: 12 MiB more forward memory at H = 8, D = 64
)


# -- the parallel (dense) forms: the methods' definitions ------------------------------------------


# A method file (retention.py, ...) computes the recurrence's inputs from q, k, v and its learned gates
# (`RecurrentAttention.recurrence_inputs`); this file computes the outputs of any such inputs:
#
# - `dense_gated`, `dense_delta`: the parallel (quadratic) form over the whole sequence
#   (`RecurrentAttention.reference`; each method file's `step_reference()` is its recurrence a position at
#   a time, and equals it): gated O = (Q Kᵀ ⊙ D) V with D_ts = exp(Σ_{s<r<=t} log a_r) (per key dim for gla);
#   delta rule O = (Q Kᵀ ⊙ D) U with U = (I + A)⁻¹ diag(β) V, A_ts = β_t D_ts k_t·k_s for s < t.
# - `gated_chunks`, `delta_chunks`: the chunked form (Yang et al. 2024): inside a chunk of C positions the
#   masked C x C form, across chunks the state. For the delta rule each chunk's U comes from a triangular
#   solve (the WY / UT representation: U = U' − W S, both from one solve of (I + A) per chunk), then a
#   loop over chunks (never over positions) carries S. Every exponent is of a difference of cumulative
#   log decays with the later position first (≤ 0), so nothing overflows; gla's per-dimension decay
#   cannot be split that way inside a chunk and is taken relative to the chunk's middle instead,
#   which bounds its factors by exp(C/2 · 5) with its floor on log a_t (see gla.py).
def decay_matrix(log_decay: Tensor) -> Tensor:
    """D_ts = exp(Σ_{s<r<=t} log a_r) for t >= s, 0 above the diagonal: (B, H, N, N), or (B, H, N, N, D) per key dim."""
    b = log_decay.cumsum(2)  # (B, H, N) or (B, H, N, D)
    diff = b[:, :, :, None] - b[:, :, None, :]
    n = log_decay.shape[2]
    lower = torch.ones(n, n, dtype=torch.bool, device=log_decay.device).tril()
    lower = lower if log_decay.dim() == 3 else lower[..., None]
    return diff.masked_fill(~lower, -math.inf).exp()


def dense_gated(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor) -> Tensor:
    """o_t = Σ_{s<=t} (q_t ⊙ D_ts)·k_s v_s, every weight stored (O(N²), O(N² D) for a vector decay)."""
    d = decay_matrix(log_decay)
    if log_decay.dim() == 3:
        return torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * d, v)
    return torch.matmul(torch.einsum("bhtd,bhsd,bhtsd->bhts", q, k, d), v)


def dense_delta(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor | None) -> Tensor:
    """The delta rule's parallel form: U = (I + A)⁻¹ diag(β) V, O = (Q Kᵀ ⊙ D) U (see the module docstring)."""
    n = q.shape[2]
    d = decay_matrix(log_decay if log_decay is not None else beta.new_zeros(beta.shape))
    if d.dim() == 5:  # per key dim (kda): Σ_d x_td D_tsd k_sd
        kk, qk = (torch.einsum("bhtd,bhsd,bhtsd->bhts", x, k, d) for x in (k, q))
    else:
        kk, qk = torch.matmul(k, k.transpose(-1, -2)) * d, torch.matmul(q, k.transpose(-1, -2)) * d
    a = kk.tril(-1) * beta[..., None]
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(a + eye, v * beta[..., None], upper=False, unitriangular=True)
    return torch.matmul(qk, u)


# -- the chunked forms ---------------------------------------------------------------------------


def _chunked(*tensors: Tensor, chunk: int) -> list[Tensor]:
    return [t.unflatten(2, (-1, chunk)) for t in tensors]  # (B, H, L, ·) -> (B, H, c, C, ·)


def _earlier_weights(total: Tensor) -> tuple[Tensor, Tensor]:
    """From each chunk's total log decay (B, H, c): weights (B, H, c, c) = exp(decay between the end of
    chunk u and the start of chunk t) for u < t, 0 otherwise, and exp(decay before chunk t)."""
    after = total.cumsum(2)  # decay up to the end of each chunk
    before = after - total  # up to its start
    diff = before[:, :, :, None] - after[:, :, None, :]
    c = total.shape[2]
    earlier = torch.ones(c, c, dtype=torch.bool, device=total.device).tril(-1)
    return diff.masked_fill(~earlier, -math.inf).exp(), before.exp()


def gated_chunks(
    q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, state: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """Gated recurrence over L positions (a multiple of `chunk`) from `state` (B, H, D, Dv).

    q, k: (B, H, L, D) (q already scaled); v: (B, H, L, Dv); log_decay: (B, H, L) or (B, H, L, D).
    Returns the outputs (B, H, L, Dv) and the state after the last position.
    """
    qc, kc, vc = _chunked(q, k, v, chunk=chunk)
    vector = log_decay.dim() == 4
    b = log_decay.unflatten(2, (-1, chunk)).cumsum(3)  # (B, H, c, C[, D]): decay from the chunk's start, inclusive
    total = b[:, :, :, -1]  # (B, H, c[, D])
    if vector:  # relative to the middle position: both factors stay within exp(±C/2 · floor)
        mid = b[:, :, :, chunk // 2 : chunk // 2 + 1]
        q_mid, k_mid = qc * (b - mid).exp(), kc * (mid - b).exp()
        scores = torch.matmul(q_mid, k_mid.transpose(-1, -2)).tril_()
        # the factors from the chunk's start and to its end, from the same two exponentials (both <= 1 in all)
        q_in, k_out = q_mid * mid.exp(), k_mid * (total[:, :, :, None] - mid).exp()
    else:
        lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
        inside = (b[..., :, None] - b[..., None, :]).masked_fill_(~lower, -math.inf).exp_()  # (B, H, c, C, C)
        scores = torch.matmul(qc, kc.transpose(-1, -2)).mul_(inside)
        q_in, k_out = qc * b.exp()[..., None], kc * (total[..., None] - b).exp()[..., None]
    writes = torch.matmul(k_out.transpose(-1, -2), vc)  # (B, H, c, D, Dv): each chunk's additions, decayed to its end
    out = torch.matmul(scores, vc)
    if vector:  # per key dim, the chunks' weights would be c x c x D: carry the state chunk by chunk instead
        decay = total.exp()[..., None]  # (B, H, c, D, 1)
        for i in range(qc.shape[2]):
            out[:, :, i] += torch.matmul(q_in[:, :, i], state)
            state = decay[:, :, i] * state + writes[:, :, i]
        return out.flatten(2, 3), state
    weights, before = _earlier_weights(total)
    state_before = (
        torch.matmul(weights, writes.flatten(3)).view_as(writes) + before[..., None, None] * state[:, :, None]
    )
    out += torch.matmul(q_in, state_before)
    return out.flatten(2, 3), total[:, :, -1].exp()[..., None, None] * state_before[:, :, -1] + writes[:, :, -1]


def delta_chunks(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor | None, state: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """Delta-rule recurrence over L positions (a multiple of `chunk`) from `state` (B, H, D, Dv).

    q, k: (B, H, L, D) (q already scaled); v: (B, H, L, Dv); beta: (B, H, L); log_decay: (B, H, L), (B, H, L, D)
    per key dim (kda: S_t = (I − β_t k_t k_tᵀ) diag(a_t) S_{t-1} + β_t k_t v_tᵀ, γ then a vector), or None.
    Per chunk, with γ_t = exp(b_t) the decay from the chunk's start and S the state before it:
        U = U' − W S,  (I + A) [W, U'] = [diag(β γ) K, diag(β) V],  A_ts = β_t (γ_t / γ_s) k_t·k_s (s < t)
        O = diag(γ) Q S + (Q Kᵀ ⊙ Γ) U,  S ← γ_C S + (K ⊙ γ_C / γ)ᵀ U
    """
    qc, kc, vc = _chunked(q, k, v, chunk=chunk)
    bc = beta.unflatten(2, (-1, chunk))  # (B, H, c, C)
    if log_decay is not None and log_decay.dim() == 4:  # kda: γ per key dim, taken relative to the chunk's middle
        b = log_decay.unflatten(2, (-1, chunk)).cumsum(3)  # (B, H, c, C, D)
        mid = b[:, :, :, chunk // 2 : chunk // 2 + 1]
        k_lo = kc * (mid - b).exp()  # k_s / γ_s and k_t γ_t, each relative to the middle: Γ_ts = (γ_t / γ_s) per dim
        a = torch.matmul(kc * (b - mid).exp(), k_lo.transpose(-1, -2)).tril_(-1).mul_(bc[..., None])
        scores = torch.matmul(qc * (b - mid).exp(), k_lo.transpose(-1, -2)).tril_()
        gamma = b.exp()
        k_beta, q_in, k_out = kc * (bc[..., None] * gamma), qc * gamma, kc * (b[:, :, :, -1:] - b).exp()
        last = gamma[:, :, :, -1, :, None]  # (B, H, c, D, 1)
        return _delta_across_chunks(qc, kc, vc, bc, a, scores, k_beta, q_in, k_out, last, state, chunk)
    kk = torch.matmul(kc, kc.transpose(-1, -2))
    scores = torch.matmul(qc, kc.transpose(-1, -2))
    if log_decay is None:  # deltanet: no decay, γ = 1 (the same formulas without their factors)
        a = kk.tril_(-1).mul_(bc[..., None])
        scores = scores.tril_()
        k_beta, q_in, k_out, last = kc * bc[..., None], qc, kc, None
    else:
        b = log_decay.unflatten(2, (-1, chunk)).cumsum(3)
        lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
        inside = (b[..., :, None] - b[..., None, :]).masked_fill_(~lower, -math.inf).exp_()  # Γ_ts = γ_t / γ_s, t >= s
        a = (kk * inside).tril_(-1).mul_(bc[..., None])
        scores = scores * inside
        gamma = b.exp()[..., None]
        k_beta, q_in, k_out = kc * (bc[..., None] * gamma), qc * gamma, kc * (b[..., -1:] - b).exp()[..., None]
        last = b[:, :, :, -1].exp()[..., None, None]  # (B, H, c, 1, 1)
    return _delta_across_chunks(qc, kc, vc, bc, a, scores, k_beta, q_in, k_out, last, state, chunk)


def _delta_across_chunks(qc, kc, vc, bc, a, scores, k_beta, q_in, k_out, last, state, chunk):
    """delta_chunks' second half: each chunk's solve, then the state carried across chunks."""
    eye = torch.eye(chunk, dtype=qc.dtype, device=qc.device).expand_as(a)
    t = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)  # (I + A)⁻¹: the diagonal is read as 1
    w = torch.matmul(t, k_beta)
    grouped = qc.shape[1] != kc.shape[1]  # a group of query heads per K/V head (their reads broadcast over it)
    # [W; diag(γ) Q]: both read the state before the chunk, in one product per chunk (apart for a group of queries)
    reads = w if grouped else torch.cat([w, q_in], dim=3)  # (B, H, c, 2C, D)
    u_known = torch.matmul(t, vc * bc[..., None])
    out = vc.new_empty(*qc.shape[:-1], vc.shape[-1])
    for i in range(qc.shape[2]):  # across chunks: the state (inside each, everything at once)
        read = torch.matmul(reads[:, :, i], state)  # (B, H, 2C, Dv)
        u = u_known[:, :, i] - read[:, :, :chunk]
        seen = torch.matmul(q_in[:, :, i], state) if grouped else read[:, :, chunk:]
        out[:, :, i] = torch.matmul(scores[:, :, i], u).add_(seen)
        written = torch.matmul(k_out[:, :, i].transpose(-1, -2), u)
        state = state + written if last is None else last[:, :, i] * state + written
    return out.flatten(2, 3), state


# -- gates the methods share ------------------------------------------------------------------------


def inverse_softplus(x: Tensor) -> Tensor:
    """y with softplus(y) = x (x > 0)."""
    return x + torch.log(-torch.expm1(-x))


class SSDDecay(nn.Module):
    """Mamba-2's scalar decay from the keys: Δ_t = softplus(k_t·w_h + b_h), log a_t = −exp(A_log_h) Δ_t.

    Initialised as Mamba-2: A_h spread over [1, 16], softplus(b_h) over [0.001, 0.1] (log-spaced), w small.
    """

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.a_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, heads)))
        self.w_dt = nn.Parameter(torch.randn(heads, head_dim) * head_dim**-0.5 * 0.1)
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), heads))
        self.b_dt = nn.Parameter(inverse_softplus(dt))

    def forward(self, k: Tensor) -> tuple[Tensor, Tensor]:
        """(log a (B, H, L), Δ (B, H, L)) of keys k (B, H, L, D)."""
        dt = F.softplus(torch.matmul(k, self.w_dt.to(k.dtype)[..., None])[..., 0] + self.b_dt.to(k.dtype)[:, None])
        return -self.a_log.to(k.dtype).exp()[:, None] * dt, dt


class SigmoidGate(nn.Module):
    """β_t = σ(k_t·w_h + b_h) in (0, 1), per head and position (DeltaNet's writing strength)."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(heads, head_dim) * head_dim**-0.5)
        self.b = nn.Parameter(torch.zeros(heads))

    def forward(self, k: Tensor) -> Tensor:
        return torch.sigmoid(torch.matmul(k, self.w.to(k.dtype)[..., None])[..., 0] + self.b.to(k.dtype)[:, None])


# -- groups of chunks, and their backward -----------------------------------------------------------


# The sequence is taken in groups of whole chunks, the state carried from group to group; with a
# gradient each group is recomputed in the backward, last first (`_GroupedScan`), so forward+backward
# keeps the state before each group and one group's graph, not N x C scores for all N, and writes the
# gradients of q, k, v into their place.
def _scan_groups(method, q, k, v, keep, state, chunk, size, states: list | None = None):
    """The recurrence over every group of `size` positions, the state carried; outputs written in place
    (no second N x Dv buffer). `states`: where to keep the state before each group (for the backward)."""
    out = v.new_empty(*q.shape[:-1], v.shape[-1])
    for sl in spans(q.shape[-2], size):
        if states is not None:
            states.append(state)
        out[:, :, sl], state = method._group(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], None if keep is None else keep[..., sl], state, chunk
        )
    return out, state


class _GroupedScan(torch.autograd.Function):
    """The grouped recurrence with a backward that rebuilds one group's graph at a time, last group first,
    carrying the gradient of the state between groups; the gradients of q, k, v are written into their
    place (as FlashAttention recomputes its blocks). Kept for the backward: the inputs, the state before
    each group (N / group of D x Dv), nothing of the groups' insides."""

    @staticmethod
    def forward(ctx, method, chunk, size, keep, state, q, k, v, *params):
        states: list[Tensor] = []
        out, final = _scan_groups(method, q, k, v, keep, state, chunk, size, states)
        ctx.save_for_backward(q, k, v, keep, *states)
        ctx.method, ctx.chunk, ctx.size, ctx.params = method, chunk, size, params
        return out, final

    @staticmethod
    def backward(ctx, grad_out, grad_state):
        q, k, v, keep, *states = ctx.saved_tensors
        method, chunk, params = ctx.method, ctx.chunk, ctx.params
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dparams = [torch.zeros_like(p) for p in params]
        d_state = torch.zeros_like(states[0]) if grad_state is None else grad_state
        grad_out = (
            torch.zeros(*q.shape[:-1], v.shape[-1], dtype=v.dtype, device=v.device) if grad_out is None else grad_out
        )
        for sl, before in reversed(list(zip(spans(q.shape[-2], ctx.size), states))):
            with torch.enable_grad():
                inputs = [t[:, :, sl].detach().requires_grad_() for t in (q, k, v)]
                s_in = before.detach().requires_grad_()
                out, s_out = method._group(*inputs, None if keep is None else keep[..., sl], s_in, chunk)
                grads = torch.autograd.grad(
                    (out, s_out), (*inputs, s_in, *params), (grad_out[:, :, sl], d_state), allow_unused=True
                )
            for buffer, g in zip((dq, dk, dv), grads[:3]):
                buffer[:, :, sl] = 0 if g is None else g
            d_state = grads[3] if grads[3] is not None else torch.zeros_like(d_state)
            for total, g in zip(dparams, grads[4:]):
                if g is not None:
                    total += g
        return None, None, None, None, d_state, dq, dk, dv, *dparams


# -- the variant ----------------------------------------------------------------------------------


class RecurrentAttention(MapInputs, AttentionVariant):
    """A gated linear recurrence behind the one interface; subclasses give `spec` and `_inputs`.

    Not registered itself. Causal by nature: S_t holds positions <= t only.


    Grouped-query inputs (k, v with Hkv < H heads) are computed natively: the gates, the writes and the state
    are per K/V head, and the H / Hkv query heads of a group read the same state (the group folded into the
    head axis of the chunked forms, which broadcast over it); with a feature map the keys are mapped per
    query head, so k and v are repeated first (the spec's `repeats_kv`).

    Padding (key_padding_mask False) skips a position: no decay (log a = 0), no write (k = 0, β = 0).
    Half-precision inputs are computed in float32 (a state summed over N positions passes float16's
    65504 long before N = 65536) and returned in their dtype.
    """

    delta_rule = False  # True: S_t = a_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ; False: the gated form
    max_chunk: int | None = None  # a bound on chunk_size the method's numerics need (gla)

    def __init__(
        self,
        *,
        chunk_size: int = 64,
        feature_map: str | None = None,
        feature_dim: int | None = None,
        feature_inputs: str = "post_rope",
        rope_theta: float = 10000.0,
        feature_init: str = "identity",
        query_scaled: bool = True,
        **base,
    ):
        """
        Args:
            chunk_size: C, positions per chunk of the chunked form (the C x C form inside, the D x Dv state
                across chunks). A tuning knob: the result does not depend on it.
            scale: factor of q in o_t = scale · q_tᵀ S_t; None means D ** -0.5.
            feature_map: None (q and k as they are), or "hedgehog": a learned map per head (linear.py's
                [softmax(x W + b), softmax(−x W − b)]) applied to q and k first, so the recurrence, its gates
                and its state run over K = 2 feature_dim key dims (what attention transfer trains to imitate
                the softmax of a pretrained model; needs num_heads and head_dim). Where the scale is a factor
                of q (not the delta rules, which normalise q), q enters the map times the scale.
            feature_dim: F' of the feature map (None: head_dim); only with feature_map.
            feature_inputs: with feature_map (linear.py's `MapInputs`): "post_rope" (φ reads q, k as RoPE rotated
                them: LoLCATs') or "pre_rope" (rotated back by their positions first).
            rope_theta: the base θ of the rotation pre_rope undoes (variants.hf takes the model's).
            feature_init: with feature_map: "identity" (W = I, b = 0) or "kaiming" (LoLCATs': no bias).
            query_scaled: with feature_map, where the scale is a factor of q: φ_q reads q times it (True) or q
                itself (False, LoLCATs').
        """
        super().__init__(**base)
        self._init_map_inputs(feature_map, feature_inputs, rope_theta, feature_init, query_scaled)
        self._check_int("chunk_size", chunk_size, 1)
        if feature_dim is not None and feature_map is None:
            raise ValueError(
                f"{self.spec.name}: option feature_dim={feature_dim!r} is for a feature_map; got feature_map=None"
            )
        self.feature_map, self.feature_dim = feature_map, feature_dim
        maps = learned_feature_maps(
            self.spec.name, feature_map, self.num_heads, self.head_dim, feature_dim, feature_init
        )
        if maps is not None:
            self.q_features, self.k_features = maps
        if self.max_chunk is not None and chunk_size > self.max_chunk:
            raise ValueError(
                f"{self.spec.name}: option chunk_size={chunk_size} is invalid; expected an int in "
                f"1..{self.max_chunk} ({self.spec.name}'s per-dimension decay is taken relative to the "
                f"chunk's middle: its factors exp(±C/2 · 5) stay inside float32 up to C = {self.max_chunk})"
            )
        self.chunk_size = chunk_size

    def _require_shape_hints(self) -> tuple[int, int]:
        """(heads, K) for per-head gate parameters over the K key dims the recurrence runs on (D, or the feature
        map's 2 F'): the K/V heads where grouped-query inputs are computed natively (num_kv_heads), else the
        query heads; a ValueError naming the missing hint."""
        self._require_head_shape("its gates are parameters per head over the key dims")
        return self._kv_parameter_heads(), self.key_dim(self.head_dim)

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        gates = next((p for p in self.parameters() if p.dim() >= 1), None)
        want = self._kv_parameter_heads()
        if gates is None or self.repeats_kv_reason() or want is None or kv_heads == want:
            return None
        return (
            f"its gates are built for {want} K/V heads (num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads}); "
            f"build it with num_kv_heads={kv_heads} for grouped-query inputs"
        )

    def repeats_kv_reason(self) -> str:
        if self.feature_map is not None:
            return (
                "its key feature map is learned per query head (LoLCATs applies it after repeating K), so the keys, "
                "the gates and the state are per query head"
            )
        return ""

    def key_dim(self, head_dim: int) -> int:
        """K, the key dims of the state S (K x Dv a head): the head dim, or the feature map's 2 F'."""
        return head_dim if self.feature_map is None else 2 * self.q_features.bias.shape[-1]

    def _mapped(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q and k as the recurrence takes them: through the feature maps, where the variant has them (q times
        its scale first where the scale is a factor of q, as linear attention's learned map takes it)."""
        if self.feature_map is None:
            return q, k
        if self.spec.scale_is_query_factor and self.query_scaled:
            q = q * float(self._scale(q))
        return self.q_features(q), self.k_features(k)

    def _query_scale(self, q: Tensor) -> float:
        """The factor of the query in o_t = factor · q_tᵀ S_t: the scale, or 1 where the feature map took it."""
        return 1.0 if self.feature_map is not None and self.spec.scale_is_query_factor else float(self._scale(q))

    # -- the recurrence's inputs -----------------------------------------------------------------
    def _inputs(self, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor]:
        """{q, k, v, log_decay?, beta?} of positions whose raw q, k, v (B, H, L, ·) are given (gates: per position)."""
        raise NotImplementedError

    def recurrence_inputs(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> dict:
        """The exact inputs of the recurrence: effective q, k (after any normalisation), v (after any Δ
        scaling), log_decay ((B, H, N), or (B, H, N, D) per key dim; absent for deltanet), beta ((B, H, N),
        delta-rule methods) and scale; padded positions as the recurrence skips them (k = 0, log a = 0, β = 0).
        The output equals o_t = scale · q_tᵀ S_t of the textbook recurrence run on them, step by step."""
        mapped = self._mapped(self._pre_rope(q, 0), self._pre_rope(k, 0))
        inputs = self._masked(self._inputs(*mapped, v), self._keep(key_padding_mask, k))
        return {**inputs, "scale": self._query_scale(q)}

    @staticmethod
    def _keep(key_padding_mask: Tensor | None, k: Tensor) -> Tensor | None:
        return None if key_padding_mask is None else key_padding_mask[:, None, :].to(k.dtype)  # (B, 1, N)

    @staticmethod
    def _masked(inputs: dict[str, Tensor], keep: Tensor | None) -> dict[str, Tensor]:
        """Padded positions skipped: no write (k = 0, β = 0) and no decay (log a = 0)."""
        if keep is None:
            return inputs
        out = dict(inputs, k=inputs["k"] * keep[..., None])
        if "beta" in out:
            out["beta"] = out["beta"] * keep
        if "log_decay" in out:
            ld = out["log_decay"]
            out["log_decay"] = ld * (keep if ld.dim() == 3 else keep[..., None])
        return out

    # -- the call --------------------------------------------------------------------------------
    def _attend(self, q, k, v, causal, key_padding_mask):
        if q.dtype in (torch.float16, torch.bfloat16):
            return self._attend(q.float(), k.float(), v.float(), causal, key_padding_mask).to(q.dtype)
        if torch.is_autocast_enabled(q.device.type):
            with torch.autocast(q.device.type, enabled=False):
                return self._attend(q, k, v, causal, key_padding_mask)
        n_q, n_k = q.shape[-2], k.shape[-2]
        keep = self._keep(key_padding_mask, k)
        if n_q < n_k:  # the queries are the last Nq positions: zero queries before them build the state
            q = F.pad(q, (0, 0, n_k - n_q, 0))
        b, h, _, d = k.shape
        state = k.new_zeros(b, h, self.key_dim(d), v.shape[-1])
        q, k = self._pre_rope(q, 0), self._pre_rope(k, 0)  # (q padded to the keys' positions: both from 0)
        return self._scan(q, k, v, keep, state)[0][:, :, n_k - n_q :]

    def _scan(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, state: Tensor) -> tuple[Tensor, Tensor]:
        """Outputs of every position of q, k, v (B, H, N, ·) from `state`, and the state after them."""
        n = q.shape[-2]
        chunk = min(self.chunk_size, n)
        q, k, v = (pad_to_multiple(t, chunk)[0] for t in (q, k, v))
        if q.shape[-2] != n:  # the positions added to fill the last chunk are skipped like padding
            keep = torch.ones(k.shape[0], 1, n, dtype=k.dtype, device=k.device) if keep is None else keep
        if keep is not None:
            keep = pad_to_multiple(keep, chunk, dim=-1)[0]
        size = max(chunk, GROUP_POSITIONS // chunk * chunk)
        params = tuple(p for p in self.parameters() if p.requires_grad)  # frozen ones (LoRA's stage) get none
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, state, *params))
        if not grad:
            out, state = _scan_groups(self, q, k, v, keep, state, chunk, size)
            return out[:, :, :n], state
        out, state = _GroupedScan.apply(self, chunk, size, keep, state, q, k, v, *params)
        return out[:, :, :n], state

    def _group(self, q, k, v, keep, state, chunk):
        inputs = self._masked(self._inputs(*self._mapped(q, k), v), keep)
        qs = inputs["q"] * self._query_scale(q)
        b, kv_heads = inputs["k"].shape[:2]
        groups = qs.shape[1] // kv_heads
        rest = {name: t for name, t in inputs.items() if name != "q"}
        if (
            groups > 1
        ):  # grouped-query: (B, Hkv) as one batch axis, the group on the heads' (every K/V input has 1 there)
            qs = qs.reshape(b * kv_heads, groups, *qs.shape[2:])
            rest = {name: t.reshape(b * kv_heads, 1, *t.shape[2:]) for name, t in rest.items()}
            state = state.reshape(b * kv_heads, 1, *state.shape[2:])
        if self.delta_rule:
            out, state = delta_chunks(qs, rest["k"], rest["v"], rest["beta"], rest.get("log_decay"), state, chunk)
        else:
            out, state = gated_chunks(qs, rest["k"], rest["v"], rest["log_decay"], state, chunk)
        if groups > 1:
            out, state = out.reshape(b, kv_heads * groups, *out.shape[2:]), state.reshape(b, kv_heads, *state.shape[2:])
        return out, state

    def reference_inputs(self, q, k, v, key_padding_mask=None) -> tuple[dict, int]:
        """`recurrence_inputs` as a method's per-position `step_reference()` reads them, and Nq: q scaled (and, where
        Nq < Nk, preceded by zero queries from position 0), every K/V input repeated to its group of query heads."""
        k, v = self._grouped_kv(q, k, v)  # repeated to the query heads where a feature map is learned per query head
        n_q, n_k = q.shape[-2], k.shape[-2]
        x = self.recurrence_inputs(F.pad(q, (0, 0, n_k - n_q, 0)), k, v, key_padding_mask)
        qs = x.pop("q") * x.pop("scale")
        groups = qs.shape[1] // x["k"].shape[1]  # grouped-query: each K/V head's inputs read by its query heads
        return {"q": qs, **{name: t.repeat_interleave(groups, dim=1) for name, t in x.items()}}, n_q

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """The parallel form over the whole sequence (every weight stored): the definition the correctness gate
        and the tests hold the chunked form to; each method's per-position `step_reference()` equals it."""
        x, n_q = self.reference_inputs(q, k, v, key_padding_mask)
        if self.delta_rule:
            out = dense_delta(x["q"], x["k"], x["v"], x["beta"], x.get("log_decay"))
        else:
            out = dense_gated(x["q"], x["k"], x["v"], x["log_decay"])
        return out[:, :, out.shape[2] - n_q :]

    # -- decoding: the one-step form -------------------------------------------------------------
    state_kind = "recurrent"

    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        return {
            "S": torch.zeros(batch, heads, self.key_dim(head_dim), value_dim, dtype=dtype, device=device)
        }  # K x Dv per head

    def _prefill(self, q, k, v, state, keep):
        return self._step(q, k, v, state, keep)[1]  # the state is what the scan computes anyway

    def _step(self, q, k, v, state, keep):
        s = state.tensors["S"]  # (a padded position is skipped: no decay, no write; nothing of it is kept)
        q, k = self._pre_rope(q, state.length), self._pre_rope(k, state.length)
        if q.dtype in (torch.float16, torch.bfloat16):
            out, s = self._scan(q.float(), k.float(), v.float(), self._keep(keep, q.float()), s.float())
            out, s = out.to(q.dtype), s.to(q.dtype)
        else:
            out, s = self._scan(q, k, v, self._keep(keep, q), s)
        return out, state.advanced(q.shape[2], S=s)

    # -- what the harness reads ------------------------------------------------------------------
    def flops(self, n_q, n_k, d, dv, causal):
        # the chunked form: per position a C-wide masked product (2 C (D + Dv)), the state read and written (4 D Dv);
        # the delta rule adds k kᵀ (2 C D), the triangular solve (C (D + Dv)) and W S (2 D Dv)
        c = min(self.chunk_size, n_k)
        d = self.key_dim(d)
        per = 2.0 * c * (d + dv) + 4.0 * d * dv
        if self.delta_rule:
            per += 2.0 * c * d + c * (d + dv) + 2.0 * d * dv
        return n_k * per

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        c = min(self.chunk_size, n_k)
        d = self.key_dim(d)
        group = batch * heads * min(n_k, GROUP_POSITIONS) * (c + 4 * (d + dv) + (d if self.max_chunk else 0) * 4) * 4
        states = batch * heads * d * dv * 4 * (math.ceil(n_k / GROUP_POSITIONS) if backward else 2)
        return int(
            group * (6 if backward else 3)
            + states
            + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward)
        )

    def extra_repr(self) -> str:
        mapped = "" if self.feature_map is None else f", feature_map={self.feature_map!r}"
        return f"chunk_size={self.chunk_size}{mapped}"
