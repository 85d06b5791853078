"""Learned absolute positions (BERT: Devlin et al. 2019; GPT-2): a trainable vector per position added to the
token embeddings before the first layer,

    h_t = E[x_t] + P[t],    P ∈ R^{max_len × d} trained with the model (initialised N(0, 0.02²)).

The most flexible absolute code on the lengths it trains on; a row P[t] of a t longer than training never
received a gradient, so it stays at its random start: the textbook case of an encoding that cannot extrapolate.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._checks import check_model_input, check_positive_int


class LearnedPositionalEmbedding(nn.Module):
    """Adds P[t] (a trained table of max_len rows) to (B, N, d) inputs.

    Example:
        >>> pe = LearnedPositionalEmbedding(16, max_len=128)
        >>> pe(torch.zeros(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, d_model: int, max_len: int = 8192):
        super().__init__()
        check_positive_int("LearnedPositionalEmbedding", "d_model", d_model)
        check_positive_int("LearnedPositionalEmbedding", "max_len", max_len)
        self.d_model, self.max_len = d_model, max_len
        self.table = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        check_model_input("LearnedPositionalEmbedding", "x", x, self.d_model)
        n = x.shape[1]
        if n > self.max_len:
            raise ValueError(f"LearnedPositionalEmbedding: sequence length {n} exceeds max_len={self.max_len}")
        return x + self.table[:n].to(x.dtype)
