"""Nyströmformer: Xiong et al. 2021, "Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention".

The softmax matrix S = softmax(Q Kᵀ · scale) is approximated through m landmarks — the means of m
consecutive segments of the queries (Q̃) and of the keys (K̃) — by the Nyström method:

    S ≈ softmax(Q K̃ᵀ) · pinv(softmax(Q̃ K̃ᵀ)) · softmax(Q̃ Kᵀ)      (N x m)(m x m)(m x N)

evaluated right to left so nothing N x N exists: W = softmax(Q̃ Kᵀ) V (m x Dv), Z W (m x Dv), then
softmax(Q K̃ᵀ) (Z W) — the two softmaxes through the fused SDPA kernel. pinv is the iterative
Moore–Penrose inverse of the paper (Razavi et al. 2014), `pinv_iterations` steps of
Z ← ¼ Z (13 I − A Z (15 I − A Z (7 I − A Z))) from Z₀ = Aᵀ / (‖A‖₁ ‖A‖∞). Time O(N·m·D + m³),
extra memory O(N·D + m²). With m = N every segment is one position (Q̃ = Q, K̃ = K) and the product
is S pinv(S) S = S: exact softmax attention, up to the pseudo-inverse's error.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._base import AttentionVariant, VariantSpec, register
from .._utils import masked_softmax
from .full import sdpa


def segment_means(x: Tensor, m: int, valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(means of m consecutive segments of x (B, H, N, D) -> (B, H, m, D), segments holding a real
    position (B, m) or None). valid: (B, N) bool or None; only valid positions are averaged."""
    n = x.shape[-2]
    bounds = torch.arange(1, m + 1, device=x.device) * n // m  # segment l ends at ⌊(l + 1) N / m⌋
    segment = torch.bucketize(torch.arange(n, device=x.device), bounds, right=True)  # position -> its landmark (N,)
    member = (segment[None, :] == torch.arange(m, device=x.device)[:, None]).to(x.dtype)  # (m, N), O(N m)
    if valid is None:
        return torch.matmul(member / member.sum(-1, keepdim=True), x), None
    weights = member[None] * valid[:, None, :].to(x.dtype)  # (B, m, N)
    counts = weights.sum(-1, keepdim=True)
    means = torch.matmul((weights / counts.clamp_min(1))[:, None], x)  # (B, H, m, D)
    return means, counts[..., 0] > 0


