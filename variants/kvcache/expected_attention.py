"""Expected Attention (Devoto et al. 2025, kvpress's ExpectedAttentionPress): score each position by the
attention future queries are expected to pay it, from the statistics of the prompt's queries.

The queries before RoPE, from position n_sink on, have mean μ and covariance Σ (per head). A future query at
position p is R_p q (RoPE's rotation); averaged over the next n_future positions, R̄ = mean_p R_p. If
q ~ N(R̄μ, R̄ΣR̄ᵀ), then E[exp(s q·k)] = exp(s μ̄·k + s² kᵀΣ̄k / 2), so

    a(j)     = softmax_j( s μ̄·k_j + s² k_jᵀ Σ̄ k_j / 2 )     over j ≥ n_sink, each head  (s = 1/√d)
    score(j) = (mean over the group's heads of a(j) + ε) · ‖v_j‖     (use_vnorm)
    score(j) = max + 1   for j < n_sink                               (always kept)

Queries after RoPE are rotated back to before it (R_iᵀ q_i), so the policy reads the same prompt as the
others; the model's rotary embedding (Prompt.rope) gives R_p.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._policy import KVPolicy, Prompt, group_mean


def rotate_half(x: Tensor) -> Tensor:
    """RoPE's pairing of dimension i with i + D/2 (Llama's layout): (x1, x2) -> (−x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def unrotated(prompt: Prompt) -> Tensor:
    """(B, H, N, D) queries before RoPE: R_iᵀ q_i = q_i cos − rotate_half(q_i) sin."""
    cos, sin = prompt.rope(torch.arange(prompt.length, device=prompt.queries.device))  # (N, D) each
    q = prompt.queries.float()
    return q * cos - rotate_half(q) * sin


def mean_rotation(prompt: Prompt, n_future: int) -> Tensor:
    """R̄ (D, D): RoPE's rotation averaged over positions N .. N + n_future − 1."""
    cos, sin = prompt.rope(torch.arange(prompt.length, prompt.length + n_future, device=prompt.keys.device))
    d = cos.shape[-1]
    swap = torch.zeros(d, d, device=cos.device)  # rotate_half(x) = swap @ x
    swap[d // 2 :, : d // 2], swap[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
    rotations = cos[:, None, :] * torch.eye(d, device=cos.device) + sin[:, None, :] * swap  # (P, D, D)
    return rotations.float().mean(0)


class ExpectedAttention(KVPolicy):
    """Args:
    n_future: the future positions whose rotations are averaged (kvpress's 512).
    n_sink: the first positions always kept and left out of the query statistics (kvpress's 4).
    use_covariance: add the queries' covariance term (kvpress's default True).
    use_vnorm: multiply by the value's norm (kvpress's default True).
    epsilon: added to the attention before the value norm (kvpress's 0)."""

    name = "expected_attention"
    needs_rope = True

    def __init__(
        self,
        n_future: int = 512,
        n_sink: int = 4,
        use_covariance: bool = True,
        use_vnorm: bool = True,
        epsilon: float = 0.0,
    ):
        for arg, value, low in (("n_future", n_future, 1), ("n_sink", n_sink, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"expected_attention: {arg}={value!r}: a whole number >= {low}")
        self.n_future, self.n_sink = n_future, n_sink
        self.shortest_prompt = n_sink + 1
        self.use_covariance, self.use_vnorm, self.epsilon = bool(use_covariance), bool(use_vnorm), float(epsilon)

    def scores(self, prompt: Prompt) -> Tensor:
        if prompt.length <= self.n_sink:
            raise ValueError(
                f"expected_attention: a prompt of {prompt.length} positions; n_sink={self.n_sink} keeps all"
            )
        q = unrotated(prompt)[:, :, self.n_sink :]  # (B, H, n, D)
        rotation = mean_rotation(prompt, self.n_future)  # (D, D)
        mu = q.mean(2)  # (B, H, D)
        k = prompt.keys[:, :, self.n_sink :].float().repeat_interleave(prompt.groups, dim=1)  # (B, H, M, D)
        s = prompt.score_scale
        logits = (k @ (mu @ rotation.T)[..., None])[..., 0] * s  # (B, H, M)
        if self.use_covariance:
            centred = q - q.mean(2, keepdim=True)
            cov = centred.transpose(-1, -2) @ centred / q.shape[2]  # (B, H, D, D)
            cov = rotation @ cov @ rotation.T
            logits = logits + ((k @ cov) * k).sum(-1) * s * s / 2
        scores = group_mean(logits.softmax(-1), prompt.keys.shape[1])
        if self.use_vnorm:
            scores = (scores + self.epsilon) * prompt.values[:, :, self.n_sink :].float().norm(dim=-1)
        return F.pad(scores, (self.n_sink, 0), value=float(scores.max()) + 1)


def reference_scores(policy: ExpectedAttention, prompt: Prompt) -> Tensor:
    """Head by head, key by key, in float64: each future position's rotation applied to the mean and covariance
    (as R_p x = x cos_p + rotate_half(x) sin_p), averaged; the queries' statistics by explicit sums."""
    b, h, n, d = prompt.queries.shape
    cos, sin = (t.double() for t in prompt.rope(torch.arange(n + policy.n_future)))
    s, hkv = prompt.score_scale, prompt.keys.shape[1]
    out = torch.zeros(b, h, n - policy.n_sink, dtype=torch.float64)
    for head in range(h):
        q = prompt.queries[:, head].double()
        q = q * cos[:n] - rotate_half(q) * sin[:n]  # before RoPE
        q = q[:, policy.n_sink :]
        mu = q.sum(1) / q.shape[1]  # (B, D)
        cov = sum((q[:, i] - mu)[:, :, None] * (q[:, i] - mu)[:, None, :] for i in range(q.shape[1])) / q.shape[1]
        basis = torch.eye(d, dtype=torch.float64)
        rotation = sum(basis * cos[p] + rotate_half(basis) * sin[p] for p in range(n, n + policy.n_future))
        rotation = rotation.T / policy.n_future  # row i of the sum is R_p applied to e_i: transpose to get R̄
        mu_f, cov_f = mu @ rotation.T, rotation @ cov @ rotation.T
        for j in range(policy.n_sink, n):
            key = prompt.keys[:, head // prompt.groups, j].double()  # (B, D)
            logit = (key * mu_f).sum(-1) * s
            if policy.use_covariance:
                logit = logit + torch.einsum("bi,bij,bj->b", key, cov_f, key) * s * s / 2
            out[:, head, j - policy.n_sink] = logit
    scores = out.softmax(-1).view(b, hkv, h // hkv, n - policy.n_sink).mean(2)
    if policy.use_vnorm:
        scores = (scores + policy.epsilon) * prompt.values[:, :, policy.n_sink :].double().norm(dim=-1)
    return torch.cat([(scores.max() + 1).expand(b, hkv, policy.n_sink), scores], dim=-1)


POLICY = ExpectedAttention
