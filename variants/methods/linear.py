"""Linear attention with the elu+1 feature map: Katharopoulos et al. 2020, "Transformers are RNNs".

Softmax's exp(q·k) is replaced by φ(q)·φ(k) with φ(x) = elu(x) + 1 > 0, so the sums reassociate:

    out_i = φ(q_i)ᵀ (Σ_j φ(k_j) v_jᵀ) / (φ(q_i)ᵀ Σ_j φ(k_j) + eps)

The `scale` option defaults to none here (φ of q itself, as in the paper).
Non-causal: one D x Dv state S = Σ_j φ(k_j) v_jᵀ and one normalizer z = Σ_j φ(k_j): O(N·D·Dv) time.
Causal: the sums run over j <= i (with Nq < Nk, over the keys up to the query's position Nk - Nq + i). Computed chunk by chunk: within a chunk of C positions a masked
C x C product, across chunks the running state (S, z) of everything before — never a per-position
(N, D, Dv) prefix sum. Chunks are taken in groups sized to a memory bound, the state carried
from group to group, so peak memory stays O(group + N·Dv) whatever N.

Backward (`_NonCausalLinear`, `_CausalLinear`): written out, group by group, recomputing the
features instead of storing them (as FlashAttention recomputes its weights); the causal one runs
the groups in reverse with the gradient of the state. The normalizer is carried as a column of
ones appended to v, so one set of sums serves numerator and denominator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._base import AttentionVariant, VariantSpec, dense_mask, register
from .._utils import pad_to_multiple

GROUP_POSITIONS = 512  # positions processed at once in the causal scan (a multiple of the chunk size)


def elu_feature_map(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1 = exp(min(x, 0)) + max(x, 0), positive everywhere.

    Written with exp and clamp, which run several times faster on CPU than torch's elu kernel;
    the value and the gradient (1 at x = 0 as well) are elu's.
    """
    return x.clamp_max(0).exp_() + torch.relu(x)  # relu, not clamp_min: its gradient at 0 is 0


def elu_feature_map_grad(x: Tensor) -> Tensor:
    """φ'(x): 1 for x > 0, exp(x) for x <= 0 (elu's gradient, 1 at x = 0 as well)."""
    return x.clamp_max(0).exp_()


def _groups(n: int, size: int):
    """Slices of [0, n) of `size` positions (the last may be shorter)."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _ones_column(v: Tensor) -> Tensor:
    """[v, 1]: a value column of ones turns the numerator's sums into the normalizer's."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _states_before(kc: Tensor, vc: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """(state before each chunk (B, H, c, D, E), state after the last chunk) of chunked φ(k) (B, H, c, C, D)
    and values (B, H, c, C, E), given `state` (B, H, D, E), the sums over everything before them."""
    chunk_state = torch.matmul(kc.transpose(-1, -2), vc)  # (B, H, c, D, E)
    c = kc.shape[2]
    earlier = torch.ones(c, c, dtype=kc.dtype, device=kc.device).tril_(-1)  # earlier[t, u] = 1 if chunk u < t
    # exclusive prefix sums over chunks as one small matmul (much faster on CPU than cumsum along dim 2)
    state_before = torch.matmul(earlier, chunk_state.flatten(3)).view_as(chunk_state).add_(state[:, :, None])
    return state_before, state_before[:, :, -1] + chunk_state[:, :, -1]


def _causal_group(q: Tensor, k: Tensor, v: Tensor, state: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Causal linear attention over one group of whole chunks, given the sums over all earlier positions.

    q, k: (B, H, L, D) features φ(q), φ(k); v: (B, H, L, E) values with a ones column last (E = Dv + 1);
    state: (B, H, D, E) = Σ_{j before} φ(k_j) [v_j, 1]ᵀ. Returns ([numerator, denominator] (B, H, L, E),
    the state after this group).
    """
    qc, kc, vc = (t.unflatten(2, (-1, chunk)) for t in (q, k, v))  # (B, H, c, C, ·)
    scores = torch.matmul(qc, kc.transpose(-1, -2)).tril_()  # inside a chunk: masked C x C products
    state_before, after = _states_before(kc, vc, state)  # across chunks: the sums over everything before
    num = torch.matmul(scores, vc) + torch.matmul(qc, state_before)
    return num.flatten(2, 3), after


