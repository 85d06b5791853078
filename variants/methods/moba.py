"""MoBA, Mixture of Block Attention: Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs".

Keys are cut into blocks of B positions (`block`). Each query scores the complete blocks before its
own by q · mean(k in block) — a router with no parameters, as a mixture of experts routes tokens —
and attends, softmax-exactly, to the keys of its top-k blocks (`top_k`) plus its own block up to
itself:

    gate_j(q_t) = q_t · mean_{s in block j} k_s          for blocks j before t's block
    out_t = softmax over {keys of the top_k blocks} ∪ {keys of t's block at positions <= t}
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .._base import AttentionVariant, VariantSpec, register
from .._decoding import appended
from .._utils import dense_attention, masked_softmax, spans
from .full import CPU_FLASH_MIN_KEYS, full_attention_pairs

TILE_QUERIES = 2048  # queries whose gating scores (x N/B) and partial outputs are held at once
GROUPED_QUERIES = 32  # positions a grouped decoding step gathers blocks for at once ((top_k + 1) B keys a query head)


def block_means(k: Tensor, keep: Tensor | None, block: int) -> tuple[Tensor, Tensor]:
    """(means (B, H, nb, D) of each block's real keys, has_key (B, 1|H, nb) bool); the last block may be partial."""
    n = k.shape[2]
    nb = math.ceil(n / block)
    pad = nb * block - n
    kk = k if keep is None else k * keep[..., None]
    kk = torch.nn.functional.pad(kk, (0, 0, 0, pad)) if pad else kk
    sums = kk.unflatten(2, (nb, block)).sum(3)
    if keep is None:
        counts = torch.full((nb,), float(block), dtype=k.dtype, device=k.device)
        counts[-1] = block - pad
        return sums / counts[:, None], torch.ones(1, 1, nb, dtype=torch.bool, device=k.device)
    kp = torch.nn.functional.pad(keep, (0, pad)) if pad else keep
    counts = kp.unflatten(2, (nb, block)).sum(3)  # (B, 1, nb)
    return sums / counts.clamp_min(1)[..., None], counts > 0


def select_blocks(
    q: Tensor, means: Tensor, has_key: Tensor, start: int, block: int, top_k: int
) -> tuple[Tensor, Tensor]:
    """Each query's chosen blocks: (indices (B, H, T, k'), valid (B, H, T, k')), k' = min(top_k, nb);
    queries at positions start .. start + T - 1 choose among the complete blocks before their own.
    (Grouped: q (B, Hkv, G, T, D) against means (B, Hkv, 1, nb, D) and has_key (·, ·, 1, nb).)

    Equal gates choose the earlier block (a stable sort, not topk, whose choice among ties depends on how
    many blocks there are): the forward, the reference and every decoding step pick the same blocks for a
    query whose gates tie, e.g. an all-zero query (a pad token's zero embedding)."""
    nb = means.shape[-2]
    pos = torch.arange(start, start + q.shape[-2], device=q.device)
    scores = torch.matmul(q.detach(), means.detach().transpose(-1, -2))  # (B, H, T, nb)
    earlier = torch.arange(nb, device=q.device)[None, :] < (pos // block)[:, None]  # (T, nb)
    scores = scores.masked_fill_(~(earlier & has_key[:, :, None, :]), -math.inf)
    top, idx = scores.sort(dim=-1, descending=True, stable=True)
    k = min(top_k, nb)
    return idx[..., :k], torch.isfinite(top[..., :k])


def _partial(s: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(softmax(s) v, logsumexp(s)) over the last dim of scores s, masked entries -inf: 0 and -inf where all are."""
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v) / total.clamp_min(torch.finfo(p.dtype).tiny)
    return out, (m + total.log()).squeeze(-1)


def _fused(q: Tensor) -> bool:
    """Whether the CPU flash kernel, which returns the log-sum-exp beside the output, may run: the forward
    without a gradient (its backward ignores a gradient of the log-sum-exp, which the merge needs)."""
    return (
        q.device.type == "cpu"
        and not (torch.is_grad_enabled() and q.requires_grad)
        and not torch.compiler.is_compiling()
    )


def attend_block(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float, square_causal: bool = False
) -> tuple[Tensor, Tensor]:
    """(softmax(q kᵀ · scale) v, logsumexp(q kᵀ · scale)) over keys k; `allowed` a bool mask broadcastable to the
    scores, or `square_causal` for Nq == Nk causal; without a gradient on the CPU, by the fused flash kernel."""
    if allowed is None and _fused(q) and q.shape[-1] == v.shape[-1] and k.shape[-2] >= CPU_FLASH_MIN_KEYS:
        # (the kernel takes one head dim, and over fewer keys it gives zeros for a NaN row: full.py)
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        shape = q.shape
        q4, k4, v4 = (t if t.dim() == 4 else t[None] for t in (q, k, v))
        out, lse = op(q4, k4, v4, 0.0, square_causal, attn_mask=None, scale=scale)
        return out.view(*shape[:-1], v.shape[-1]), lse.view(shape[:-1])
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if square_causal:
        n = q.shape[-2]
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return _partial(s if allowed is None else s.masked_fill_(~allowed, -math.inf), v)


class Choosers:
    """For a tile's choices (idx, valid: (BH, T, slots)), the queries that chose each block, found by one sort of the
    tile's (query, slot) pairs by block (so a block costs what its choosers do, not the tile's T), and the way back:
    block j's results go to rows offset_j .. offset_j + most_j of a buffer (BH, width, ·) (`buffer`), from which
    `read` gathers each query's result of one slot (the last row of the buffer is the pad invalid picks read)."""

    def __init__(self, idx: Tensor, valid: Tensor, blocks: int):
        bh, t, slots = idx.shape
        self.bh, self.t, self.slots = bh, t, slots
        ids = torch.where(valid, idx, blocks).reshape(bh, t * slots)  # invalid picks sort last
        ids, self.pair = ids.sort(dim=1, stable=True)  # block ids ascending; the (query, slot) pair of each
        wanted = torch.arange(blocks + 1, device=idx.device).expand(bh, -1).contiguous()
        self.starts = torch.searchsorted(ids, wanted)  # (BH, blocks + 1): where each block's run begins
        self.counts = self.starts.diff(dim=1)  # (BH, blocks): its choosers in each head
        self.most = self.counts.amax(0).tolist()  # the rows of block j's gathered batch (the most of any head)
        offsets = torch.tensor([0, *self.most], device=idx.device).cumsum(0)  # offsets[blocks]: the pad row
        self.offsets = offsets.tolist()
        self.width = self.offsets[-1] + 1
        self.heads = torch.arange(bh, device=idx.device)[:, None]
        # each pair's row in the buffer: its block's offset + its rank among that block's choosers
        rank = torch.arange(t * slots, device=idx.device)[None, :] - self.starts.gather(1, ids)
        at = torch.where(ids == blocks, offsets[-1], offsets[ids] + rank)
        by_pair = torch.empty_like(at).scatter_(1, self.pair, at)  # sorted order back to (query, slot) order
        self.rows = (self.heads * self.width + by_pair).view(bh, t, slots)

    def of(self, j: int) -> tuple[Tensor, Tensor, slice] | None:
        """(order (BH, most) query indices, real (BH, most): False on the padding of shorter rows, rows: where its
        results go in the buffer) of block j; None when no query chose it."""
        most = self.most[j]
        if most == 0:
            return None
        at = torch.arange(most, device=self.starts.device)[None, :]
        real = at < self.counts[:, j, None]
        pair = self.pair[self.heads, (self.starts[:, j, None] + at).clamp_max(self.pair.shape[1] - 1)]
        return pair // self.slots, real, slice(self.offsets[j], self.offsets[j] + most)

    def buffer(self, like: Tensor, width: int | None, pad: float) -> Tensor:
        """The blocks' results: (BH, rows, width), or (BH, rows) for width None; the pad row set to `pad`."""
        buf = like.new_empty(self.bh, self.width, *(() if width is None else (width,)))
        buf[:, -1] = pad
        return buf

    def read(self, buffer: Tensor, slot: int) -> Tensor:
        """Each query's result of its choice `slot`: (BH, T, ·) from the buffer."""
        flat = buffer.reshape(self.bh * self.width, -1)
        return flat.index_select(0, self.rows[..., slot].flatten()).view(self.bh, self.t, *buffer.shape[2:])


def as_block_batch(x: Tensor, at: int, t: int, block: int) -> Tensor:
    """Positions at .. at + t (whole blocks) of x (B, H, N[, ·]) as a batch of blocks: (B · t / block, H, block[, ·])."""
    return x[:, :, at : at + t].unflatten(2, (-1, block)).transpose(1, 2).flatten(0, 1)


def from_block_batch(x: Tensor, batch: int) -> Tensor:
    """as_block_batch's inverse: (B · blocks, H, block[, ·]) -> (B, H, blocks · block[, ·])."""
    return x.unflatten(0, (batch, -1)).transpose(1, 2).flatten(2, 3)


def own_blocks(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, start: int, block: int, scale: float
) -> tuple[Tensor, Tensor]:
    """(outputs (B, H, T, Dv), log-sum-exp (B, H, T)) of T queries at positions start .. start + T - 1 over the
    keys of their own block up to themselves. Whole blocks without padding: one square causal call for all."""
    b, h, t, d = q.shape
    dv = v.shape[-1]
    if keep is None and start % block == 0 and t % block == 0:
        o, lse = attend_block(
            as_block_batch(q, 0, t, block),
            as_block_batch(k, start, t, block),
            as_block_batch(v, start, t, block),
            None,
            scale,
            square_causal=True,
        )
        return from_block_batch(o, b), from_block_batch(lse, b)
    own_out, own_lse = q.new_empty(b, h, t, dv), q.new_empty(b, h, t)
    for first in range(start // block, (start + t - 1) // block + 1):
        lo, hi = max(first * block, start), min((first + 1) * block, start + t)  # positions of these queries
        ks, vs = k[:, :, first * block : hi], v[:, :, first * block : hi]
        if keep is None and lo == first * block:  # a square causal block
            o, lse = attend_block(q[:, :, lo - start : hi - start], ks, vs, None, scale, square_causal=True)
        else:
            allowed = (
                torch.arange(first * block, hi, device=q.device)[None, :]
                <= torch.arange(lo, hi, device=q.device)[:, None]
            )
            if keep is not None:
                allowed = allowed & keep[:, :, None, first * block : hi].bool()
            o, lse = attend_block(q[:, :, lo - start : hi - start], ks, vs, allowed, scale)
        own_out[:, :, lo - start : hi - start], own_lse[:, :, lo - start : hi - start] = o, lse
    return own_out, own_lse


def moba_tile(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None,
    means: Tensor,
    has_key: Tensor,
    start: int,
    block: int,
    top_k: int,
    scale: float,
    with_lse: bool = False,
):
    """Outputs (B, H, T, Dv) of T queries at positions start .. start + T - 1 over keys k, v (B, H, Nk, ·)
    (and, `with_lse`, each query's log-sum-exp over every key it attends to, (B, H, T))."""
    b, h, t, d = q.shape
    dv = v.shape[-1]
    idx, valid = select_blocks(q, means, has_key, start, block, top_k)
    slots = idx.shape[-1]
    own_out, own_lse = own_blocks(q, k, v, keep, start, block, scale)
    if not valid.any():
        return (own_out, own_lse) if with_lse else own_out
    # the chosen blocks: for each key block, the queries (of every head) that chose it, gathered by row of the
    # flat (B·H·T, D) queries; each block's partial softmax kept in the chooser's buffer rows
    q_rows, kf, vf = q.reshape(b * h * t, d), k.reshape(b * h, -1, d), v.reshape(b * h, -1, dv)
    keepf = None if keep is None else keep.expand(b, h, -1).reshape(b * h, -1)
    first_row = (torch.arange(b * h, device=q.device) * t)[:, None]
    found = Choosers(idx.reshape(b * h, t, slots), valid.reshape(b * h, t, slots), means.shape[2])
    outs, lses = found.buffer(q, dv, 0.0), found.buffer(q, None, -math.inf)  # a pick of nothing: 0 with lse -inf
    for j in range(means.shape[2]):
        chosen = found.of(j)
        if chosen is None:
            continue
        order, _, rows = chosen
        qg = q_rows.index_select(0, (first_row + order).flatten()).view(b * h, -1, d)  # (BH, most, D)
        allowed = None if keepf is None else keepf[:, None, j * block : (j + 1) * block].bool()
        outs[:, rows], lses[:, rows] = attend_block(
            qg, kf[:, j * block : (j + 1) * block], vf[:, j * block : (j + 1) * block], allowed, scale
        )
    del q_rows  # (a copy where the tile's q is a strided slice)
    chosen_lse = torch.stack([found.read(lses, s) for s in range(slots)], dim=-1).view(b, h, t, slots)
    lse = torch.cat([own_lse[..., None], chosen_lse], dim=3)  # (B, H, T, 1 + slots)
    top = lse.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)
    total = w.sum(-1, keepdim=True)
    w = w / total.clamp_min(torch.finfo(w.dtype).tiny)  # a query with no real key: all 0
    # FlashAttention's merge of the partial softmaxes: own block + each chosen block, by their weights
    out = own_out.mul_(w[..., :1])  # (in place: one T x Dv buffer less at the peak)
    for s in range(slots):
        out.addcmul_(found.read(outs, s).view(b, h, t, dv), w[..., 1 + s : 2 + s])
    return (out, (top + total.log()).squeeze(-1)) if with_lse else out


class _FusedMoBA(torch.autograd.Function):
    """MoBA on the CPU without key padding: the forward by the flash kernel (no graph kept), the backward written
    out with the same kernel's backward, one call a block: given the final output O and log-sum-exp L of each
    query, a block's share of the gradient is FlashAttention's own (P = exp(S − L), dS = P ⊙ (dP − rowsum(dO ⊙ O))),
    so the partial softmaxes need no graph. Keeps q, k, v, the output and L (N a head) for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, means, has_key, block, top_k, scale, size):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (a model's projections hand over strided views)
        start = k.shape[2] - q.shape[2]
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1])
        for lo in range(0, q.shape[2], size):
            hi = min(lo + size, q.shape[2])
            out[:, :, lo:hi], lse[:, :, lo:hi] = moba_tile(
                q[:, :, lo:hi],
                k[:, :, : start + hi],
                v[:, :, : start + hi],
                None,
                means,
                has_key,
                start + lo,
                block,
                top_k,
                scale,
                with_lse=True,
            )
        ctx.save_for_backward(q, k, v, means, has_key, out, lse)
        ctx.settings = (block, top_k, scale, size)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, means, has_key, out, lse = ctx.saved_tensors
        block, top_k, scale, size = ctx.settings
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        b, h, n_q, d = q.shape
        dv_dim = v.shape[-1]
        start = k.shape[2] - n_q
        dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))  # contiguous
        grad_out = grad_out.contiguous()
        flat = lambda x, lo, hi: x[:, :, lo:hi].reshape(b * h * (hi - lo), -1)  # noqa: E731 — a tile's rows (B·H·T, ·)
        kf, vf = k.view(b * h, -1, d), v.view(b * h, -1, dv_dim)
        dkf, dvf = dk.view(b * h, -1, d), dv.view(b * h, -1, dv_dim)
        for lo in range(0, n_q, size):
            hi = min(lo + size, n_q)
            t = hi - lo
            # own blocks (square: tiles start on a block); whole ones as one batch, as in own_blocks
            if t % block == 0:
                gq, gk, gv = flash_backward(
                    *(as_block_batch(x, lo, t, block) for x in (grad_out, q)),
                    *(as_block_batch(x, start + lo, t, block) for x in (k, v)),
                    *(as_block_batch(x, lo, t, block) for x in (out, lse)),
                    0.0,
                    True,
                    scale=scale,
                )
                dq[:, :, lo:hi] += from_block_batch(gq, b)
                dk[:, :, start + lo : start + hi] += from_block_batch(gk, b)
                dv[:, :, start + lo : start + hi] += from_block_batch(gv, b)
            else:
                for first in range(start + lo, start + hi, block):
                    a, z = first - start, min(first + block, start + hi) - start
                    keys = slice(first, first + z - a)
                    gq, gk, gv = flash_backward(
                        grad_out[:, :, a:z],
                        q[:, :, a:z],
                        k[:, :, keys],
                        v[:, :, keys],
                        out[:, :, a:z],
                        lse[:, :, a:z],
                        0.0,
                        True,
                        scale=scale,
                    )
                    dq[:, :, a:z] += gq
                    dk[:, :, keys] += gk
                    dv[:, :, keys] += gv
            idx, valid = select_blocks(q[:, :, lo:hi], means, has_key, start + lo, block, top_k)
            if not valid.any():
                continue
            slots = idx.shape[-1]
            found = Choosers(idx.reshape(b * h, t, slots), valid.reshape(b * h, t, slots), means.shape[2])
            first_row = (torch.arange(b * h, device=q.device) * t)[:, None]
            q_rows, o_rows, g_rows = flat(q, lo, hi), flat(out, lo, hi), flat(grad_out, lo, hi)
            l_rows = lse[:, :, lo:hi].reshape(-1, 1)
            grads = found.buffer(q, d, 0.0)
            for j in range(means.shape[2]):
                chosen = found.of(j)
                if chosen is None:
                    continue
                order, real, at = chosen
                rows = (first_row + order).flatten()
                gather = lambda x, width: x.index_select(0, rows).view(1, b * h, -1, width)  # noqa: E731
                g = gather(g_rows, dv_dim) * real[None, ..., None]  # padding rows carry no gradient
                keys = slice(j * block, (j + 1) * block)
                gq, gk, gv = flash_backward(
                    g,
                    gather(q_rows, d),
                    kf[None, :, keys],
                    vf[None, :, keys],
                    gather(o_rows, dv_dim),
                    gather(l_rows, 1)[..., 0],
                    0.0,
                    False,
                    scale=scale,
                )
                grads[:, at] = gq[0]
                dkf[:, keys] += gk[0]
                dvf[:, keys] += gv[0]
            dq_tile = dq[:, :, lo:hi]
            for s in range(slots):
                dq_tile += found.read(grads, s).view(b, h, t, d)
        return dq, dk, dv, None, None, None, None, None, None


@register
class MoBA(AttentionVariant):
    """A query with fewer than top_k earlier blocks takes all of them (MoBA's own code does the same), so
    at N <= (top_k + 1) B MoBA is exact causal attention. The selection is not differentiated (the
    paper's neither): gradients reach q, k, v through the attention. Cost: the gating O(N · N/B · D),
    the attention O(N (top_k + 1) B D); nothing of size N x N (nor N x N/B: gating runs in tiles of
    queries and keeps only the top_k indices).

    Computed per tile of queries: the own blocks in one batch of square causal blocks; for each key
    block, the queries that chose it are gathered (a padded batch over heads, found by one sort of the
    tile's choices), attended to that block, and their partial softmax (output and log-sum-exp) kept in
    a buffer the merge reads back by one gather per slot — FlashAttention's merge of the other blocks'
    and the own block's, as MoBA's implementation does with varlen kernels. On the CPU the blocks go
    through PyTorch's flash kernel; the backward (`_FusedMoBA`) calls that kernel's backward once a block
    with each query's final output and log-sum-exp, which is exactly that block's share of the gradient,
    so no partial softmax is kept. With key padding, or off the CPU, the softmaxes are written out and
    each tile's graph is rebuilt in the backward (torch.utils.checkpoint).
    Causal by nature (the paper's is a decoder's). Decoding keeps the KV cache and the running sums of
    complete blocks, so a step's gating reads N/B means, not N keys.
    """

    spec = VariantSpec(
        why_no_score_bias="a bias would go inside the blocks each query chooses; not implemented here",
        name="moba",
        kind="local and sparse",
        family="block-sparse selection",
        repeats_kv="its block selection and its gathered blocks run per query head",
        state_repeats_kv="",  # the cache and the block sums need K only: kept per K/V head, each query head gathers its blocks
        summary="MoBA: each query attends exactly to its own block and its top_k earlier key blocks, chosen by q · mean(k)",
        style=("#17becf", "*"),
        reference="Lu et al. 2025, 'MoBA: Mixture of Block Attention for Long-Context LLMs'",
        time_complexity="O(N (N/B) D + N (top_k + 1) B D)",
        memory_complexity="O(N D) + one tile of queries",
        supports_non_causal=False,
        why_not_non_causal="each query chooses among the blocks before its own (the paper's decoder attention)",
        subquadratic=True,
        notes="causal only; at N <= (top_k + 1) block it is exact causal attention; the gating term N^2/B dominates at long N",
        function_options=("block", "top_k"),
        not_deployable=(
            (
                "export",
                "how many queries choose each block is data-dependent (a varlen gather): torch.export "
                "cannot guard on it",
            ),
            ("onnx", "ONNX export goes through torch.export, which cannot trace the data-dependent gather"),
        ),
        examples=((("block", 4), ("top_k", 1)), (("block", 3), ("top_k", 2))),
    )

    def __init__(self, *, block: int = 256, top_k: int = 3, **base):
        """
        Args:
            block: B, keys per block (the unit a query chooses).
            top_k: earlier blocks each query attends to besides its own (all of them where fewer exist).
            scale: factor of the scores before the softmax; None means D ** -0.5.
        """
        super().__init__(**base)
        self._check_int("block", block, 1)
        self._check_int("top_k", top_k, 1)
        self.block, self.top_k = block, top_k

    @classmethod
    def training_options(cls, window: int, head_dim: int) -> dict:
        """Blocks of w / 2 keys and its 2 best: about the w keys a query of the window sees (its default 256-key
        blocks would make it exact attention at a small run's lengths: exact at N <= (top_k + 1) block)."""
        return {"block": max(1, window // 2), "top_k": 2}

    def check_length(self, n: int) -> int:
        return max(n, (self.top_k + 2) * self.block)  # some queries must leave blocks out

    def softmax_equivalent_length(self) -> int | None:
        return (self.top_k + 1) * self.block  # no query has more than top_k earlier blocks: it takes them all

    def selected_blocks(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """bool (B, H, Nq, nb): the earlier blocks each query (the last Nq of Nk positions) attends to."""
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :].to(k.dtype)
        means, has_key = block_means(k, keep, self.block)
        idx, valid = select_blocks(q, means, has_key, k.shape[2] - q.shape[2], self.block, self.top_k)
        chosen = torch.zeros(*q.shape[:3], means.shape[2], dtype=torch.bool, device=q.device)
        return chosen.scatter_(-1, idx, valid)  # an invalid pick writes False wherever it points

    def _attend(self, q, k, v, causal, key_padding_mask):
        if q.dtype in (
            torch.float16,
            torch.bfloat16,
        ):  # the partial softmaxes are merged by their log-sum-exp: in float32
            return self._attend(q.float(), k.float(), v.float(), causal, key_padding_mask).to(q.dtype)
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :].to(k.dtype)
        with torch.no_grad():
            means, has_key = block_means(k, keep, self.block)
        return self._tiles(q, k, v, keep, means, has_key)

    def _tiles(self, q, k, v, keep, means, has_key):
        n_q, n_k = q.shape[2], k.shape[2]
        start = n_k - n_q
        scale = float(self._scale(q))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        # with a gradient each tile's graph is rebuilt in the backward (its partial softmaxes: T (top_k + 1) B a head)
        whole_blocks = lambda queries: max(self.block, queries // self.block * self.block)  # noqa: E731 — a tile's queries
        size = whole_blocks(TILE_QUERIES // 2 if grad else TILE_QUERIES)

        def tile(lo: int, hi: int) -> tuple:
            return (
                q[:, :, lo:hi],
                k[:, :, : start + hi],
                v[:, :, : start + hi],
                None if keep is None else keep[..., : start + hi],
                means,
                has_key,
                start + lo,
                self.block,
                self.top_k,
                scale,
            )

        if (
            grad
            and keep is None
            and start % self.block == 0
            and q.device.type == "cpu"
            and q.shape[-1] == v.shape[-1]
            and not torch.compiler.is_compiling()
        ):
            return _FusedMoBA.apply(q, k, v, means, has_key, self.block, self.top_k, scale, whole_blocks(TILE_QUERIES))
        if not grad:  # each tile's outputs written in place: no second N x Dv buffer
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
            for lo in range(0, n_q, size):
                out[:, :, lo : lo + size] = moba_tile(*tile(lo, min(lo + size, n_q)))
            return out
        outs = [
            checkpoint(moba_tile, *tile(lo, min(lo + size, n_q)), use_reentrant=False) for lo in range(0, n_q, size)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """Dense softmax attention restricted to the selected blocks and the own block up to each query."""
        k, v = self._grouped_kv(q, k, v)  # grouped K/V: repeated to the query heads, as the forward repeats them
        n_q, n_k = q.shape[-2], k.shape[-2]
        chosen = self.selected_blocks(q, k, key_padding_mask)  # (B, H, Nq, nb)
        key_block = torch.arange(n_k, device=q.device) // self.block
        pos = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        allowed = chosen[..., key_block] | (
            (key_block[None, :] == pos // self.block) & (torch.arange(n_k, device=q.device)[None, :] <= pos)
        )
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, :]
        return dense_attention(q, k, v, allowed, self._scale(q))

    # -- decoding: the KV cache and the running sums of complete blocks -----------------------------
    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        state = super()._empty_state(batch, heads, head_dim, value_dim, dtype, device)
        return {**state, "block_sums": torch.empty(batch, heads, 0, head_dim, dtype=dtype, device=device)}

    def _prefill(self, q, k, v, state, keep):
        keys, _, mask, state = appended(state, k, v, keep)  # the KV cache
        return state.advanced(0, **self._block_sums(keys, mask, state))

    def _block_sums(self, keys: Tensor, mask: Tensor | None, state) -> dict[str, Tensor]:
        """The sums of every complete block of the cache (of its real keys, and their counts once a position is
        padding): the kept ones, and those the new positions completed (once)."""
        sums, counts = state.tensors["block_sums"], state.tensors.get("block_counts")
        complete, have = keys.shape[2] // self.block, sums.shape[2]
        if mask is not None and counts is None:
            counts = torch.full((state.batch, 1, have), float(self.block), dtype=sums.dtype, device=sums.device)
        if complete > have:
            span = slice(have * self.block, complete * self.block)
            new = keys[:, :, span]
            if mask is not None:
                real = mask[:, None, span].to(new.dtype)  # (B, 1, positions)
                new = new * real[..., None]
                counts = torch.cat([counts, real.unflatten(2, (-1, self.block)).sum(3)], dim=2)
            sums = torch.cat([sums, new.unflatten(2, (-1, self.block)).sum(3)], dim=2)
        return {"block_sums": sums} if counts is None else {"block_sums": sums, "block_counts": counts}

    def _step(self, q, k, v, state, keep):
        keys, values, mask, state = appended(state, k, v, keep)  # (a bounded cache: written in place)
        blocks = self._block_sums(keys, mask, state)
        sums, counts = blocks["block_sums"], blocks.get("block_counts")
        if counts is None:
            means, has_key = sums / self.block, torch.ones(1, 1, sums.shape[2], dtype=torch.bool, device=q.device)
        else:  # the mean of a block's real keys, as block_means; a block of padding only is never chosen
            means, has_key = sums / counts.clamp_min(1)[..., None], counts > 0
        if means.shape[2] == 0:  # nothing to choose from yet: every query reads its own block
            means = q.new_zeros(*keys.shape[:2], 1, q.shape[-1])
            has_key = torch.zeros(1, 1, 1, dtype=torch.bool, device=q.device)
        keep = None if mask is None else mask[:, None, :].to(k.dtype)
        if keys.shape[1] == q.shape[1]:
            return self._tiles(q, keys, values, keep, means, has_key), state.advanced(0, **blocks)
        start = keys.shape[2] - q.shape[2]  # grouped: GROUPED_QUERIES queries at a time
        out = torch.cat(
            [
                self._grouped_step(
                    q[:, :, sl],
                    keys[:, :, : start + sl.stop],
                    values[:, :, : start + sl.stop],
                    None if keep is None else keep[..., : start + sl.stop],
                    means,
                    has_key,
                    start + sl.start,
                )
                for sl in spans(q.shape[2], GROUPED_QUERIES)
            ],
            dim=2,
        )
        return out, state.advanced(0, **blocks)

    def _grouped_step(
        self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, means: Tensor, has_key: Tensor, start: int
    ) -> Tensor:
        """`moba_tile` for decoding with grouped-query inputs: T queries (B, H, T, D) at positions start .. start + T - 1
        over a cache k, v of Hkv heads (B, Hkv, Nk, ·), its block means (B, Hkv, nb, D). Each query head gathers its
        own top_k blocks and its own block from its K/V head's cache: nothing of the cache is repeated."""
        block, top_k, scale = self.block, self.top_k, float(self._scale(q))
        b, h, t, d = q.shape
        kv_heads, n_k = k.shape[1], k.shape[2]
        q = q.unflatten(1, (kv_heads, h // kv_heads))  # (B, Hkv, G, T, D)
        idx, valid = select_blocks(q, means[:, :, None], has_key[:, :, None], start, block, top_k)  # (B, Hkv, G, T, k')
        pos = torch.arange(start, start + t, device=q.device)
        inner = torch.arange(block, device=q.device)
        # the key positions each query reads: its chosen blocks, then its own block (B, Hkv, G, T, (k' + 1) B)
        own = (pos // block * block)[:, None] + inner  # (T, B)
        chosen = (idx * block)[..., None] + inner
        at = torch.cat([chosen.flatten(-2), own.expand(*idx.shape[:-1], block)], dim=-1)
        allowed = torch.cat(
            [
                valid[..., None].expand(*valid.shape, block).flatten(-2),
                (own <= pos[:, None]).expand(*idx.shape[:-1], block),
            ],
            dim=-1,
        )
        at = at.clamp_max(n_k - 1)  # (the own block's positions past the last key: not allowed)
        if keep is not None:  # (B, 1, Nk) of the cache's positions
            allowed = allowed & torch.gather(keep[:, :, None, None, :].bool().expand(*at.shape[:-1], n_k), -1, at)
        rows = (
            torch.arange(b, device=q.device)[:, None, None, None, None],
            torch.arange(kv_heads, device=q.device)[None, :, None, None, None],
        )
        keys, values = (
            k[rows[0], rows[1], at],
            v[rows[0], rows[1], at],
        )  # (B, Hkv, G, T, (k' + 1) B, ·): the blocks read
        scores = torch.matmul(q[..., None, :], keys.transpose(-1, -2)).squeeze(-2) * scale
        out = torch.matmul(masked_softmax(scores, allowed)[..., None, :], values).squeeze(-2)
        return out.flatten(1, 2)

    def step_read_bytes(self, state):
        # the block sums (the gating) and the keys and values of the top_k chosen blocks and the own one
        t = state.tensors
        per_position = (t["k"].shape[-1] + t["v"].shape[-1]) * t["k"].element_size() * state.batch * t["k"].shape[1]
        blocks = min(self.top_k + 1, math.ceil(max(state.length, 1) / self.block))
        return t["block_sums"].numel() * t["block_sums"].element_size() + blocks * self.block * per_position

    # -- what the harness reads ------------------------------------------------------------------
    def flops(self, n_q, n_k, d, dv, causal):
        blocks = math.ceil(n_k / self.block)
        gating = 2.0 * n_q * blocks * d
        attended = min(full_attention_pairs(n_q, n_k, True), n_q * (self.top_k * self.block + (self.block + 1) / 2))
        return gating + 2.0 * attended * (d + dv)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        tile = min(n_q, TILE_QUERIES)
        blocks = math.ceil(n_k / self.block)
        held = batch * heads * tile * (blocks + (self.top_k + 1) * (dv + 2) + 2 * self.block) * 4
        return int(
            held * (6 if backward else 3)
            + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward)
        )

    def extra_repr(self) -> str:
        return f"block={self.block}, top_k={self.top_k}"
