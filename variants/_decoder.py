"""`Decodes`: the decoding calls every variant inherits (`init_state`, `step`, `prefill`), a KV cache by default.

A variant with a state of its own overrides `state_kind`, `_empty_state`, `_prefill` and `_step`; the
public calls check their inputs and hand the variant trusted ones. The state itself: variants/_decoding.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_shape_hints
from ._decoding import DecodingState, appended, check_step, kv_cache, padded
from ._utils import spans


class Decodes:
    """The decoding half of `AttentionVariant` (variants/_variant.py), which supplies `spec`, the reasons
    (`causal_unsupported_reason`, `kv_heads_unsupported_reason`, ...), `_grouped_kv` and the causal call."""

    state_kind = "kv"  # what `init_state` keeps: "kv", "window", "compressed", "latent", "fenwick"... (_decoding.py)
    step_positions: int | None = None  # the most new positions one `_step` takes (`step` splits longer ones); None: any

    @classmethod
    def decode_unsupported_reason(cls) -> str | None:
        """None when the variant decodes (causal, one position after another), else why not."""
        reason = cls.causal_unsupported_reason()
        return f"{reason}, and decoding is causal" if reason else None

    def init_state(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        value_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_len: int | None = None,
        kv_heads: int | None = None,
    ) -> DecodingState:
        """An empty decoding state for `step` (see variants/_decoding.py): by default a KV cache; the
        recurrent methods keep a fixed-size state instead. `heads`: the query heads H; `kv_heads`: the heads Hkv
        of the keys and values the steps will take (grouped-query attention; None: H): a variant that computes
        them natively keeps Hkv heads of state, one that repeats them keeps H.

        Example:
            >>> attn = build("full")
            >>> state = attn.init_state(1, 2, 8, 8)
            >>> out, state = attn.step(*(torch.randn(1, 2, 1, 8) for _ in range(3)), state)
            >>> out.shape, state.length
            (torch.Size([1, 2, 1, 8]), 1)
        """
        reason = self.decode_unsupported_reason()
        if reason:
            raise ValueError(f"{self.spec.name} cannot decode: {reason}")
        kv_heads = heads if kv_heads is None else kv_heads
        for option, value in (
            ("batch", batch),
            ("heads", heads),
            ("head_dim", head_dim),
            ("value_dim", value_dim),
            ("kv_heads", kv_heads),
        ):
            self._check_int(option, value, 1)
        check_shape_hints(self, heads, head_dim, kv_heads)  # (the forward's own checks and messages)
        reason = self.kv_heads_unsupported_reason(kv_heads)
        if reason:
            raise ValueError(f"{self.spec.name}: a state for Hkv={kv_heads} K/V heads is not supported: {reason}")
        self._check_int("max_len", max_len, 1, allow_none=True)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{self.spec.name}: init_state's dtype must be a floating torch.dtype, got {dtype!r}")
        dev = torch.device(device)
        stored = self.kv_heads_stored(heads, kv_heads)
        tensors = self._empty_state(batch, stored, head_dim, value_dim, dtype, dev)
        if max_len is not None and self.state_kind == "kv":  # a KV cache, bounded: one buffer, written in place
            tensors = {
                **tensors,
                **kv_cache(batch, stored, self.cached_key_dim(head_dim), value_dim, dtype, dev, capacity=max_len),
            }
        return DecodingState(
            self.spec.name,
            self.state_kind,
            batch,
            heads,
            head_dim,
            value_dim,
            dtype,
            dev,
            0,
            max_len,
            tensors,
            kv_heads=kv_heads,
        )

    def step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, DecodingState]:
        """The outputs (B, H, t, Dv) of t new positions given the state of everything before, and the new state.

        key_padding_mask: bool (B, t) for the new positions (True = a real token), as the forward takes for
        all of them: padded positions are never attended to (the recurrences skip them). Equals the causal
        forward over the whole sequence at those positions, with the whole mask (tested for every variant)."""
        self._check_decoding(state, q, k, v, key_padding_mask)
        keep = (
            None
            if key_padding_mask is None or (bool(key_padding_mask.all()) and not padded(state))
            else key_padding_mask
        )
        k, v = self._grouped_kv(q, k, v, self.state_repeats_kv_reason())
        if self.step_positions is None or q.shape[2] <= self.step_positions:
            return self._step(q, k, v, state, keep)
        outs = []
        for sl in spans(
            q.shape[2], self.step_positions
        ):  # a long step as several: each _step's t x t work stays bounded
            out, state = self._step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state, None if keep is None else keep[:, sl])
            outs.append(out)
        return torch.cat(outs, dim=2), state

    def _check_decoding(self, state, q, k, v, key_padding_mask) -> None:
        """check_step's checks, and the length the sequence reaches, as the forward over it would check it."""
        check_step(self.spec.name, state, q, k, v, key_padding_mask)
        n = state.length + q.shape[2]
        reason = self.length_unsupported_reason(n, n)
        if reason:
            raise ValueError(f"{self.spec.name}: cannot step to {n} positions: {reason}")

    def step_read_bytes(self, state: DecodingState) -> int:
        """Bytes of `state` that one step of one new position must read: all of it, unless the method reads
        only part (moba: its block sums and the blocks it selects). What a decode cell's bandwidth counts."""
        return state.nbytes()

    def prefill(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, key_padding_mask: Tensor | None = None
    ) -> DecodingState:
        """The state after these positions when their outputs are not needed (a prompt before decoding):
        `step`'s state, without computing what only the outputs need (a KV cache only appends)."""
        self._check_decoding(state, q, k, v, key_padding_mask)
        keep = (
            None
            if key_padding_mask is None or (bool(key_padding_mask.all()) and not padded(state))
            else key_padding_mask
        )
        return self._prefill(q, *self._grouped_kv(q, k, v, self.state_repeats_kv_reason()), state, keep)

    def cached_key_dim(self, head_dim: int) -> int:
        """The width of the keys a KV state keeps: head_dim, unless the method caches a projection of them
        (additive: k W_k, attn_dim wide)."""
        return head_dim

    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device) -> dict[str, Tensor]:
        return kv_cache(batch, heads, self.cached_key_dim(head_dim), value_dim, dtype, device)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, keep: Tensor | None) -> DecodingState:
        """KV cache: the keys and values appended. `keep`: (B, t) bool of the new positions, None where no
        position of the state (or of these) is padding."""
        return appended(state, k, v, keep)[3]

    def _step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, keep: Tensor | None
    ) -> tuple[Tensor, DecodingState]:
        """KV cache: the new keys appended, then the variant's own causal call (bottom-right) over the cache."""
        keys, values, mask, state = appended(state, k, v, keep)
        return self(q, keys, values, causal=True, key_padding_mask=mask), state
