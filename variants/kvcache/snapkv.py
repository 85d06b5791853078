"""SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): the last
`window_size` queries of the prompt (an observation window, where the question is) vote for the earlier
positions; the votes are pooled along the sequence so a kept position brings its neighbours.

    w_h(j)   = mean over the window's queries i of  softmax_i(q_i · k / √d)_j ,   j < N − window
    score(j) = mean over the group's heads of  avgpool_kernel(w_h)(j)      (zero padding at the edges)
    score(j) = max + 1  for the window's own positions                  (always kept)

As kvpress's SnapKVPress (window 64, kernel 5), with the softmax over every key the query sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._policy import KVPolicy, Prompt, group_mean, window_attention


class SnapKV(KVPolicy):
    """Args:
    window_size: the prompt's last queries that vote (kvpress's 64); the prompt must be longer.
    kernel_size: the width of the average pooling along the positions (odd; kvpress's 5)."""

    name = "snapkv"

    def __init__(self, window_size: int = 64, kernel_size: int = 5):
        for arg, value in (("window_size", window_size), ("kernel_size", kernel_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {arg}={value!r}: a whole number >= 1")
        if kernel_size % 2 == 0:
            raise ValueError(f"{self.name}: kernel_size={kernel_size}: odd (the pooling is centred on each position)")
        self.window_size, self.kernel_size = window_size, kernel_size
        self.shortest_prompt = window_size + 1

    def check_length(self, prompt: Prompt) -> None:
        if prompt.length <= self.window_size:
            raise ValueError(
                f"{self.name}: a prompt of {prompt.length} positions; window_size={self.window_size} needs a longer one"
            )

    def scores(self, prompt: Prompt) -> Tensor:
        self.check_length(prompt)
        w = self.window_size
        votes = window_attention(prompt, w)[..., :-w].mean(2)  # (B, H, N - w)
        pooled = F.avg_pool1d(votes, self.kernel_size, stride=1, padding=self.kernel_size // 2)
        scores = group_mean(pooled, prompt.keys.shape[1])  # (B, Hkv, N - w)
        return F.pad(scores, (0, w), value=float(scores.max()) + 1)


def reference_scores(policy: SnapKV, prompt: Prompt) -> Tensor:
    """Head by head, query by query, then each position's pooled neighbourhood summed by hand."""
    b, h, n, _ = prompt.queries.shape
    w, half = policy.window_size, policy.kernel_size // 2
    votes = torch.zeros(b, h, n - w, dtype=torch.float64)
    for head in range(h):
        k = prompt.keys[:, head // prompt.groups].double()
        for i in range(n - w, n):
            logits = (k[:, : i + 1] @ prompt.queries[:, head, i].double()[..., None])[..., 0] * prompt.score_scale
            votes[:, head] += logits.softmax(-1)[:, : n - w] / w
    pooled = torch.zeros_like(votes)
    for j in range(n - w):
        pooled[..., j] = votes[..., max(0, j - half) : j + half + 1].sum(-1) / policy.kernel_size
    hkv = prompt.keys.shape[1]
    scores = pooled.view(b, hkv, h // hkv, n - w).mean(2)
    return torch.cat([scores, (scores.max() + 1).expand(b, hkv, w)], dim=-1)


POLICY = SnapKV
