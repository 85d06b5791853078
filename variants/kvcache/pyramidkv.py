"""PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling"): SnapKV's scores with a budget that shrinks from the first layer to the last, the same total.

With B = N (1 − ratio) positions a layer on average, w the window and β the steepness (kvpress's
PyramidKVPress, after KVCache-Factory):

    lo = B / β ,  hi = 2 B − lo          (hi capped at N − w, lo then 2 B − hi)
    kept(layer) = round(hi − layer (hi − lo) / (layers − 1))

A budget out of range (a short prompt, a ratio near 0) falls back to SnapKV's n_kept, as kvpress does.
"""

from __future__ import annotations

from ._policy import Prompt, n_kept
from .snapkv import SnapKV
from .snapkv import reference_scores as snapkv_reference_scores


class PyramidKV(SnapKV):
    """Args:
    window_size: the prompt's last queries that vote (kvpress's 64).
    kernel_size: the width of the average pooling along the positions (odd; kvpress's 5).
    beta: the pyramid's steepness, >= 1 (kvpress's 20: the last layer keeps 1/20 of the first's share)."""

    name = "pyramidkv"

    def __init__(self, window_size: int = 64, kernel_size: int = 5, beta: int = 20):
        super().__init__(window_size, kernel_size)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta < 1:
            raise ValueError(f"pyramidkv: beta={beta!r}: the pyramid's steepness, >= 1")
        self.beta = beta

    def kept(self, prompt: Prompt, ratio: float) -> int:
        n, w = prompt.length, self.window_size
        capacity = w + n * (1 - ratio)
        lo = (capacity - w) / self.beta
        hi = (capacity - w) * 2 - lo
        if hi >= n - w:
            hi = n - w
            lo = (capacity - w) * 2 - hi
        if not (n >= hi >= lo >= w):
            return n_kept(n, ratio)
        step = (hi - lo) / (prompt.layers - 1) if prompt.layers > 1 else 0.0
        return round(hi - prompt.layer * step)


def reference_scores(policy: PyramidKV, prompt: Prompt):
    """SnapKV's scores (its file's reference): the pyramid changes the budget, not the scores."""
    return snapkv_reference_scores(policy, prompt)


POLICY = PyramidKV
