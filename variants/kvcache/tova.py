"""TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"): keep the positions the last query attends to
most, averaged over the layer's heads (one choice for the whole layer, as the paper and kvpress's TOVAPress).

    score(j) = mean over every head h of  softmax(q_{N−1} · k / √d)_j ,   j < N − 1
    score(N − 1) = max + 1                                             (the last position is always kept)

The paper evicts one position per generated token; here, as in kvpress, the prompt is compressed once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._policy import KVPolicy, Prompt, window_attention


class TOVA(KVPolicy):
    """No options."""

    name = "tova"

    def scores(self, prompt: Prompt) -> Tensor:
        weights = window_attention(prompt, 1)[:, :, 0, :-1].mean(1, keepdim=True)  # (B, 1, N - 1)
        weights = weights.expand(-1, prompt.keys.shape[1], -1)
        return torch.nn.functional.pad(weights, (0, 1), value=float(weights.max()) + 1)


def reference_scores(policy: TOVA, prompt: Prompt) -> Tensor:
    """The last query's weights head by head, averaged, each position in turn."""
    b, h, n, _ = prompt.queries.shape
    mean = torch.zeros(b, n - 1, dtype=torch.float64)
    for head in range(h):
        k = prompt.keys[:, head // prompt.groups].double()
        weights = ((k @ prompt.queries[:, head, -1].double()[..., None])[..., 0] * prompt.score_scale).softmax(-1)
        mean += weights[:, :-1] / h
    out = torch.cat([mean, (mean.max() + 1).expand(b, 1)], dim=-1)  # (the batch's max, as the fast path)
    return out[:, None].expand(-1, prompt.keys.shape[1], -1)


POLICY = TOVA
