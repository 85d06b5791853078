"""H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models"): keep the "heavy hitters", the positions with the most attention accumulated over the prompt.

    score(j) = mean over the group's heads h of  Σ_{i ≥ j} softmax_i(q_i · k / √d)_j      (causal weights)

With `normalized=True` each sum is divided by the N − j queries that see position j: kvpress's
ObservedAttentionPress, which otherwise keeps the same positions (it reads the eager attention weights;
here they are recomputed from the prompt's queries, 512 rows at a time against the keys they see, so memory
stays O(N)). The paper also keeps a recent window and evicts while decoding; here, as in kvpress, it is
applied once at prefill.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._policy import KVPolicy, Prompt

ROWS = 512  # query rows of the attention weights held at once


class H2O(KVPolicy):
    """Args:
    normalized: divide each position's accumulated attention by the queries that see it (kvpress's
        observed attention) instead of the paper's plain sum."""

    name = "h2o"

    def __init__(self, normalized: bool = False):
        if not isinstance(normalized, bool):
            raise ValueError(f"h2o: normalized={normalized!r}: True or False")
        self.normalized = normalized

    def scores(self, prompt: Prompt) -> Tensor:
        b, hkv, n, d = prompt.keys.shape
        groups = prompt.groups
        total = torch.zeros(b, hkv, groups, n, dtype=torch.float32, device=prompt.keys.device)  # (B, Hkv, G, N)
        for lo in range(0, n, ROWS):
            hi = min(n, lo + ROWS)  # (rows lo..hi see keys 0..hi only: the blocks above the diagonal are skipped)
            q = prompt.queries[:, :, lo:hi].reshape(b, hkv, groups * (hi - lo), d) * prompt.score_scale
            logits = (q @ prompt.keys[:, :, :hi].transpose(-1, -2)).float().view(b, hkv, groups, hi - lo, hi)
            future = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=q.device).triu(1)  # (the diagonal block)
            logits[..., lo:].masked_fill_(future, float("-inf"))
            total[..., :hi] += logits.softmax(-1).sum(3)
        if self.normalized:
            total = total / torch.arange(n, 0, -1, device=total.device, dtype=total.dtype)
        return total.mean(2)


def reference_scores(policy: H2O, prompt: Prompt) -> Tensor:
    """Query by query, head by head: each query's causal softmax added to the positions it sees."""
    b, h, n, _ = prompt.queries.shape
    hkv = prompt.keys.shape[1]
    total = torch.zeros(b, h, n, dtype=torch.float64)
    for head in range(h):
        k = prompt.keys[:, head // prompt.groups].double()  # (B, N, D)
        for i in range(n):
            logits = (k[:, : i + 1] @ prompt.queries[:, head, i].double()[..., None])[..., 0] * prompt.score_scale
            total[:, head, : i + 1] += logits.softmax(-1)
    if policy.normalized:
        total /= torch.arange(n, 0, -1, dtype=torch.float64)
    return total.view(b, hkv, h // hkv, n).mean(2)


POLICY = H2O
