"""ALiBi, attention with linear biases (Press, Smith & Lewis 2022, "Train Short, Test Long"): no position in
the embeddings; each head adds a fixed penalty proportional to the distance to every score,

    s_ts = scale q_t·k_s − m_h |t − s|,    m_h = 2^(−8h/H),  h = 1 .. H

(H a power of two; otherwise the slopes of the power of two below, then every other slope of the one above, as
the paper's code does). A recency bias that is the same at any length, which is why the paper's models trained at
L still work at several L: the experiment `bench quality --preset positions` repeats. It needs the scores: only
a method that forms q·k (exact, window) can add it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def alibi_slopes(heads: int) -> list[float]:
    """m_1 .. m_H of the paper's code (a geometric sequence starting and stepping at 2^(−8/n), n a power of two)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_two(heads)
    below = 2 ** math.floor(math.log2(heads))
    return power_of_two(below) + power_of_two(2 * below)[0::2][: heads - below]


class AlibiBias(nn.Module):
    """The additive score bias −m_h |distance|, (H, *distance.shape), for distance = query − key position.

    Example:
        >>> AlibiBias(2)(torch.tensor([0, 1, 2]), causal=True)
        tensor([[ 0.0000, -0.0625, -0.1250],
                [ 0.0000, -0.0039, -0.0078]])
    """

    def __init__(self, num_heads: int):
        super().__init__()
        if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
            raise ValueError(f"AlibiBias: num_heads={num_heads!r} must be a positive int")
        self.num_heads = num_heads
        self.register_buffer("slopes", torch.tensor(alibi_slopes(num_heads)), persistent=False)

    def forward(self, distance: Tensor, causal: bool) -> Tensor:
        slopes = self.slopes.view(-1, *[1] * distance.dim())
        return slopes * (-distance.abs()).to(self.slopes.dtype)  # (an int negated: no -0.0)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"
