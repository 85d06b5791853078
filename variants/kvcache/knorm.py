"""KNorm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"):
keep the keys of smallest L2 norm, which draw the most attention.

    score(j) = − ‖k_j‖₂        per K/V head (computed in float32 at least, as kvpress's KnormPress)

Query-free: the cheapest policy, and query-agnostic by construction.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._policy import KVPolicy, Prompt


class KNorm(KVPolicy):
    """No options."""

    name = "knorm"

    def scores(self, prompt: Prompt) -> Tensor:
        dtype = torch.promote_types(prompt.keys.dtype, torch.float32)
        return -torch.linalg.vector_norm(prompt.keys, dim=-1, dtype=dtype)


def reference_scores(policy: KNorm, prompt: Prompt) -> Tensor:
    """One key at a time: minus the square root of its sum of squares."""
    b, hkv, n, _ = prompt.keys.shape
    out = torch.empty(b, hkv, n, dtype=torch.float64)
    for j in range(n):
        out[:, :, j] = -(prompt.keys[:, :, j].double() ** 2).sum(-1).sqrt()
    return out


POLICY = KNorm