def iterative_pinv(a: Tensor, iterations: int) -> Tensor:
    """Moore–Penrose pseudo-inverse of a (…, m, m) by the paper's iteration (no SVD)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    norm = a.abs().sum(-2).amax(-1) * a.abs().sum(-1).amax(-1)  # ‖A‖₁ ‖A‖∞ per matrix
    norm = norm.clamp_min(torch.finfo(a.dtype).tiny)  # A = 0 (every key padded): pinv 0, not 0 / 0
    z = a.transpose(-1, -2) / norm[..., None, None]
    for _ in range(iterations):
        az = torch.matmul(a, z)
        z = 0.25 * torch.matmul(z, 13 * eye - torch.matmul(az, 15 * eye - torch.matmul(az, 7 * eye - az)))
    return z


@register
class NystromAttention(AttentionVariant):
    """Segments: landmark l averages positions [⌊l N / m⌋, ⌊(l + 1) N / m⌋), so any N >= m works (the
    segments differ by at most one position). Key padding: padded keys enter neither the key
    landmarks (masked means; a landmark of padding only is masked) nor softmax(Q̃ Kᵀ); in
    self-attention (Nq = Nk) padded positions leave the query landmarks too.

    Not causal: every landmark averages a whole segment, future positions included.
    """

    spec = VariantSpec(
        name="nystrom",
        kind="low-rank and compressed",
        repeats_kv="its key landmarks and the pseudo-inverse are computed per query head",
        summary="Nyström approximation of softmax through m segment-mean landmarks and an iterative pseudo-inverse",
        style=("#e377c2", "h"),
        reference="Xiong et al. 2021, 'Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention'",
        time_complexity="O(N m D + m^3)",
        memory_complexity="O(N D + N m + m^2)",
        supports_causal=False,
        why_not_causal="each landmark averages a whole segment, future positions included",
        subquadratic=True,
        notes="landmarks <= N; the N m term is the segment map, shared by the heads",
        function_options=("landmarks", "pinv_iterations"),
        examples=((("landmarks", 1),), (("landmarks", 4),), (("landmarks", 3), ("pinv_iterations", 8))),
    )

    def __init__(self, *, landmarks: int = 64, pinv_iterations: int = 6, **base):
        """
        Args:
            landmarks: m, segment means of the queries and of the keys the approximation goes through (m <= N).
            pinv_iterations: steps of the iterative pseudo-inverse of the m x m kernel (the paper: 6).
            scale: factor of the scores before the softmax; None means D ** -0.5.
        """
        super().__init__(**base)
        self._check_int("landmarks", landmarks, 1)
        self._check_int("pinv_iterations", pinv_iterations, 1)
        self.landmarks, self.pinv_iterations = landmarks, pinv_iterations

    def length_unsupported_reason(self, n_q: int, n_k: int) -> str | None:
        if self.landmarks > min(n_q, n_k):
            return f"landmarks={self.landmarks} > N={min(n_q, n_k)} (each landmark averages at least one position)"
        return None

    def check_length(self, n: int) -> int:
        return max(n, self.landmarks)  # at least one position a landmark

    def _landmarks(self, q, k, key_padding_mask):
        m = self.landmarks
        q_valid = key_padding_mask if key_padding_mask is not None and q.shape[-2] == k.shape[-2] else None
        q_marks, _ = segment_means(q, m, q_valid)
        k_marks, k_ok = segment_means(k, m, key_padding_mask)
        return q_marks, k_marks, k_ok

    def _kernel_pinv(self, q_marks, k_marks, k_ok, scale):
        """pinv(softmax(Q̃ K̃ᵀ · scale)) (B, H, m, m), key landmarks of padding only masked."""
        scores = torch.matmul(q_marks, k_marks.transpose(-1, -2)) * scale
        kernel = masked_softmax(scores, None if k_ok is None else k_ok[:, None, None, :])
        return iterative_pinv(kernel.to(torch.promote_types(kernel.dtype, torch.float32)), self.pinv_iterations).to(
            q_marks.dtype
        )

    def _attend(self, q, k, v, causal, key_padding_mask):
        if q.dtype in (torch.float16, torch.bfloat16):
            # the pseudo-inverse amplifies rounding by the kernel's condition number: landmarks, kernel and
            # products in float32 (bfloat16 inputs: up to 1.4 relative error on some rows otherwise)
            return self._attend(q.float(), k.float(), v.float(), causal, key_padding_mask).to(q.dtype)
        scale = self._scale(q)
        q_marks, k_marks, k_ok = self._landmarks(q, k, key_padding_mask)
        pinv = self._kernel_pinv(q_marks, k_marks, k_ok, scale)
        if key_padding_mask is None:
            w = sdpa(q_marks, k, v, scale=scale)  # softmax(Q̃ Kᵀ) V: (B, H, m, Dv)
            return sdpa(q, k_marks, torch.matmul(pinv, w), scale=scale)
        alive = key_padding_mask.any(-1)  # (B,): an element with no real key reads 0
        open_keys = key_padding_mask | ~alive[:, None]  # opened for dead elements so no row is empty (zeroed below)
        w = sdpa(q_marks, k, v, attn_mask=open_keys[:, None, None, :], scale=scale)
        open_marks = k_ok | ~alive[:, None]
        out = sdpa(q, k_marks, torch.matmul(pinv, w), attn_mask=open_marks[:, None, None, :], scale=scale)
        return out.masked_fill(~alive[:, None, None, None], 0.0)

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """The three softmax matrices stored and multiplied left to right (N x m)(m x m)(m x N), times V."""
        k, v = self._grouped_kv(q, k, v)  # grouped K/V: repeated to the query heads, as the forward repeats them
        scale = self._scale(q)
        q_marks, k_marks, k_ok = self._landmarks(q, k, key_padding_mask)
        pad = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        left = masked_softmax(
            torch.matmul(q, k_marks.transpose(-1, -2)) * scale, None if k_ok is None else k_ok[:, None, None, :]
        )
        right = masked_softmax(torch.matmul(q_marks, k.transpose(-1, -2)) * scale, pad)
        return torch.matmul(
            torch.matmul(torch.matmul(left, self._kernel_pinv(q_marks, k_marks, k_ok, scale)), right), v
        )

    def softmax_equivalent_length(self) -> int | None:
        return None  # exact only up to the iterative pseudo-inverse's error (tests/test_low_rank.py checks m = N)

    def flops(self, n_q, n_k, d, dv, causal):
        m = self.landmarks
        return 2.0 * m * n_k * (d + dv) + 2.0 * n_q * m * (d + dv) + 2.0 * m * m * (d + 3 * m * self.pinv_iterations)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        m = self.landmarks
        small = batch * heads * m * (m + d + dv) * 4 * (4 + self.pinv_iterations)
        return int(
            small
            + batch * m * n_k * 4
            + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward)
        )

    def extra_repr(self) -> str:
        return f"landmarks={self.landmarks}, pinv_iterations={self.pinv_iterations}"
