"""Sinusoidal positions (Vaswani et al. 2017, "Attention Is All You Need"): a fixed table added to the token
embeddings before the first layer,

    PE(t, 2i) = sin(t / 10000^(2i/d)),    PE(t, 2i+1) = cos(t / 10000^(2i/d)),

so each pair of channels turns at its own frequency and PE(t + c) is a rotation of PE(t) (a relative offset is
a linear map of the table). Absolute: the model sees t itself, and a t longer than training ever showed is a
combination of angles it never read.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._checks import check_model_input, check_positive_int


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """PE (max_len, d_model) in float64, as the formula above writes it."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return pe


class SinusoidalPositionalEncoding(nn.Module):
    """Adds PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) to (B, N, d) inputs.

    Example:
        >>> pe = SinusoidalPositionalEncoding(16, max_len=128)
        >>> pe(torch.zeros(1, 5, 16))[0, 0, :2]
        tensor([0., 1.])
    """

    def __init__(self, d_model: int, max_len: int = 8192):
        super().__init__()
        check_positive_int("SinusoidalPositionalEncoding", "d_model", d_model)
        check_positive_int("SinusoidalPositionalEncoding", "max_len", max_len)
        self.d_model, self.max_len = d_model, max_len
        self.register_buffer("pe", sinusoidal_table(max_len, d_model).float(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        check_model_input("SinusoidalPositionalEncoding", "x", x, self.d_model)
        n = x.shape[1]
        if n > self.max_len:
            raise ValueError(f"SinusoidalPositionalEncoding: sequence length {n} exceeds max_len={self.max_len}")
        return x + self.pe[:n].to(x.dtype)
