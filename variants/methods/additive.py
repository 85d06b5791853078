"""Additive ("concat") attention: Bahdanau et al. 2015, "Neural Machine Translation by Jointly Learning to Align and Translate".

The score is a one-hidden-layer network of query and key, per head h:

    score(i, j) = v_h · tanh(q_i W_q,h + k_j W_k,h),   out = softmax(score) V

with W_q,h, W_k,h: (D, A) and v_h: (A,), A = `attn_dim`. Unlike a dot product the tanh does not
factor, so every (i, j) pair costs O(A): time O(Nq·Nk·A) by nature. Its memory need not be: the
naive form holds Nq x Nk x A numbers (N = 4096, H = 8, A = 64: 32 GiB). Here the pairs are taken in
tiles (`_TiledAdditive`): each tile's scores are made and folded into a running softmax (as
FlashAttention folds its tiles: row max, row sum, weighted values), then dropped; the backward
recomputes each tile from the saved log-sum-exp of every row. Extra memory O(N·A + one tile).

Causal: key tiles wholly after a query tile's last position are skipped (half the work).
`scale` multiplies the scores (None: 1 — Bahdanau's score has none; v learns its size).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, dense_mask, register
from .._decoding import appended
from .._utils import masked_softmax, spans

TILE_ELEMENTS = 2**20  # (batch x heads) x Tq x Tk x A numbers of one tile: 4 MiB in float32
KEY_TILE = 128  # keys per tile


def _query_tile(bh: int, key_tile: int, a: int) -> int:
    """Queries per tile so that a tile holds about TILE_ELEMENTS numbers."""
    return max(1, TILE_ELEMENTS // (bh * key_tile * a))


def _tile_scores(qa: Tensor, ka: Tensor, w: Tensor, scale: float) -> Tensor:
    """scale · v · tanh(qa_i + ka_j) for a tile: qa (B, H, Tq, A), ka (B, H, Tk, A), w (H, A) -> (B, H, Tq, Tk)
    (and tanh's values (B, H, Tq, Tk, A), which the backward needs)."""
    t = (qa[:, :, :, None, :] + ka[:, :, None, :, :]).tanh_()  # (B, H, Tq, Tk, A): the tile (inside no autograd graph)
    return torch.matmul(t, w[None, :, None, :, None])[..., 0] * scale, t


def _tile_allowed(i: slice, j: slice, offset: int, causal: bool, keep: Tensor | None, device) -> Tensor | None:
    """Bool (B|1, 1, Tq, Tk): query i (at position offset + i) may attend key j."""
    allowed = None
    if causal:
        qi = torch.arange(i.start, i.stop, device=device)[:, None] + offset
        allowed = (torch.arange(j.start, j.stop, device=device)[None, :] <= qi)[None, None]
    if keep is not None:
        pad = keep[:, None, None, j]
        allowed = pad if allowed is None else allowed & pad
    return allowed


def _visible(i: slice, j: slice, offset: int, causal: bool) -> bool:
    """Whether any query of tile i sees any key of tile j (causal: the tile's first key <= its last query)."""
    return not causal or j.start <= offset + i.stop - 1


class _TiledAdditive(torch.autograd.Function):
    """out = softmax(scale · v·tanh(qa_i + ka_j)) V tile by tile; saves only each row's log-sum-exp."""

    @staticmethod
    def forward(ctx, qa, ka, w, v, keep, causal, scale):
        b, h, n_q, a = qa.shape
        n_k = ka.shape[-2]
        offset = n_k - n_q if causal else 0
        tk = min(KEY_TILE, n_k)
        tq = _query_tile(b * h, tk, a)
        out = torch.zeros(b, h, n_q, v.shape[-1], dtype=v.dtype, device=v.device)
        lse = torch.empty(b, h, n_q, dtype=qa.dtype, device=qa.device)
        for i in spans(n_q, tq):
            row_max = torch.full((b, h, i.stop - i.start, 1), -math.inf, dtype=qa.dtype, device=qa.device)
            row_sum = torch.zeros_like(row_max)
            acc = out[:, :, i]
            for j in spans(n_k, tk):
                if not _visible(i, j, offset, causal):
                    break
                s, _ = _tile_scores(qa[:, :, i], ka[:, :, j], w, scale)
                allowed = _tile_allowed(i, j, offset, causal, keep, qa.device)
                if allowed is not None:
                    s = s.masked_fill(~allowed, -math.inf)
                new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
                safe = torch.where(
                    torch.isfinite(new_max), new_max, torch.zeros_like(new_max)
                )  # rows seeing nothing yet
                p = torch.exp(s - safe)
                correction = torch.exp(row_max - safe)
                row_sum = row_sum * correction + p.sum(-1, keepdim=True)
                acc = acc * correction + torch.matmul(p, v[:, :, j])
                row_max = new_max
            dead = row_sum == 0  # rows that see no key: output 0
            out[:, :, i] = acc / torch.where(dead, torch.ones_like(row_sum), row_sum)
            lse[:, :, i] = torch.where(dead, torch.full_like(row_max, math.inf), row_max + torch.log(row_sum))[..., 0]
        ctx.save_for_backward(qa, ka, w, v, keep, out, lse)
        ctx.causal, ctx.scale, ctx.tiles = causal, scale, (tq, tk)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qa, ka, w, v, keep, out, lse = ctx.saved_tensors
        causal, scale, (tq, tk) = ctx.causal, ctx.scale, ctx.tiles
        n_q, n_k = qa.shape[-2], ka.shape[-2]
        offset = n_k - n_q if causal else 0
        dqa, dka, dv = torch.zeros_like(qa), torch.zeros_like(ka), torch.zeros_like(v)
        dw = torch.zeros_like(w)
        delta = (grad_out * out).sum(-1, keepdim=True)  # (B, H, Nq, 1): Σ_j P_ij dP_ij of each row
        for i in spans(n_q, tq):
            do = grad_out[:, :, i]
            for j in spans(n_k, tk):
                if not _visible(i, j, offset, causal):
                    break
                s, t = _tile_scores(qa[:, :, i], ka[:, :, j], w, scale)
                allowed = _tile_allowed(i, j, offset, causal, keep, qa.device)
                p = torch.exp(s - lse[:, :, i, None])  # the forward's weights, recomputed
                if allowed is not None:
                    p = p.masked_fill(~allowed, 0.0)
                dv[:, :, j] += torch.matmul(p.transpose(-1, -2), do)
                ds = p * (torch.matmul(do, v[:, :, j].transpose(-1, -2)) - delta[:, :, i]) * scale  # (B, H, Tq, Tk)
                dw += torch.einsum("bhij,bhija->ha", ds, t)
                # through tanh, in the tile's own memory: dpre = ds · w · (1 − t²), (B, H, Tq, Tk, A)
                dpre = t.mul_(t).neg_().add_(1).mul_(w[None, :, None, None, :]).mul_(ds[..., None])
                dqa[:, :, i] += dpre.sum(3)
                dka[:, :, j] += dpre.sum(2)
        return dqa, dka, dw, dv, None, None, None


@register
class AdditiveAttention(AttentionVariant):
    spec = VariantSpec(
        why_no_score_bias="its scores are not dot products but a bias could be added to them; not implemented here",
        name="additive",
        kind="exact",
        repeats_kv="W_k, the projection of the keys, is learned per query head",
        summary="Bahdanau's concat score v·tanh(q W_q + k W_k) per head, tiled with an online softmax (no N x N x A)",
        style=("#17a589", "*"),
        reference="Bahdanau et al. 2015, 'Neural Machine Translation by Jointly Learning to Align and Translate'",
        time_complexity="O(Nq Nk A)",
        memory_complexity="O(N A) + one tile",
        notes="needs num_heads and head_dim; scale multiplies the scores (None: 1)",
        scale_is_query_factor=False,
        function_options=("attn_dim",),
        examples=((("attn_dim", 5),),),
    )

    def __init__(self, *, attn_dim: int | None = None, **base):
        """
        Args:
            attn_dim: A, the hidden size of the score network (None: head_dim).
            scale: factor of the scores v·tanh(...) before the softmax; None means 1 (Bahdanau's has none).
        """
        super().__init__(**base)
        self._require_head_shape("W_q, W_k and v are parameters per head")
        self._check_int("attn_dim", attn_dim, 1, allow_none=True)
        h, d = self.num_heads, self.head_dim
        a = d if attn_dim is None else attn_dim
        self.attn_dim = a
        self.w_q = nn.Parameter(torch.empty(h, d, a))
        self.w_k = nn.Parameter(torch.empty(h, d, a))
        self.v = nn.Parameter(torch.empty(h, a))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p, fan_in in ((self.w_q, self.head_dim), (self.w_k, self.head_dim), (self.v, self.attn_dim)):
            nn.init.uniform_(p, -(fan_in**-0.5), fan_in**-0.5)  # nn.Linear's default bound

    def default_scale(self, d: int) -> float:
        return 1.0  # Bahdanau's score has no scale: v learns its size

    def hidden(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """(q W_q (B, H, Nq, A), k W_k (B, H, Nk, A)): the score network's two inputs."""
        return torch.matmul(q, self.w_q.to(q.dtype)), torch.matmul(k, self.w_k.to(k.dtype))

    def _attend(self, q, k, v, causal, key_padding_mask):
        if q.dtype in (torch.float16, torch.bfloat16):  # the running softmax and the tanh sums in float32
            return self._attend(q.float(), k.float(), v.float(), causal, key_padding_mask).to(q.dtype)
        qa, ka = self.hidden(q, k)
        return _TiledAdditive.apply(qa, ka, self.v.to(q.dtype), v, key_padding_mask, causal, self._scale(q))

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """The naive form: every score of the (B, H, Nq, Nk, A) tanh stored, one softmax."""
        k, v = self._grouped_kv(q, k, v)  # grouped K/V: repeated to the query heads, as the forward repeats them
        qa, ka = self.hidden(q, k)
        scores = torch.einsum(
            "bhija,ha->bhij", torch.tanh(qa[:, :, :, None] + ka[:, :, None]), self.v.to(q.dtype)
        ) * self._scale(q)
        allowed = dense_mask(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device)
        return torch.matmul(masked_softmax(scores, allowed), v)

    # -- decoding: a KV cache of the projected keys k W_k (each key projected once, not at every step) ---------
    def cached_key_dim(self, head_dim: int) -> int:
        return self.attn_dim

    def _prefill(self, q, k, v, state, keep):
        return appended(state, torch.matmul(k, self.w_k.to(k.dtype)), v, keep)[3]

    def _step(self, q, k, v, state, keep):
        """The new positions' scores against every cached k W_k: O(N A) a step, each key's projection made once."""
        qa, ka = self.hidden(q, k)
        keys, values, mask, state = appended(state, ka, v, keep)
        if q.dtype in (torch.float16, torch.bfloat16):  # (as the forward: the running softmax in float32)
            qa, keys, values = qa.float(), keys.float(), values.float()
        out = _TiledAdditive.apply(qa, keys, self.v.to(qa.dtype), values, mask, True, self._scale(q))
        return out.to(q.dtype), state

    def flops(self, n_q, n_k, d, dv, causal):
        pairs = n_q * (n_k - n_q) + n_q * (n_q + 1) / 2 if causal else n_q * n_k
        return 2.0 * (n_q + n_k) * d * self.attn_dim + pairs * (3.0 * self.attn_dim + 2.0 * dv)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        hidden = batch * heads * (n_q + n_k) * self.attn_dim * 4 * (3 if backward else 1)
        return int(
            hidden
            + TILE_ELEMENTS * 4 * (6 if backward else 3)
            + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward)
        )

    def extra_repr(self) -> str:
        return f"attn_dim={self.attn_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}"
