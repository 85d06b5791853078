"""What every KV-cache policy shares: the prompt it reads, its budget, the keep step, and the attention over
what it kept (the fast path) beside the dense reference that masks the dropped positions instead.

A policy runs once, after an exact prefill of N prompt positions: per K/V head it scores each position
(higher = kept), keeps the n_kept = max(1, ⌊N (1 − ratio)⌋) best (kvpress's `compute_n_kept`; `ratio` is the
fraction removed), and decoding then attends to the kept keys and values plus every new position:

    index = policy.keep(prompt, ratio)                      # (B, Hkv, n_kept) positions, ascending
    keys, values = gathered(prompt.keys, prompt.values, index)
    out = attend(q, cat(keys, k_new), cat(values, v_new))   # == reference_attend(q, ..., kept mask)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Prompt:
    """One layer's prompt as a policy reads it, after the exact prefill."""

    keys: Tensor  # (B, Hkv, N, D), after RoPE: as the cache holds them
    values: Tensor  # (B, Hkv, N, Dv)
    queries: Tensor  # (B, H, N, D), after RoPE: every prompt position's (H a multiple of Hkv)
    layer: int = 0  # this layer's index, of `layers` (PyramidKV's budget shrinks with it)
    layers: int = 1
    rope: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None  # positions (P,) -> cos, sin (P, D), or None
    scale: float | None = None  # the attention's score scale; None: 1 / sqrt(D)

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def groups(self) -> int:
        return self.queries.shape[1] // self.keys.shape[1]

    @property
    def score_scale(self) -> float:
        return self.scale if self.scale is not None else self.keys.shape[-1] ** -0.5


def n_kept(length: int, ratio: float) -> int:
    """Positions kept of `length` at compression `ratio` (the fraction removed): at least one."""
    return max(1, int(length * (1 - ratio)))


def check_ratio(ratio: float, name: str = "ratio") -> float:
    """`ratio` as a float; ValueError naming it unless 0 < ratio < 1."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ValueError(
            f"{name}={ratio!r}: a compression ratio is the fraction of the prompt's positions removed, "
            f"strictly between 0 and 1 (kvpress's 0.25, 0.5, 0.75, 0.875)"
        )
    return float(ratio)


def group_mean(scores: Tensor, kv_heads: int) -> Tensor:
    """(B, H, N) scores of the query heads -> (B, Hkv, N): the mean over each K/V head's group."""
    b, h, n = scores.shape
    return scores.view(b, kv_heads, h // kv_heads, n).mean(2)


def window_attention(prompt: Prompt, window: int) -> Tensor:
    """(B, H, w, N) softmax weights of the last w queries over every prompt key (causal: a query sees the keys at
    or before its position), the weights SnapKV, PyramidKV and TOVA read."""
    q = prompt.queries[:, :, -window:]  # (B, H, w, D)
    k = prompt.keys.repeat_interleave(prompt.groups, dim=1)  # (B, H, N, D)
    logits = (q @ k.transpose(-1, -2)).float() * prompt.score_scale  # (B, H, w, N)
    n, w = prompt.length, q.shape[2]
    hidden = torch.ones(w, n, dtype=torch.bool, device=q.device).triu(n - w + 1)
    return logits.masked_fill(hidden, float("-inf")).softmax(-1)


class KVPolicy:
    """A policy: `scores(prompt)` (B, Hkv, N), higher kept; `kept(prompt, ratio)` its budget; `keep` the positions.
    A subclass writes `scores` and, in its file, `reference_scores` (the same numbers, one position at a time)."""

    name = ""
    needs_rope = False  # True: `scores` reads prompt.rope (Expected Attention rotates queries to future positions)
    shortest_prompt = 1  # the fewest prompt positions it scores (SnapKV: more than its window)

    def scores(self, prompt: Prompt) -> Tensor:
        raise NotImplementedError

    def kept(self, prompt: Prompt, ratio: float) -> int:
        return n_kept(prompt.length, ratio)

    def keep(self, prompt: Prompt, ratio: float) -> Tensor:
        """(B, Hkv, n) positions kept per K/V head, ascending (the order they had: RoPE and causality need none)."""
        check_ratio(ratio)
        if self.needs_rope and prompt.rope is None:
            raise ValueError(f"{self.name}: needs the model's rotary embedding (Prompt.rope), got None")
        return self.top(self.scores(prompt), prompt, ratio)

    def top(self, scores: Tensor, prompt: Prompt, ratio: float) -> Tensor:
        """`keep` from scores already computed (they do not depend on the ratio: one scoring, every ratio)."""
        return scores.topk(self.kept(prompt, check_ratio(ratio)), dim=-1).indices.sort(-1).values

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "shortest_prompt")
        return f"{self.name}({options})"


def gathered(keys: Tensor, values: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """The kept keys (B, Hkv, n, D) and values (B, Hkv, n, Dv) at `index` (B, Hkv, n)."""
    return (
        keys.gather(2, index[..., None].expand(-1, -1, -1, keys.shape[-1])),
        values.gather(2, index[..., None].expand(-1, -1, -1, values.shape[-1])),
    )


def attend(q: Tensor, keys: Tensor, values: Tensor, scale: float | None = None) -> Tensor:
    """The fast path: q (B, H, t, D), the t new positions, over keys/values (B, Hkv, m, ·) whose last t are theirs;
    each new position sees every kept one and the new ones up to itself (bottom-right causal) -> (B, H, t, Dv)."""
    t, m = q.shape[2], keys.shape[2]
    mask = None if t == 1 else torch.ones(t, m, dtype=torch.bool, device=q.device).tril(m - t)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


def reference_attend(q: Tensor, keys: Tensor, values: Tensor, kept: Tensor, scale: float | None = None) -> Tensor:
    """The dense reference: q (B, H, t, D) after a prompt of N positions, over ALL N + t keys/values (B, Hkv, N+t, ·),
    `kept` (B, Hkv, N) True where the policy kept the position; one query row at a time, dropped positions masked."""
    b, h, t, _ = q.shape
    n, groups = kept.shape[-1], h // keys.shape[1]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.empty(b, h, t, values.shape[-1], dtype=q.dtype, device=q.device)
    for head in range(h):
        g = head // groups
        for i in range(t):  # new position N + i sees the kept prompt and the new positions 0..i
            seen = torch.cat([kept[:, g], torch.ones(b, i + 1, dtype=torch.bool, device=q.device)], dim=1)
            logits = (keys[:, g, : n + i + 1] @ q[:, head, i, :, None])[..., 0] * scale  # (B, N + i + 1)
            weights = logits.masked_fill(~seen, float("-inf")).softmax(-1)
            out[:, head, i] = (weights[..., None] * values[:, g, : n + i + 1]).sum(1)
    return out
