"""DeepSeek Sparse Attention: DeepSeek-AI 2025, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language
Models" (the attention of DeepSeek-V3.2 and GLM-5).

A lightning indexer scores every earlier key cheaply; each query then attends exactly, by softmax, to the
top_k keys it scored highest:

    I_ts = Σ_j w_tj ReLU(q^I_tj · k^I_s)         (j over a few indexer heads of index_dim dims)
    S_t  = the top_k keys s <= t by I_ts       (every key s <= t while t < top_k)
    o_t  = Σ_{s in S_t} softmax_s(scale q_t·k_s) v_s

Here per K/V head g (DeepSeek's MLA runs as one shared K/V head, g = 1): q^I_tj = q̄_t W_q,gj, k^I_s = k_s W_k,g,
w_tj = q̄_t·u_gj, with q̄_t the mean of the group's queries (the paper reads the hidden state). The indexer
starts as ReLU(q̄_t·k_s) (W = I, one head, w = 1). Its selection is discrete: the output's loss gives it no
gradient: DeepSeek trains it by a KL loss to the dense attention (`transfer_loss`, which attention transfer
minimises here). O(N² d_I) indexer, O(N top_k D) attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .._base import AttentionVariant, VariantSpec, register
from .._checks import causal_mask
from .._utils import masked_softmax, spans
from .full import sdpa

BLOCK = 64  # queries a step: their indexer scores (block x N) and gathered keys (block x top_k x D) at once
# A block whose keys number at most DENSE_SPAN x top_k runs the fused kernel over every key, the unchosen masked:
# on a CPU a gather moves each chosen key at the cost of tens of multiply-adds (docs/variants.md has the timing)
DENSE_SPAN = 16


class LightningIndexer(nn.Module):
    """I_ts = Σ_j w_tj ReLU(q^I_tj · k^I_s) per K/V head: q^I = q̄ W_q (heads x index_dim), k^I = k W_k, w = q̄ u.
    Starts as ReLU(q̄·k) with index_dim = D and one head (later heads start at zero weight)."""

    def __init__(self, kv_heads: int, head_dim: int, heads: int, dim: int):
        super().__init__()
        eye = torch.eye(head_dim, dim)
        self.w_q = nn.Parameter(eye.expand(kv_heads, heads, head_dim, dim).clone())
        self.w_k = nn.Parameter(eye.expand(kv_heads, head_dim, dim).clone())
        self.u = nn.Parameter(torch.zeros(kv_heads, heads, head_dim))
        self.w0 = nn.Parameter(torch.zeros(kv_heads, heads).index_fill_(1, torch.tensor([0]), 1.0))

    def keys(self, k: Tensor) -> Tensor:
        """k^I (B, Hkv, N, index_dim)."""
        return torch.matmul(k, self.w_k.to(k.dtype)[None])

    def scores(self, q_mean: Tensor, k_index: Tensor) -> Tensor:
        """I (B, Hkv, Nq, Nk) of the queries' group means (B, Hkv, Nq, D) against the keys' k^I."""
        q_index = torch.einsum("bgnd,gjde->bgjne", q_mean, self.w_q.to(q_mean.dtype))  # (B, Hkv, heads, Nq, dI)
        w = torch.einsum("bgnd,gjd->bgjn", q_mean, self.u.to(q_mean.dtype)) + self.w0.to(q_mean.dtype)[None, :, :, None]
        relu = F.relu(torch.matmul(q_index, k_index[:, :, None].transpose(-1, -2)))  # (B, Hkv, heads, Nq, Nk)
        if relu.shape[2] == 1:  # one indexer head: no sum over heads to form
            return w[:, :, 0, :, None] * relu[:, :, 0]
        return (w[..., None] * relu).sum(2)


def _indices(chosen: Tensor, slots: int) -> tuple[Tensor, Tensor]:
    """(indices (..., slots), valid): each row's chosen keys in key order, then invalid slots (index 0)."""
    place = torch.where(chosen, chosen.cumsum(-1) - 1, slots)  # each chosen key's slot; the others a spare one
    index = torch.zeros(*chosen.shape[:-1], slots + 1, dtype=torch.long, device=chosen.device)
    index.scatter_(-1, place, torch.arange(chosen.shape[-1], device=chosen.device).expand_as(place))
    return index[..., :slots], torch.arange(slots, device=chosen.device) < chosen.sum(-1, keepdim=True)


