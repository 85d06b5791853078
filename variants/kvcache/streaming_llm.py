"""StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"): keep the
first `n_sink` positions, the attention sinks every head leans on, and the most recent ones.

    score(j) = 2            for j < n_sink     (always kept)
    score(j) = j / N        otherwise          (the newest win the rest of the budget)

Query-free and the same for every head. kvpress's StreamingLLMPress keeps the same set (its scores are 1
for the sinks and the last positions, 0 between); like it, the kept keys keep the rotation of their
original positions (the paper re-rotates them into a contiguous window: kvpress's KeyRerotationPress).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._policy import KVPolicy, Prompt


class StreamingLLM(KVPolicy):
    """Args:
    n_sink: the first positions always kept (the paper's and kvpress's 4)."""

    name = "streaming_llm"

    def __init__(self, n_sink: int = 4):
        if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"streaming_llm: n_sink={n_sink!r}: a count of first positions kept, >= 0")
        self.n_sink = n_sink

    def scores(self, prompt: Prompt) -> Tensor:
        b, hkv, n, _ = prompt.keys.shape
        position = torch.arange(n, device=prompt.keys.device, dtype=torch.float32)
        scores = torch.where(position < self.n_sink, 2.0, position / n)  # (N,)
        return scores.expand(b, hkv, n)


def reference_scores(policy: StreamingLLM, prompt: Prompt) -> Tensor:
    """One position at a time: a sink scores 2, any other its recency j / N."""
    b, hkv, n, _ = prompt.keys.shape
    out = torch.empty(b, hkv, n)
    for j in range(n):
        out[:, :, j] = 2.0 if j < policy.n_sink else j / n
    return out


POLICY = StreamingLLM
