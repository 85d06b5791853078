"""A user's own attention, registered from outside the package: what `--import user_variant` brings in."""

from __future__ import annotations

import torch.nn.functional as F

from variants import AttentionVariant, VariantSpec
import variants


@variants.register
class TemperedAttention(AttentionVariant):
    spec = VariantSpec(
        name="test_tempered",
        summary="exact softmax attention with the scores divided by a temperature",
        reference="tests/user_variant.py",
        time_complexity="O(N^2 D)",
        memory_complexity="O(N D)",
        supports_key_padding_mask=False,
    )

    def __init__(self, *, temperature: float = 1.0, **base):
        """
        Args:
            temperature: the scores are divided by it (> 0).
        """
        super().__init__(**base)
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"test_tempered: option temperature={temperature!r} is invalid; expected a number > 0")
        self.temperature = temperature

    def flops(self, n_q, n_k, d, dv, causal):
        return 2.0 * n_q * n_k * (d + dv)

    def _scale(self, q):
        return super()._scale(q) / self.temperature

    def _attend(self, q, k, v, causal, key_padding_mask):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self._scale(q))