@register
class DeepSeekSparseAttention(AttentionVariant):
    """Sparse where it counts: the indexer's scores are N x N but narrow (index_dim, few heads, no values, in
    DeepSeek's kernels FP8), while the attention proper reads top_k keys a query. On a CPU the gather of each
    query's own keys costs what its contiguous reads save, so the speed-up of the paper's H800 kernels is not
    expected here (measured by `bench run`). Causal; decoding keeps the KV cache (the indexer keys recomputed
    from it: k^I is a linear map of k)."""

    spec = VariantSpec(
        why_no_score_bias="a bias would go on the top-k scores, after the indexer chose them; not implemented here",
        name="dsa",
        kind="local and sparse",
        summary="DeepSeek Sparse Attention: a lightning indexer picks each query's top_k keys, exact softmax over them",
        style=("#de9ed6", "*"),
        reference="DeepSeek-AI 2025, 'DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models'",
        time_complexity="O(N^2 d_I + N top_k D)",
        memory_complexity="O(N D) + a block x N of scores (the indexer's; the keys' up to N = 16 top_k) or block x top_k x D of keys",
        supports_non_causal=False,
        why_not_non_causal="each query selects among the keys before it (DeepSeek-V3.2's decoder)",
        supports_cross_attention=False,
        notes="causal only; needs num_heads and head_dim (an indexer per K/V head); with top_k >= N exact softmax",
        function_options=("top_k", "index_heads", "index_dim"),
        examples=((("top_k", 4), ("block", 3)), (("top_k", 2), ("index_heads", 2), ("index_dim", 3), ("block", 5))),
    )

    def __init__(
        self, *, top_k: int = 2048, index_heads: int = 1, index_dim: int | None = None, block: int = BLOCK, **base
    ):
        """
        Args:
            top_k: keys each query attends to (DeepSeek-V3.2: 2048); queries with fewer earlier keys see them all.
            index_heads: the indexer's heads j (DeepSeek-V3.2: 64; 1 here: its start, ReLU(mean q · k), needs one).
            index_dim: d_I, each indexer head's dims (DeepSeek-V3.2: 128); None: head_dim.
            block: queries computed at once. A tuning knob: the result does not depend on it.
            scale: factor of q in the attention's scores; None means D ** -0.5.
        """
        super().__init__(**base)
        self._check_int("top_k", top_k, 1)
        self._check_int("index_heads", index_heads, 1)
        self._check_int("index_dim", index_dim, 1, allow_none=True)
        self._check_int("block", block, 1)
        self._require_head_shape("its lightning indexer is learned per K/V head")
        self.top_k, self.block = top_k, block
        kv_heads = self.num_kv_heads or self.num_heads
        self.indexer = LightningIndexer(kv_heads, self.head_dim, index_heads, index_dim or self.head_dim)

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        return self._kv_parameters_reason(kv_heads, "its indexer is")

    @classmethod
    def training_options(cls, window: int, head_dim: int) -> dict:
        """top_k = the window: each query attends to as many keys as a window's (its default 2048 would make it
        exact attention at a small run's lengths)."""
        return {"top_k": window}

    def softmax_equivalent_length(self) -> int | None:
        return self.top_k  # every query sees at most top_k keys: all of them

    def check_length(self, n: int) -> int:
        return max(n, self.top_k + self.block + 1)  # queries with more keys than top_k, in two blocks

    def selected(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(indices (B, Hkv, Nq, min(top_k, Nk)), valid (bool, the same shape)): each query's chosen keys in key
        order (`_chosen`), then invalid slots where it has fewer."""
        return _indices(self._chosen(q, k, self.indexer.keys(k), key_padding_mask), min(self.top_k, k.shape[-2]))

    def _chosen(self, q, k, k_index, key_padding_mask):
        """(B, Hkv, Nq, Nk) bool: each query's top_k keys by the indexer, among the real keys up to it (queries
        the last Nq positions). Equal scores (the ReLU's zeros) go to the earlier key; a NaN score ranks first
        (it reaches its row). One top_k's k-th score a row, not a sort: above it, then ties in key order."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        q_mean = q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1])).mean(2)  # (B, Hkv, Nq, D)
        scores = self.indexer.scores(q_mean, k_index)
        allowed = causal_mask(n_q, n_k, q.device)
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, :n_k]
        allowed = allowed.expand(scores.shape)
        if n_k <= self.top_k:
            return allowed
        s = scores.nan_to_num(nan=torch.inf).masked_fill(~allowed, -torch.inf)
        kth = s.topk(self.top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
        above, tie = s > kth, s == kth
        room = self.top_k - above.sum(-1, keepdim=True)  # the places the k-th score's ties fill, earliest first
        return (above | (tie & (tie.cumsum(-1) <= room))) & allowed

    def _attend(self, q, k, v, causal, key_padding_mask):
        n_q, n_k = q.shape[-2], k.shape[-2]
        k_index = self.indexer.keys(k)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        out = []
        for rows in spans(n_q, self.block):
            end = n_k - n_q + rows.stop  # the keys some query of the block may see
            args = (q[:, :, rows], k[:, :, :end], v[:, :, :end], k_index[:, :, :end], key_padding_mask)
            # (with a gradient each block is recomputed in the backward: its gathered keys are not all kept)
            out.append(checkpoint(self._block, *args, use_reentrant=False) if grad else self._block(*args))
        return torch.cat(out, dim=2)

    def _block(self, q, k, v, k_index, key_padding_mask):
        """Queries q (the last of them at k's last position) over their selected keys of k, v."""
        chosen = self._chosen(q, k, k_index, key_padding_mask)
        groups, slots = q.shape[1] // k.shape[1], min(self.top_k, k.shape[-2])
        if k.shape[-2] <= DENSE_SPAN * slots:
            # few keys beside the chosen: the fused kernel over every key, the unchosen masked (the same softmax);
            # a row with no key to see is opened to every key and zeroed after, as `full` does
            chosen = chosen.repeat_interleave(groups, 1)  # (B, H, rows, Nk)
            seen = chosen.any(-1, keepdim=True)
            return torch.where(seen, sdpa(q, k, v, attn_mask=chosen | ~seen, scale=self._scale(q)), 0.0)
        qg = q.unflatten(1, (k.shape[1], groups))  # (B, Hkv, G, rows, D)
        seen = chosen.any(-1)[:, :, None, :, None]  # a query with no real key gives zeros (NaN inputs reach theirs)
        index, valid = _indices(chosen, slots)
        take = lambda x: torch.gather(  # noqa: E731  (B, Hkv, rows, top_k, ·): each query's own keys
            x[:, :, None].expand(-1, -1, index.shape[2], -1, -1),
            3,
            index[..., None].expand(-1, -1, -1, -1, x.shape[-1]),
        )
        keys, values = take(k), take(v)
        s = torch.einsum("bgmrd,bgrkd->bgmrk", qg, keys) * self._scale(q)
        p = masked_softmax(s, valid[:, :, None])  # an empty row: zeros, no NaN gradient
        return torch.where(seen, torch.einsum("bgmrk,bgrke->bgmre", p, values), 0.0).flatten(1, 2)

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """Softmax over every key with the unselected ones masked (O(N²)): the selection as a dense mask."""
        chosen = self._chosen(q, k, self.indexer.keys(k), key_padding_mask)  # (B, Hkv, Nq, Nk)
        groups = q.shape[1] // k.shape[1]
        k, v, chosen = (x.repeat_interleave(groups, 1) for x in (k, v, chosen))
        s = torch.matmul(q, k.transpose(-1, -2)) * self._scale(q)
        seen = chosen.any(-1, keepdim=True)
        out = torch.matmul(masked_softmax(s, chosen), v)
        return torch.where(seen, out, 0.0)

    # -- training the indexer --------------------------------------------------------------------
    def transfer_loss(self, q: Tensor, k: Tensor, v: Tensor, target: Tensor, causal: bool = True) -> Tensor:
        """DeepSeek-V3.2's dense warm-up of the indexer, what attention transfer minimises here (the output's
        loss gives the discrete selection no gradient): per query, KL(p_t ‖ softmax_s I_ts) over the keys
        s <= t, p_t the softmax attention of the group's query heads summed and L1-normalised, averaged over
        queries and K/V heads. O(N²) per call: a training loss, not a forward. `v` and `target` are unused."""
        groups, n_q, n_k = q.shape[1] // k.shape[1], q.shape[-2], k.shape[-2]
        qg = q.unflatten(1, (k.shape[1], groups))  # (B, Hkv, G, Nq, D)
        allowed = causal_mask(n_q, n_k, q.device)  # bottom-right (Nq, Nk)
        s = torch.einsum("bgmnd,bgsd->bgmns", qg, k) * self._scale(q)
        p = masked_softmax(s, allowed).mean(2).detach()  # (B, Hkv, Nq, Nk): the heads' mass, L1-normalised
        scores = self.indexer.scores(qg.mean(2), self.indexer.keys(k)).masked_fill(~allowed, -torch.inf)
        log_i = torch.log_softmax(scores, dim=-1).masked_fill(~allowed, 0.0)
        return (torch.xlogy(p, p) - p * log_i).sum(-1).mean()

    # -- what the harness reads ------------------------------------------------------------------
    def flops(self, n_q, n_k, d, dv, causal):
        heads, dim = self.indexer.w_q.shape[1], self.indexer.w_q.shape[-1]
        pairs = n_q * (n_k - n_q) + n_q * (n_q + 1) // 2
        # Σ_i min(top_k, Nk − Nq + i + 1): query i sees first + i keys, capped at top_k
        first, cap = n_k - n_q + 1, self.top_k
        below = min(max(cap - first + 1, 0), n_q)  # the queries seeing fewer than top_k keys
        chosen = below * first + below * (below - 1) // 2 + (n_q - below) * cap
        return 2.0 * pairs * heads * dim + 2.0 * (n_q + n_k) * d * dim * heads + 2.0 * chosen * (d + dv)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        """One block at a time, forward and backward (each block is recomputed in the backward, not kept):
        its indexer scores with the selection's masks and counts (at 8 bytes an element) and, per query, every
        key's mask (DENSE_SPAN) or the gathered keys and values."""
        rows = min(self.block, n_q)
        kv_heads = self.num_kv_heads or self.num_heads
        chosen = min(self.top_k, n_k)
        attend = (heads // kv_heads) * n_k * 3 if n_k <= DENSE_SPAN * chosen else chosen * (d + dv)
        per_block = batch * kv_heads * rows * (n_k * (2 + self.indexer.w_q.shape[1]) + attend)
        return int(8 * per_block * (3 if backward else 1)) + super().memory_estimate(
            batch, heads, n_q, n_k, d, dv, element_size, causal, backward
        )

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, block={self.block}"
