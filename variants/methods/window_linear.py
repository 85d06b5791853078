"""LoLCATs' hybrid attention: Zhang et al. 2025, "LoLCATs: On Low-Rank Linearizing of Large Language Models".

Each query attends exactly (softmax) to the keys of its last w positions and linearly, through learned
Hedgehog feature maps φ (linear.py), to every older key; both parts share one normalizer:

    o_t = (f_h Σ_{t−w <= s <= t} e_ts v_s + Σ_{s < t−w} φ(q_t)·φ(k_s) v_s)
          / (f_h Σ_{t−w <= s <= t} e_ts   + Σ_{s < t−w} φ(q_t)·φ(k_s))
    e_ts = exp(scale q_t·k_s − m_t),   m_t = max_{t−w <= s <= t} scale q_t·k_s,   f_h = σ(window_factor_h)
    φ(q_t) = φ_q(scale q_t),  φ(k_s) = φ_k(k_s)    (Hedgehog maps, one pair per head; query_scaled=False: φ_q(q_t))

With feature_inputs="pre_rope" (a departure from LoLCATs) a rotary model's rotation is undone before φ:
φ(q_t) = φ_q(scale R_{−t} q_t), φ(k_s) = φ_k(R_{−s} k_s), and the window keeps the rotated q, k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, register
from .._decoding import masks_appended
from .._utils import pad_to_multiple, spans
from .linear import MapInputs, learned_feature_maps

WINDOW_FACTOR_INIT = -2.197  # σ(−2.197) ≈ 0.1, LoLCATs' initial weight of the window against the linear part
BLOCK = 64  # queries a tile (at most w)
GROUP_POSITIONS = 512  # positions computed at once, the state carried between groups


def _band_masks(c: int, w: int, device) -> tuple[Tensor, Tensor]:
    """For a tile of c queries (i) over the w + c keys of positions [bc − w, bc + c) (j): the window's
    keys, i <= j <= i + w, and the linear part's, j < i (older than the window, inside the tile)."""
    i = torch.arange(c, device=device)[:, None]
    j = torch.arange(w + c, device=device)[None, :]
    return (j >= i) & (j <= i + w), j < i


def _ones_column(v: Tensor) -> Tensor:
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _combine(
    f: Tensor,
    scores: Tensor,
    window: Tensor,
    values: Tensor,
    linear: Tensor,
    lin_values: Tensor,
    phi_q: Tensor,
    state: Tensor,
) -> Tensor:
    """o = (f Σ e v + Σ lin v + φ(q) S) / (f Σ e + Σ lin + φ(q) z) for one tile (or a decoding step).

    scores (…, Nq, Nw) and window (bool, the same shape): the window's scores and which count; values (…, Nw,
    Dv + 1) with a ones column; linear (…, Nq, Nl) the linear part's kernel values (masked), lin_values (…, Nl,
    Dv + 1); phi_q (…, Nq, F); state (…, F, Dv + 1) = Σ φ(k) [v, 1]ᵀ over everything older. A row that sees
    no key at all (all padding) gives zeros."""
    s = scores.masked_fill(~window, -math.inf)
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # (a window of padding only: e = 0)
    e = torch.exp(s - top)
    num = f * torch.matmul(e, values) + torch.matmul(linear, lin_values) + torch.matmul(phi_q, state)
    den = num[..., -1:]
    return num[..., :-1] / torch.where(den > 0, den, torch.ones_like(den))  # (no key: 0 / 1, and no NaN gradient)


