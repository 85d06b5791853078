"""Decoding states: what a variant keeps between calls while it generates one position after another.

    state = attn.init_state(batch, heads, head_dim, value_dim, dtype, device)
    state = attn.prefill(q, k, v, state)          # a prompt whose outputs are not needed
    out, state = attn.step(q, k, v, state)        # q, k, v: (B, H, t, D) of t >= 1 new positions

Six kinds (`DecodingState.kind`, the variant's `state_kind`):
  "kv"         a KV cache: every key and value so far (it grows with N), the default of every causal variant:
               a step is its own causal call over the cache, bottom-right aligned (= the causal forward).
  "window"     the first g (global / sink) positions and the last w: at most g + w positions whatever N.
  "compressed" memory_compressed's slots of the complete blocks and the raw keys of the unfinished one:
               N / c + (< c) positions, growing c times slower than a KV cache.
  "latent"     mla's latents (one a position for every head, read absorbed); "fenwick": log_linear's buckets.
  "recurrent"  a fixed-size state: a D x Dv matrix per head for the gated recurrences, the F x (Dv + 1)
               sums Σ φ(k) [v, 1]ᵀ of linear attention and performer; constant memory whatever N.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class DecodingState:
    """One variant's state after `length` positions (a new state is returned by every `step`).

    The window's is sliding_window's and its flex sibling's. A method with a state of its own (moba: the KV
    cache plus running block sums) adds tensors to these kinds.

    A state is never changed in place (every step returns a new one; an old one stays valid, as beam search
    needs), except two buffers the steps write into past what older states read: the KV cache of
    init_state(max_len=...) (`appended`) and memory_compressed's slots (grown by doubling). Stepping twice from
    one such state writes the same rows: branch from a copy.
    """

    variant: str  # the variant that made it (a state is never read by another)
    kind: str  # "kv" or "recurrent" (see the module docstring)
    batch: int
    heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device
    length: int = 0  # positions decoded so far
    max_len: int | None = None  # the longest sequence this state may reach (None: no bound)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    kv_heads: int | None = (
        None  # heads Hkv of the keys and values the steps take (grouped-query attention); None: heads
    )

    @property
    def key_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    def nbytes(self) -> int:
        """Bytes the state holds (every tensor of it)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def advanced(self, steps: int, **tensors: Tensor) -> "DecodingState":
        """The state `steps` positions later, with these tensors replaced."""
        return replace(self, length=self.length + steps, tensors={**self.tensors, **tensors})


def kv_cache(
    batch: int, heads: int, head_dim: int, value_dim: int, dtype: torch.dtype, device, capacity: int = 0
) -> dict[str, Tensor]:
    """An empty KV cache: keys (B, H, capacity, D) and values (B, H, capacity, Dv). capacity 0: grown by
    concatenation at every step; > 0: one buffer the steps write into (see `appended`)."""
    return {
        "k": torch.empty(batch, heads, capacity, head_dim, dtype=dtype, device=device),
        "v": torch.empty(batch, heads, capacity, value_dim, dtype=dtype, device=device),
    }


def padded(state: DecodingState) -> bool:
    """Whether the positions a state keeps include padding: it then holds their mask ("mask", True = real)."""
    return "mask" in state.tensors


def masks_appended(state: DecodingState, kept: Tensor | None, n: int, keep: Tensor | None, t: int) -> Tensor | None:
    """The mask (B, n + t) of n kept positions (`kept`, None: all real) followed by t new ones (`keep`, None:
    all real); None while none of them is padding, so a state without padding holds no mask."""
    if kept is None and keep is None:
        return None
    ones = lambda count: torch.ones(state.batch, count, dtype=torch.bool, device=state.device)  # noqa: E731
    return torch.cat([kept if kept is not None else ones(n), keep if keep is not None else ones(t)], dim=1)


def appended(
    state: DecodingState, k: Tensor, v: Tensor, keep: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None, DecodingState]:
    """(every key, every value, their padding mask or None, the state after them) of a KV cache given t new
    positions (`keep`: their mask, None where they are real).

    A cache grown by concatenation copies itself at every step (O(N) bytes written besides the N read);
    a cache made with init_state(max_len=...) is one buffer of max_len positions written in place: a step
    reads what it must and writes only its t positions. Stepping twice from the same bounded state (two
    branches) writes the same positions: the later one wins, the earlier state then reads it."""
    n, t = state.length, k.shape[2]
    mask = masks_appended(state, state.tensors.get("mask"), n, keep, t)
    extra = {} if mask is None else {"mask": mask}
    buf_k, buf_v = state.tensors["k"], state.tensors["v"]
    if buf_k.shape[2] > n:  # a bounded buffer with room (check_step keeps n + t <= max_len)
        buf_k[:, :, n : n + t], buf_v[:, :, n : n + t] = k, v
        return buf_k[:, :, : n + t], buf_v[:, :, : n + t], mask, state.advanced(t, **extra)
    keys, values = torch.cat([buf_k, k], dim=2), torch.cat([buf_v, v], dim=2)
    return keys, values, mask, state.advanced(t, k=keys, v=values, **extra)


def check_step(name: str, state, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> None:
    """ValueError/TypeError naming what does not match between a state and the new positions."""
    if not isinstance(state, DecodingState):
        raise TypeError(
            f"{name}: step needs the state init_state returned (or the last step's), got {type(state).__name__}"
        )
    if state.variant != name:
        raise ValueError(f"{name}: this state was made by {state.variant!r}, not {name!r}")
    for arg, t, last, heads in (
        ("q", q, state.head_dim, state.heads),
        ("k", k, state.head_dim, state.key_heads),
        ("v", v, state.value_dim, state.key_heads),
    ):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: step's {arg} must be a tensor (B, H, t, D), got {got}")
        want = (state.batch, heads, t.shape[2], last)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: step's {arg} has shape {tuple(t.shape)}; the state is for (B, H, t, ·) = {want}")
        if t.dtype != state.dtype or t.device != state.device:
            raise ValueError(
                f"{name}: step's {arg} is {t.dtype} on {t.device}; the state holds {state.dtype} on {state.device}"
            )
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError(
            f"{name}: step's q, k, v must hold the same t new positions, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}"
        )
    if q.shape[2] == 0:
        raise ValueError(f"{name}: step needs t >= 1 new positions, got t = 0")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            got = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
            raise TypeError(f"{name}: step's key_padding_mask must be a bool tensor (True = real token), got {got}")
        if tuple(key_padding_mask.shape) != (state.batch, q.shape[2]) or key_padding_mask.device != state.device:
            raise ValueError(
                f"{name}: step's key_padding_mask must be (B, t) = {(state.batch, q.shape[2])} on "
                f"{state.device} (the new positions'), got {tuple(key_padding_mask.shape)} on {key_padding_mask.device}"
            )
    if state.max_len is not None and state.length + q.shape[2] > state.max_len:
        raise ValueError(f"{name}: {state.length} + {q.shape[2]} positions pass the state's max_len={state.max_len}")