class _NonCausalLinear(torch.autograd.Function):
    """out = φ(q) S / (φ(q) z + eps), S = Σ φ(k_j) v_jᵀ, z = Σ φ(k_j), in groups of positions.

    Nothing of size N·D is stored for the backward beyond the inputs and the output: the features
    are recomputed group by group (as FlashAttention recomputes its weights), so forward+backward
    holds O(group + D·Dv) besides the inputs, the output and the gradients.
    """

    @staticmethod
    def forward(ctx, q, k, v, keep, eps):
        b, h, n_k, d = k.shape
        state = k.new_zeros(b, h, d, v.shape[-1] + 1)  # [Σ φ(k) vᵀ, Σ φ(k)]
        for sl in _groups(n_k, GROUP_POSITIONS):
            kf = elu_feature_map(k[:, :, sl])
            if keep is not None:  # padded keys contribute to neither sum
                kf = kf * keep[:, :, sl]
            state += torch.matmul(kf.transpose(-1, -2), _ones_column(v[:, :, sl]))
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        den = q.new_empty(*q.shape[:-1], 1)
        for sl in _groups(q.shape[-2], GROUP_POSITIONS):
            num = torch.matmul(elu_feature_map(q[:, :, sl]), state)
            den[:, :, sl] = num[..., -1:] + eps
            torch.div(num[..., :-1], den[:, :, sl], out=out[:, :, sl])
        ctx.save_for_backward(q, k, v, keep, state, out, den)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep, state, out, den = ctx.saved_tensors
        dq = torch.empty_like(q) if ctx.needs_input_grad[0] else None
        dstate = torch.zeros_like(state)
        for sl in _groups(q.shape[-2], GROUP_POSITIONS):
            qg = q[:, :, sl]
            d_num = _d_num_den(grad_out[:, :, sl], out[:, :, sl], den[:, :, sl])  # (L, Dv + 1)
            qf = elu_feature_map(qg)
            if dq is not None:
                dq[:, :, sl] = torch.matmul(d_num, state.transpose(-1, -2)).mul_(elu_feature_map_grad(qg))
            dstate += torch.matmul(qf.transpose(-1, -2), d_num)
        dk = torch.empty_like(k) if ctx.needs_input_grad[1] else None
        dv = torch.empty_like(v) if ctx.needs_input_grad[2] else None
        for sl in _groups(k.shape[-2], GROUP_POSITIONS):
            kg = k[:, :, sl]
            if dk is not None:
                dkf = torch.matmul(_ones_column(v[:, :, sl]), dstate.transpose(-1, -2))
                if keep is not None:
                    dkf = dkf * keep[:, :, sl]
                dk[:, :, sl] = dkf.mul_(elu_feature_map_grad(kg))
            if dv is not None:
                kf = elu_feature_map(kg)
                if keep is not None:
                    kf = kf * keep[:, :, sl]
                dv[:, :, sl] = torch.matmul(kf, dstate[..., :-1])
        return dq, dk, dv, None, None


def _d_num_den(grad_out: Tensor, out: Tensor, den: Tensor) -> Tensor:
    """Gradient of the loss w.r.t. [numerator, denominator] of out = num / den: [dO / den, -(dO·O) / den]."""
    return torch.cat([grad_out, -(grad_out * out).sum(-1, keepdim=True)], dim=-1).div_(den)


