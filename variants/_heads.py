"""`Heads`: what the shape hints num_heads, num_kv_heads and head_dim decide, which `AttentionVariant` inherits.

Grouped-query attention (Hkv K/V heads serving H query heads): whether a variant repeats K and V to the
query heads or computes on them natively, how many heads its decoding state keeps, and how many heads its
parameters acting on k are sized by; the errors naming a missing or mismatched hint.
"""

from __future__ import annotations


class Heads:
    """The head bookkeeping of `AttentionVariant` (variants/_variant.py), which supplies `spec`, `num_heads`,
    `num_kv_heads` and `head_dim`."""

    def repeats_kv_reason(self) -> str:
        """Why this variant (with its options) repeats K and V to the query heads before computing, or "" when it
        computes grouped-query inputs natively: its spec's `repeats_kv` unless its options change it."""
        return self.spec.repeats_kv

    def state_repeats_kv_reason(self) -> str:
        """Why the decoding state keeps its keys, values or sums per query head, or "" when it keeps one per K/V
        head (and `step` takes K/V unrepeated): the spec's `state_repeats_kv`, else `repeats_kv_reason()`.
        A window or a KV cache needs K and V only, whatever the forward's kernel takes."""
        if self.spec.state_repeats_kv is None:
            return self.repeats_kv_reason()
        return self.spec.state_repeats_kv

    def kv_heads_stored(self, heads: int, kv_heads: int) -> int:
        """How many heads of keys, values or state the variant keeps for H query heads on Hkv K/V heads."""
        return heads if self.state_repeats_kv_reason() else kv_heads

    def _kv_parameter_heads(self) -> int | None:
        """The heads parameters acting on k (gates, projections) are sized by: K/V heads where the variant
        computes grouped-query natively and knows them, else the query heads."""
        if self.repeats_kv_reason() or self.num_kv_heads is None:
            return self.num_heads
        return self.num_kv_heads

    def _require_head_shape(self, why: str) -> tuple[int, int]:
        """(num_heads, head_dim) for a variant whose parameters are sized per head; a ValueError naming both
        hints when either is missing, `why` saying which parameters need them."""
        if self.num_heads is None or self.head_dim is None:
            raise ValueError(
                f"{self.spec.name}: options num_heads and head_dim are required ({why}), "
                f"got num_heads={self.num_heads!r}, head_dim={self.head_dim!r}"
            )
        return self.num_heads, self.head_dim

    def _kv_parameters_reason(self, kv_heads: int, parts: str) -> str | None:
        """`kv_heads_unsupported_reason` of a variant whose `parts` ("its gates are") are sized for
        `_kv_parameter_heads()` K/V heads: None when kv_heads is that, else what to build instead."""
        want = self._kv_parameter_heads()
        if kv_heads == want:
            return None
        return (
            f"{parts} built for {want} K/V heads (num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads}); "
            f"build it with num_kv_heads={kv_heads} for grouped-query inputs"
        )
