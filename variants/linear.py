"""Linear attention with the elu+1 feature map: Katharopoulos et al. 2020, "Transformers are RNNs".

Softmax's exp(q·k) is replaced by φ(q)·φ(k) with φ(x) = elu(x) + 1 > 0, so the sums reassociate:

    out_i = φ(q_i)ᵀ (Σ_j φ(k_j) v_jᵀ) / (φ(q_i)ᵀ Σ_j φ(k_j) + eps)

The `scale` option defaults to none here (φ of q itself, as in the paper).
Non-causal: one D x Dv state S = Σ_j φ(k_j) v_jᵀ and one normalizer z = Σ_j φ(k_j): O(N·D·Dv) time.
Causal: the sums run over j <= i. Computed chunk by chunk: within a chunk of C positions a masked
C x C product, across chunks the running state (S, z) of everything before — never a per-position
(N, D, Dv) prefix sum. Chunks are taken in groups sized to a memory bound, the state carried
from group to group, so peak memory stays O(group + N·Dv) whatever N.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._base import AttentionVariant, VariantSpec, dense_mask, register
from ._utils import pad_to_multiple

GROUP_POSITIONS = 512  # positions processed at once in the causal scan (a multiple of the chunk size)


def elu_feature_map(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1 = exp(min(x, 0)) + max(x, 0), positive everywhere.

    Written with exp and clamp, which run several times faster on CPU than torch's elu kernel;
    the value and the gradient (1 at x = 0 as well) are elu's.
    """
    return x.clamp_max(0).exp_() + torch.relu(x)  # relu, not clamp_min: its gradient at 0 is 0


def _split(size: int, *tensors: Tensor | None):
    """Zip of the tensors cut along N into groups of `size` (None stays None).

    `split`, not one slice per group: under autograd each slice's backward builds a gradient the
    size of the whole input, which over N / size groups is quadratic in N; split's backward is one cat.
    """
    parts = [t.split(size, dim=2) if t is not None else None for t in tensors]
    count = next(len(p) for p in parts if p is not None)
    return zip(*[p if p is not None else [None] * count for p in parts])


def _join(parts: list[Tensor]) -> Tensor:
    """Concatenate the groups' outputs along N (one cat; writing into slices of a preallocated
    output would, under autograd, again cost a full-size gradient per group)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _causal_group(q: Tensor, k: Tensor, v: Tensor, state: Tensor, norm: Tensor, chunk: int):
    """Causal linear attention over one group of whole chunks, given the sums over all earlier positions.

    q, k: (B, H, L, D) features φ(q), φ(k); v: (B, H, L, Dv); state: (B, H, D, Dv) = Σ_{j before} φ(k_j) v_jᵀ;
    norm: (B, H, D, 1) = Σ_{j before} φ(k_j). Returns (numerator (B, H, L, Dv), denominator (B, H, L, 1),
    state and norm after this group).
    """
    qc, kc, vc = (t.unflatten(2, (-1, chunk)) for t in (q, k, v))  # (B, H, c, C, ·)
    # inside a chunk: masked C x C products
    scores = torch.matmul(qc, kc.transpose(-1, -2)).tril_()  # (B, H, c, C, C)
    num = torch.matmul(scores, vc)  # (B, H, c, C, Dv)
    den = scores.sum(-1, keepdim=True)  # (B, H, c, C, 1)
    # across chunks: the sums over everything before each chunk (exclusive prefix over the chunks)
    chunk_state = torch.matmul(kc.transpose(-1, -2), vc)  # (B, H, c, D, Dv)
    chunk_norm = kc.sum(-2)[..., None]  # (B, H, c, D, 1)
    c = qc.shape[2]
    earlier = torch.ones(c, c, dtype=q.dtype, device=q.device).tril_(-1)  # earlier[t, u] = 1 if chunk u < t
    # exclusive prefix sums over chunks as one small matmul (much faster on CPU than cumsum along dim 2)
    state_before = torch.matmul(earlier, chunk_state.flatten(3)).view_as(chunk_state).add_(state[:, :, None])
    norm_before = torch.matmul(earlier, chunk_norm.flatten(3)).view_as(chunk_norm).add_(norm[:, :, None])
    num = num + torch.matmul(qc, state_before)
    den = den + torch.matmul(qc, norm_before)
    new_state = state_before[:, :, -1] + chunk_state[:, :, -1]
    new_norm = norm_before[:, :, -1] + chunk_norm[:, :, -1]
    return num.flatten(2, 3), den.flatten(2, 3), new_state, new_norm


@register
class LinearAttention(AttentionVariant):
    spec = VariantSpec(
        name="linear",
        summary="linear attention, phi(x) = elu(x) + 1; causal computed chunk-wise with a running D x Dv state",
        reference="Katharopoulos et al. 2020, 'Transformers are RNNs'",
        time_complexity="O(N D Dv) (+ O(N C D) inside chunks when causal)",
        memory_complexity="O(N Dv) + one group of chunks",
        subquadratic=True,
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
        return self._causal(q, k, v, keep) if causal else self._non_causal(q, k, v, keep)

    def _non_causal(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
        b, h, n_k, d = k.shape
        dv = v.shape[-1]
        state, norm = k.new_zeros(b, h, d, dv), k.new_zeros(b, h, d, 1)
        for kg, vg, keep_g in _split(GROUP_POSITIONS, k, v, keep):  # in groups: features are never all held at once
            kf = elu_feature_map(kg)
            if keep_g is not None:  # padded keys contribute to neither sum
                kf = kf * keep_g
            state = state + torch.matmul(kf.transpose(-1, -2), vg)  # Σ φ(k_j) v_jᵀ: (B, H, D, Dv)
            norm = norm + kf.sum(-2)[..., None]  # Σ φ(k_j): (B, H, D, 1)
        outs = []
        for (qg,) in _split(GROUP_POSITIONS, q):
            qf = elu_feature_map(qg)
            outs.append(torch.matmul(qf, state) / (torch.matmul(qf, norm) + self.eps))
        return _join(outs)

    def _causal(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
        b, h, n, d = q.shape
        dv = v.shape[-1]
        chunk = min(self.chunk_size, n)
        q, _ = pad_to_multiple(q, chunk)
        k, _ = pad_to_multiple(k, chunk)
        v, _ = pad_to_multiple(v, chunk)
        if keep is None and q.shape[-2] != n:
            keep = torch.ones(1, 1, n, 1, dtype=k.dtype, device=k.device)
        if keep is not None:
            keep, _ = pad_to_multiple(keep, chunk)  # the padding added here is masked like any padded key
        state, norm = q.new_zeros(b, h, d, dv), q.new_zeros(b, h, d, 1)
        outs = []
        for qg, kg, vg, keep_g in _split(max(chunk, GROUP_POSITIONS // chunk * chunk), q, k, v, keep):
            kf = elu_feature_map(kg)
            if keep_g is not None:
                kf = kf * keep_g
            num, den, state, norm = _causal_group(elu_feature_map(qg), kf, vg, state, norm, chunk)
            outs.append(num / (den + self.eps))
        return _join(outs)[:, :, :n]

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
        feats = batch * heads * (n_q + n_k) * d * element_size
        return int(feats * (4 if backward else 2) + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward))
