"""T5's relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
Text-to-Text Transformer", section 2.1): a learned scalar per head and distance bucket added to every score,

    s_ts = scale q_t·k_s + b_h[bucket(t − s)]

Buckets: a distance n = t − s below B/2 is its own bucket; from B/2 to `max_distance` the buckets widen
logarithmically; every distance beyond shares the last one. Causal: n < 0 never occurs and the B buckets cover
n ≥ 0; otherwise half the buckets are for keys after the query. Far distances share a bucket trained on nearer
ones, which is how the bias reaches lengths never trained. T5 shares one table across layers; here each
attention has its own (the same count of parameters per layer as ALiBi's zero). Needs the scores.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

T5_BUCKETS, T5_MAX_DISTANCE = 32, 128  # T5's defaults


def relative_bucket(distance: Tensor, causal: bool, buckets: int, max_distance: int) -> Tensor:
    """bucket(t − s) of each distance (query − key position), as T5's `_relative_position_bucket` computes it."""
    n = distance.long()
    offset = torch.zeros_like(n)
    if not causal:
        buckets //= 2
        offset = (n < 0).long() * buckets
        n = n.abs()
    else:
        n = n.clamp_min(0)
    exact = buckets // 2
    wide = (
        exact + (torch.log(n.clamp_min(1).double() / exact) / math.log(max_distance / exact) * (buckets - exact)).long()
    )
    return offset + torch.where(n < exact, n, wide.clamp_max(buckets - 1))


class T5RelativeBias(nn.Module):
    """b_h[bucket(distance)], (H, *distance.shape): a table of `buckets` learned scalars per head (zeros at the
    start: the model begins position-free).

    Example:
        >>> bias = T5RelativeBias(4)
        >>> bias(torch.arange(3)[:, None] - torch.arange(3), causal=True).shape
        torch.Size([4, 3, 3])
    """

    def __init__(self, num_heads: int, buckets: int = T5_BUCKETS, max_distance: int = T5_MAX_DISTANCE):
        super().__init__()
        for name, value, low in (
            ("num_heads", num_heads, 1),
            ("buckets", buckets, 4),
            ("max_distance", max_distance, 2),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"T5RelativeBias: {name}={value!r} must be an int >= {low}")
        if max_distance <= buckets // 4:
            raise ValueError(
                f"T5RelativeBias: max_distance={max_distance} must exceed buckets // 4 = {buckets // 4} "
                "(the exact buckets of a non-causal call)"
            )
        self.num_heads, self.buckets, self.max_distance = num_heads, buckets, max_distance
        self.table = nn.Parameter(torch.zeros(buckets, num_heads))

    def forward(self, distance: Tensor, causal: bool) -> Tensor:
        index = relative_bucket(distance, causal, self.buckets, self.max_distance)
        return self.table[index].movedim(-1, 0)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, buckets={self.buckets}, max_distance={self.max_distance}"