class _CausalLinear(torch.autograd.Function):
    """Causal linear attention, chunk-wise within groups of positions, the running state carried across
    groups. The backward runs the groups in reverse, carrying the gradient of the state, and recomputes
    the features of each group; it keeps only the state before each group (N / group of D x (Dv+1))
    and the normalizer, besides the inputs and the output."""

    @staticmethod
    def forward(ctx, q, k, v, keep, chunk, eps):
        b, h, n, d = q.shape
        size = max(chunk, GROUP_POSITIONS // chunk * chunk)
        state = q.new_zeros(b, h, d, v.shape[-1] + 1)
        out = q.new_empty(b, h, n, v.shape[-1])
        den = q.new_empty(b, h, n, 1)
        states = []
        for sl in _groups(n, size):
            states.append(state)
            kf = elu_feature_map(k[:, :, sl])
            if keep is not None:
                kf = kf * keep[:, :, sl]
            num, state = _causal_group(elu_feature_map(q[:, :, sl]), kf, _ones_column(v[:, :, sl]), state, chunk)
            den[:, :, sl] = num[..., -1:] + eps
            torch.div(num[..., :-1], den[:, :, sl], out=out[:, :, sl])
        ctx.save_for_backward(q, k, v, keep, out, den, torch.stack(states))
        ctx.chunk, ctx.size = chunk, size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep, out, den, states = ctx.saved_tensors
        chunk = ctx.chunk
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dstate_later = torch.zeros_like(states[0])  # Σ over later groups of φ(q_i)ᵀ [dnum_i, dden_i]
        for index, sl in reversed(list(enumerate(_groups(q.shape[-2], ctx.size)))):
            qg, kg = q[:, :, sl], k[:, :, sl]
            qf, kf = elu_feature_map(qg), elu_feature_map(kg)
            if keep is not None:
                kf = kf * keep[:, :, sl]
            vg = _ones_column(v[:, :, sl])
            d_num = _d_num_den(grad_out[:, :, sl], out[:, :, sl], den[:, :, sl])
            qc, kc, vc, dc = (t.unflatten(2, (-1, chunk)) for t in (qf, kf, vg, d_num))  # (B, H, c, C, ·)
            c = qc.shape[2]
            state_before, _ = _states_before(kc, vc, states[index])  # (B, H, c, D, E)
            q_sums = torch.matmul(qc.transpose(-1, -2), dc)  # (B, H, c, D, E): each chunk's Σ φ(q) dN
            later = torch.ones(c, c, dtype=q.dtype, device=q.device).triu_(1)  # later[t, u] = 1 if chunk u > t
            dstate_after = torch.matmul(later, q_sums.flatten(3)).view_as(q_sums).add_(dstate_later[:, :, None])
            dv_scores = torch.matmul(dc, vc.transpose(-1, -2)).tril_()  # (B, H, c, C, C): dN_i · V_j, j <= i
            dqf = torch.matmul(dv_scores, kc) + torch.matmul(dc, state_before.transpose(-1, -2))
            dkf = torch.matmul(dv_scores.transpose(-1, -2), qc) + torch.matmul(vc, dstate_after.transpose(-1, -2))
            scores_t = torch.matmul(kc, qc.transpose(-1, -2)).triu_()  # (B, H, c, C, C): φ(q_i)·φ(k_j), i >= j
            dvg = torch.matmul(scores_t, dc) + torch.matmul(kc, dstate_after)
            dstate_later = dstate_later + q_sums.sum(2)
            if keep is not None:
                dkf = dkf * keep[:, :, sl].unflatten(2, (-1, chunk))
            dq[:, :, sl] = dqf.flatten(2, 3).mul_(elu_feature_map_grad(qg))
            dk[:, :, sl] = dkf.flatten(2, 3).mul_(elu_feature_map_grad(kg))
            dv[:, :, sl] = dvg.flatten(2, 3)[..., :-1]
        return dq, dk, dv, None, None, None


@register
class LinearAttention(AttentionVariant):
    spec = VariantSpec(
        name="linear",
        summary="linear attention, phi(x) = elu(x) + 1; causal computed chunk-wise with a running D x Dv state",
        reference="Katharopoulos et al. 2020, 'Transformers are RNNs'",
        time_complexity="O(N D Dv) (+ O(N C D) inside chunks when causal)",
        memory_complexity="O(N Dv) + one group of chunks",
        subquadratic=True,
        function_options=("feature_map",),
        examples=((("chunk_size", 4),),),  # several chunks at N ~ 13
    )

    def __init__(self, *, feature_map: str = "elu", chunk_size: int = 64, eps: float = 1e-6, **base):
        """
        Args:
            feature_map: φ applied to queries and keys; "elu" is elu(x) + 1 (Katharopoulos et al.), the only one.
            chunk_size: C, positions per chunk of the causal computation (exact within a chunk, a running
                D x Dv state across chunks). A tuning knob: the result does not depend on it.
            eps: added to the normalizer φ(q)·Σφ(k) (keeps rows with no visible key finite).
            scale: factor applied to q before φ; None (the default) leaves q as it is, as in the paper.
        """
        super().__init__(**base)
        if feature_map != "elu":
            raise ValueError(f"linear: option feature_map={feature_map!r} is invalid; allowed: 'elu'")
        self._check_int("chunk_size", chunk_size, 1)
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"linear: option eps={eps!r} is invalid; expected a positive finite number")
        self.feature_map, self.chunk_size, self.eps = feature_map, chunk_size, float(eps)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        if q.dtype in (torch.float16, torch.bfloat16):
            # the normalizer φ(q)·Σφ(k) grows like N·D (about 86·N at D = 64): in float16 it passes
            # 65504 from N ≈ 760, and a bfloat16 running state loses the sum's low bits group after
            # group. The sums are kept in float32, the output returned in the input's dtype.
            out = self._attend(q.float(), k.float(), v.float(), causal, key_padding_mask)
            return out.to(q.dtype)
        if self.scale is not None:  # as in the paper, φ applies to q itself unless a scale is given
            q = q * self.scale
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :, None].to(k.dtype)  # (B, 1, Nk, 1)
        if not causal:
            return self._non_causal(q, k, v, keep)
        n_q, n_k = q.shape[-2], k.shape[-2]
        if n_q < n_k:  # the queries are the last Nq positions: zero rows put them there, and are cut after.
            # The prefix sums over the first Nk - Nq keys are the running state of the scan: O(Nk D Dv), as
            # building that state from the keys costs anyway (a KV cache keeps keys, not the state)
            return self._causal(torch.nn.functional.pad(q, (0, 0, n_k - n_q, 0)), k, v, keep)[:, :, -n_q:]
        return self._causal(q, k, v, keep)

    def _non_causal(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
        return _NonCausalLinear.apply(q, k, v, keep, self.eps)

    def _causal(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
        n = q.shape[-2]
        chunk = min(self.chunk_size, n)
        q, _ = pad_to_multiple(q, chunk)
        k, _ = pad_to_multiple(k, chunk)
        v, _ = pad_to_multiple(v, chunk)
        if keep is None and q.shape[-2] != n:
            keep = torch.ones(1, 1, n, 1, dtype=k.dtype, device=k.device)
        if keep is not None:
            keep, _ = pad_to_multiple(keep, chunk)  # the padding added here is masked like any padded key
        return _CausalLinear.apply(q, k, v, keep, chunk, self.eps)[:, :, :n]

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """The explicit O(N²) form: A = φ(Q)φ(K)ᵀ (masked), rows normalized by their sums (+ eps), times V."""
        q = q if self.scale is None else q * self.scale
        a = torch.matmul(elu_feature_map(q), elu_feature_map(k).transpose(-1, -2))  # (B, H, Nq, Nk)
        allowed = dense_mask(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device)
        if allowed is not None:
            a = a * allowed
        return torch.matmul(a, v) / (a.sum(-1, keepdim=True) + self.eps)

    def flops(self, n_q: int, n_k: int, d: int, dv: int, causal: bool) -> float:
        # the recurrent form's useful work: build the state (2 N D Dv) and read it out (2 N D Dv), normalizers
        return 2.0 * n_k * d * dv + 2.0 * n_q * d * dv + 2.0 * (n_k + n_q) * d

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        group = batch * heads * GROUP_POSITIONS * (d + dv + 1) * 4 * (8 if causal else 4)  # a group's features and products
        return int(group + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward))
