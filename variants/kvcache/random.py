"""Random: keep uniformly random positions, drawn from a seed (and the layer) — the floor every policy must
beat, as kvpress's RandomPress.

    score(j) ~ U(0, 1)         independently per (K/V head, position)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._policy import KVPolicy, Prompt


class Random(KVPolicy):
    """Args:
    seed: the draw's seed (each layer draws from seed and its index)."""

    name = "random"

    def __init__(self, seed: int = 0):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"random: seed={seed!r}: a whole number")
        self.seed = seed

    def scores(self, prompt: Prompt) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + prompt.layer)
        return torch.rand(prompt.keys.shape[:-1], generator=generator).to(prompt.keys.device)


def reference_scores(policy: Random, prompt: Prompt) -> Tensor:
    """The same draw, position by position in row-major order (torch.rand fills a tensor that way)."""
    generator = torch.Generator().manual_seed(policy.seed * 100_003 + prompt.layer)
    b, hkv, n, _ = prompt.keys.shape
    flat = [float(torch.rand(1, generator=generator)) for _ in range(b * hkv * n)]
    return torch.tensor(flat).view(b, hkv, n)


POLICY = Random