@register
class WindowLinearAttention(MapInputs, AttentionVariant):
    """(LoLCATs' own code: the window's exponentials are taken relative to their row maximum, so the largest
    score of the window weighs f_h against the linear part's kernel values, which lie in (0, 2]; f_h starts
    at σ(−2.197) = 0.1.) A pretrained softmax model keeps its local attention exactly — most of the mass at
    these lengths — and only what has left the window is approximated, by features trained to imitate the
    softmax (attention transfer, `bench lm --linearize`). The window here counts as this project's windows
    do, |t − s| <= w: the query and the w positions before it (LoLCATs' window_size 64 counts the query
    among its 64).

    Computed in blocks of c queries: block b sees the w + c keys of positions [bc − w, bc + c) for its window
    (a c x (w + c) score tile, the band masked in it) and, linearly, the first c of them below the band plus a
    running F x (Dv + 1) state of everything older, carried from block to block (in groups of blocks, as
    linear.py's chunks). O(N (w + c) D + N F Dv) time, no N x N tensor. Decoding keeps the last w keys and
    values and the state of the rest: constant memory whatever N (kind "window+recurrent").

    Causal by nature: the linear part is the past that left the window (a decoder's split of its past).
    """

    spec = VariantSpec(
        why_no_score_bias="only its window forms scores, the linear part beyond never does, so a bias would stop at the window",
        name="window_linear",
        kind="kernel",
        repeats_kv="its key feature map is learned per query head (LoLCATs applies it after repeating K), so window and state are per query head",
        summary="LoLCATs' hybrid: exact softmax over the last w keys + learned Hedgehog linear attention over older ones, one normalizer",
        style=("#e7969c", "<"),
        reference="Zhang et al. 2025, 'LoLCATs: On Low-Rank Linearizing of Large Language Models'; Zhang et al. 2024 (Hedgehog)",
        time_complexity="O(N (w + c) D + N F Dv)",
        memory_complexity="O(N (w + c)) (the tiles' scores)",
        supports_non_causal=False,
        why_not_non_causal="its linear part is the past that has left the window: a decoder's split of the keys before each query",
        supports_cross_attention=False,
        subquadratic=True,
        notes="causal only; needs num_heads and head_dim (feature maps and window factor per head); F = 2 feature_dim; "
        "decodes with the last w keys and values plus a constant F x (Dv + 1) state",
        function_options=("window", "feature_dim", "feature_inputs", "rope_theta", "feature_init", "query_scaled"),
        examples=(
            (("window", 3),),
            (("window", 5), ("feature_dim", 3), ("block", 2)),
            (("window", 3), ("feature_inputs", "pre_rope"), ("block", 2)),
            (("window", 3), ("feature_init", "kaiming"), ("query_scaled", False)),
        ),
    )

    def __init__(
        self,
        *,
        window: int = 64,
        feature_dim: int | None = None,
        block: int | None = None,
        feature_inputs: str = "post_rope",
        rope_theta: float = 10000.0,
        feature_init: str = "identity",
        query_scaled: bool = True,
        **base,
    ):
        """
        Args:
            window: w, the positions before each query that it attends to exactly (softmax); older ones are
                attended linearly. LoLCATs: 64.
            feature_dim: F' of the Hedgehog maps on q and k (F = 2F' features a row); None: head_dim.
            block: c, queries per tile (None: min(w, 64), at least 1). A tuning knob: the result does not depend on it.
            feature_inputs: "post_rope" (φ reads q, k as RoPE rotated them: LoLCATs') or "pre_rope" (rotated back by
                their positions first; the window keeps them rotated). linear.py's `MapInputs`.
            rope_theta: the base θ of the rotation pre_rope undoes (variants.hf takes the model's).
            feature_init: "identity" (W = I, b = 0) or "kaiming" (LoLCATs': kaiming-uniform W, no bias).
            query_scaled: φ_q reads q times the scale (True) or q itself (False, LoLCATs').
            scale: factor of q, in the window's scores q·k and into its feature map; None means D ** -0.5.
        """
        super().__init__(**base)
        self._init_map_inputs("hedgehog", feature_inputs, rope_theta, feature_init, query_scaled)
        self._check_int("window", window, 0)
        self._check_int("block", block, 1, allow_none=True)
        self.window, self.block, self.feature_dim = window, block, feature_dim
        self.q_features, self.k_features = learned_feature_maps(
            "window_linear", "hedgehog", self.num_heads, self.head_dim, feature_dim, feature_init
        )
        self.window_factor = nn.Parameter(torch.full((self.num_heads,), WINDOW_FACTOR_INIT))

    def _block(self, n: int) -> int:
        return max(1, min(self.block or min(self.window, BLOCK), n))

    def softmax_equivalent_length(self) -> int | None:
        return self.window + 1  # every key within the window: the factor cancels, exact softmax

    def check_length(self, n: int) -> int:
        return max(n, 2 * (self.window + self._block(n)) + 1)  # some queries must have keys older than a tile

    def _factor(self, dtype) -> Tensor:
        return torch.sigmoid(self.window_factor.to(dtype))[:, None, None]  # (H, 1, 1)

    def _features(self) -> int:
        return 2 * self.q_features.bias.shape[-1]

    # -- the forward -----------------------------------------------------------------------------
    def _attend(self, q, k, v, causal, key_padding_mask):
        if q.dtype in (torch.float16, torch.bfloat16):  # exponentials and sums over N in float32
            return self._attend(q.float(), k.float(), v.float(), causal, key_padding_mask).to(q.dtype)
        n_q, n_k = q.shape[-2], k.shape[-2]
        if n_q < n_k:  # the queries are the last Nq positions: zero queries before them, cut after
            q = F.pad(q, (0, 0, n_k - n_q, 0))
        return self._hybrid(q, k, v, key_padding_mask)[:, :, n_k - n_q :]

    def _hybrid(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """Nq == Nk = N, causal."""
        b, h, n, _ = q.shape
        w = self.window
        c = self._block(n)
        real = (
            torch.ones(b, n, dtype=q.dtype, device=q.device)
            if key_padding_mask is None
            else key_padding_mask.to(q.dtype)
        )
        phi_q = self.q_features(self._map_query(q, 0))  # (B, H, N, F)
        phi_k = self.k_features(self._pre_rope(k, 0))
        q, _ = pad_to_multiple(q, c)
        phi_q, _ = pad_to_multiple(phi_q, c)
        n_pad = q.shape[-2]
        # keys, values and their validity with w positions of nothing in front (key j of tile b sits at bc + j − w)
        front = (w, n_pad - n)
        keys, values = F.pad(k, (0, 0, *front)), F.pad(_ones_column(v), (0, 0, *front))
        phi_k = F.pad(phi_k, (0, 0, *front))
        valid = F.pad(real, front)[:, None, :]  # (B, 1, w + N')
        window_mask, linear_mask = _band_masks(c, w, q.device)
        f = self._factor(q.dtype)
        scale = float(self._scale(q))
        state = q.new_zeros(
            b, h, self._features(), v.shape[-1] + 1
        )  # Σ φ(k) [v, 1]ᵀ over positions older than the group's
        out = q.new_empty(b, h, n_pad, v.shape[-1])
        size = max(c, GROUP_POSITIONS // c * c)
        for sl in spans(n_pad, size):
            tiles = (sl.stop - sl.start) // c
            span = slice(sl.start, sl.stop + w)  # the keys the group's tiles read, padded positions
            k_t = keys[:, :, span].unfold(2, w + c, c).transpose(-1, -2)  # (B, H, tiles, w + c, D)
            v_t = values[:, :, span].unfold(2, w + c, c).transpose(-1, -2)
            ok = valid[:, :, span].unfold(2, w + c, c)[:, :, :, None, :] > 0  # (B, 1, tiles, 1, w + c)
            q_t = q[:, :, sl].unflatten(2, (tiles, c))  # (B, H, tiles, c, D)
            pq_t = phi_q[:, :, sl].unflatten(2, (tiles, c))
            # the linear part inside the tile: its first c keys (positions [bc − w, bc − w + c)), below the band
            pk_t = (phi_k[:, :, sl] * valid[:, :, sl, None]).unflatten(2, (tiles, c))  # (B, H, tiles, c, F)
            lin_v = v_t[..., :c, :]
            scores = torch.matmul(q_t, k_t.transpose(-1, -2)) * scale  # (B, H, tiles, c, w + c)
            linear = torch.matmul(pq_t, pk_t.transpose(-1, -2)) * linear_mask[:, :c]  # (B, H, tiles, c, c)
            # what every tile's queries read of the linear part older than its tile: the state, plus the earlier tiles'
            writes = torch.matmul(pk_t.transpose(-1, -2), lin_v)  # (B, H, tiles, F, Dv + 1)
            earlier = torch.ones(tiles, tiles, dtype=q.dtype, device=q.device).tril_(-1)
            before = torch.matmul(earlier, writes.flatten(3)).view_as(writes) + state[:, :, None]
            out[:, :, sl] = _combine(f[:, None], scores, window_mask & ok, v_t, linear, lin_v, pq_t, before).flatten(
                2, 3
            )
            state = before[:, :, -1] + writes[:, :, -1]
        return out[:, :, :n]

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """The definition with every weight stored (O(N²)): the window's exponentials and the linear kernel
        values of all pairs, masked, summed into one normalizer."""
        k, v = self._grouped_kv(q, k, v)  # grouped K/V: repeated to the query heads, as the forward repeats them
        n_q, n_k = q.shape[-2], k.shape[-2]
        i = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        real = (
            torch.ones(q.shape[0], n_k, dtype=torch.bool, device=q.device)
            if key_padding_mask is None
            else key_padding_mask
        )
        window = (j <= i) & (i - j <= self.window) & real[:, None, None, :]
        older = (i - j > self.window) & real[:, None, None, :]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self._scale(q)
        phi_q = self.q_features(self._map_query(q, n_k - n_q))
        linear = torch.matmul(phi_q, self.k_features(self._pre_rope(k, 0)).transpose(-1, -2)) * older
        return _combine(
            self._factor(q.dtype),
            scores,
            window,
            _ones_column(v),
            linear,
            _ones_column(v),
            q.new_zeros(*q.shape[:-1], 1),
            q.new_zeros(*q.shape[:2], 1, v.shape[-1] + 1),
        )

    def older_shares(self, q: Tensor, k: Tensor, rows: int = 64) -> tuple[Tensor, Tensor]:
        """The share of the last `rows` queries' attention on keys older than the window: this variant's (its
        linear part's mass in the shared normalizer) and exact softmax's over the same q, k, each (B, H, rows).
        The diagnostic that showed post-RoPE maps failing with length: at 8192 the hybrid put ~99% of its mass on
        the old keys where softmax put ~65%, so the exact window carried almost nothing. O(rows · N) memory."""
        k, _ = self._grouped_kv(q, k, k)
        n, r = k.shape[-2], min(rows, q.shape[-2])
        q = q[:, :, -r:]
        i = torch.arange(n - r, n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        window, older = (j <= i) & (i - j <= self.window), i - j > self.window
        scores = torch.matmul(q, k.transpose(-1, -2)) * self._scale(q)
        exact = torch.softmax(scores.masked_fill(j > i, -math.inf), dim=-1)
        e = torch.exp(scores.masked_fill(~window, -math.inf) - scores.masked_fill(~window, -math.inf).amax(-1, True))
        phi_q = self.q_features(self._map_query(q, n - r))
        linear = (torch.matmul(phi_q, self.k_features(self._pre_rope(k, 0)).transpose(-1, -2)) * older).sum(-1)
        mine = linear / (self._factor(q.dtype)[..., 0] * e.sum(-1) + linear)
        return mine, (exact * older).sum(-1)

    # -- decoding: the window's keys and the state of the rest ----------------------------------------
    state_kind = "window+recurrent"
    step_positions = 256  # (a step forms its t x (w + t) scores)

    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        empty = torch.empty(batch, heads, 0, head_dim, dtype=dtype, device=device)
        return {
            "k": empty,
            "v": empty.new_empty(batch, heads, 0, value_dim),
            "S": torch.zeros(batch, heads, self._features(), value_dim + 1, dtype=dtype, device=device),
        }

    def _advanced(self, k, v, state, keep):
        """The state after t new positions: the last w of the kept and new positions, and those that leave the
        window added to S (a padded position adds nothing). Also returns every kept + new key, value and mask."""
        t, w = k.shape[2], self.window
        keys = torch.cat([state.tensors["k"], k], dim=2)
        values = torch.cat([state.tensors["v"], v], dim=2)
        kept = state.tensors["k"].shape[2]
        mask = masks_appended(state, state.tensors.get("mask"), kept, keep, t)  # (B, kept + t) or None
        leave = max(0, keys.shape[2] - w)  # positions older than the window of the next query (at n + t)
        phi = self.k_features(self._pre_rope(keys[:, :, :leave], state.length - kept))
        if mask is not None:
            phi = phi * mask[:, None, :leave, None].to(phi.dtype)
        s = state.tensors["S"] + torch.matmul(phi.transpose(-1, -2), _ones_column(values[:, :, :leave]))
        extra = {} if mask is None else {"mask": mask[:, leave:]}
        return state.advanced(t, k=keys[:, :, leave:], v=values[:, :, leave:], S=s, **extra), keys, values, mask

    def _prefill(self, q, k, v, state, keep):
        return self._advanced(k, v, state, keep)[0]

    def _step(self, q, k, v, state, keep):
        """The t new positions at L .. L + t − 1 against the kept window, each other and the state: O((w + t) t D
        + t F Dv) whatever L."""
        n, t, w = state.length, q.shape[2], self.window
        after, keys, values, mask = self._advanced(k, v, state, keep)
        pos = torch.arange(n - state.tensors["k"].shape[2], n + t, device=q.device)
        i = torch.arange(n, n + t, device=q.device)[:, None]
        real = (
            torch.ones(1, 1, 1, pos.numel(), dtype=torch.bool, device=q.device)
            if mask is None
            else mask[:, None, None, :]
        )
        window = (pos <= i) & (i - pos <= w) & real
        older = ((i - pos > w) & real).to(q.dtype)
        ve = _ones_column(values)
        phi_q = self.q_features(self._map_query(q, n))
        phi_k = self.k_features(self._pre_rope(keys, n - state.tensors["k"].shape[2]))
        linear = torch.matmul(phi_q, phi_k.transpose(-1, -2)) * older
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self._scale(q)
        return _combine(self._factor(q.dtype), scores, window, ve, linear, ve, phi_q, state.tensors["S"]), after

    def step_read_bytes(self, state):
        return state.nbytes()

    # -- what the harness reads ------------------------------------------------------------------
    def flops(self, n_q, n_k, d, dv, causal):
        w = min(self.window, n_k)
        f = self._features()
        c = self._block(n_k)
        # the window's scores and weighted values (w + 1 a query), the tile's linear part (c), the state read and write
        return (
            2.0 * n_q * (w + 1) * (d + dv)
            + 2.0 * n_q * c * (f + dv)
            + 4.0 * n_q * f * (dv + 1)
            + 2.0 * (n_q + n_k) * d * f
        )

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        w, c = self.window, self._block(n_k)
        per_query = (
            (w + c) * 3 + c * 2 + self._features() * 2 + dv * 3
        )  # scores, exponentials, masks, features, outputs
        positions = n_k if backward else min(n_k, GROUP_POSITIONS)
        return int(
            batch * heads * positions * per_query * 4 * (3 if backward else 1)
            + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward)
        )

    def extra_repr(self) -> str:
        return f"window={self.window}, feature_dim={self._features() // 2}"
