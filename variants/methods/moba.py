"""MoBA, Mixture of Block Attention: Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs".

Keys are cut into blocks of B positions (`block`). Each query scores the complete blocks before its
own by q · mean(k in block) — a router with no parameters, as a mixture of experts routes tokens —
and attends, softmax-exactly, to the keys of its top-k blocks (`top_k`) plus its own block up to
itself:

    gate_j(q_t) = q_t · mean_{s in block j} k_s          for blocks j before t's block
    out_t = softmax over {keys of the top_k blocks} ∪ {keys of t's block at positions <= t}

A query with fewer than top_k earlier blocks takes all of them (MoBA's own code does the same), so
at N <= (top_k + 1) B MoBA is exact causal attention. The selection is not differentiated (the
paper's neither): gradients reach q, k, v through the attention. Cost: the gating O(N · N/B · D),
the attention O(N (top_k + 1) B D); nothing of size N x N (nor N x N/B: gating runs in tiles of
queries and keeps only the top_k indices).

Computed per tile of queries: for each key block, the queries that chose it are gathered (a padded
batch over heads, found by one sort of the tile's choices), attended to that block, and their partial
softmax (output and log-sum-exp) is merged with the other blocks' and the own block's —
FlashAttention's merge, as MoBA's implementation does with varlen kernels. On the CPU the blocks go
through PyTorch's flash kernel; the backward (`_FusedMoBA`) calls that kernel's backward once a block
with each query's final output and log-sum-exp, which is exactly that block's share of the gradient,
so no partial softmax is kept. With key padding, or off the CPU, the softmaxes are written out and
each tile's graph is rebuilt in the backward (torch.utils.checkpoint).
Causal by nature (the paper's is a decoder's). Decoding keeps the KV cache and the running sums of
complete blocks, so a step's gating reads N/B means, not N keys.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .._base import AttentionVariant, VariantSpec, register
from .._utils import dense_attention
from .full import full_attention_pairs

TILE_QUERIES = 2048  # queries whose gating scores (x N/B) and partial outputs are held at once


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


def select_blocks(q: Tensor, means: Tensor, has_key: Tensor, start: int, block: int, top_k: int) -> tuple[Tensor, Tensor]:
    """Each query's chosen blocks: (indices (B, H, T, k'), valid (B, H, T, k')), k' = min(top_k, nb);
    queries at positions start .. start + T - 1 choose among the complete blocks before their own."""
    nb = means.shape[2]
    pos = torch.arange(start, start + q.shape[2], device=q.device)
    scores = torch.matmul(q.detach(), means.detach().transpose(-1, -2))  # (B, H, T, nb)
    earlier = torch.arange(nb, device=q.device)[None, :] < (pos // block)[:, None]  # (T, nb)
    scores = scores.masked_fill_(~(earlier & has_key[:, :, None, :]), -math.inf)
    top, idx = scores.topk(min(top_k, nb), dim=-1)
    return idx, torch.isfinite(top)


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
    return q.device.type == "cpu" and not (torch.is_grad_enabled() and q.requires_grad) and not torch.compiler.is_compiling()


def attend_block(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float,
                 square_causal: bool = False) -> tuple[Tensor, Tensor]:
    """(softmax(q kᵀ · scale) v, logsumexp(q kᵀ · scale)) over keys k; `allowed` a bool mask broadcastable to the
    scores, or `square_causal` for Nq == Nk causal; without a gradient on the CPU, by the fused flash kernel."""
    if allowed is None and _fused(q) and q.shape[-1] == v.shape[-1]:  # (the kernel takes one head dim)
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
    tile's (query, slot) pairs by block (so a block costs what its choosers do, not the tile's T)."""

    def __init__(self, idx: Tensor, valid: Tensor, blocks: int):
        bh, t, slots = idx.shape
        self.slots = slots
        ids = torch.where(valid, idx, blocks).reshape(bh, t * slots)  # invalid picks sort last
        self.ids, self.pair = ids.sort(dim=1, stable=True)  # block ids ascending; the (query, slot) pair of each
        wanted = torch.arange(blocks + 1, device=idx.device).expand(bh, -1).contiguous()
        self.starts = torch.searchsorted(self.ids, wanted)  # (BH, blocks + 1): where each block's run begins
        self.heads = torch.arange(bh, device=idx.device)[:, None]

    def of(self, j: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """(order (BH, most) query indices, real (BH, most): False on the padding of shorter rows, slot (BH, most):
        which of its choices it was) of block j; None when no query chose it."""
        begin, count = self.starts[:, j], self.starts[:, j + 1] - self.starts[:, j]
        most = int(count.max())
        if most == 0:
            return None
        at = torch.arange(most, device=count.device)[None, :]
        real = at < count[:, None]
        pair = self.pair[self.heads, (begin[:, None] + at).clamp_max(self.pair.shape[1] - 1)]
        return pair // self.slots, real, pair % self.slots


def moba_tile(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, means: Tensor, has_key: Tensor,
              start: int, block: int, top_k: int, scale: float, with_lse: bool = False):
    """Outputs (B, H, T, Dv) of T queries at positions start .. start + T - 1 over keys k, v (B, H, Nk, ·)
    (and, `with_lse`, each query's log-sum-exp over every key it attends to, (B, H, T))."""
    b, h, t, d = q.shape
    dv = v.shape[-1]
    idx, valid = select_blocks(q, means, has_key, start, block, top_k)
    slots = idx.shape[-1]
    # the own block: queries of each block against its keys up to themselves
    own_out, own_lse = q.new_empty(b, h, t, dv), q.new_empty(b, h, t)
    for first in range(start // block, (start + t - 1) // block + 1):
        lo, hi = max(first * block, start), min((first + 1) * block, start + t)  # positions of these queries
        ks, vs = k[:, :, first * block : hi], v[:, :, first * block : hi]
        if keep is None and lo == first * block:  # a square causal block
            o, lse = attend_block(q[:, :, lo - start : hi - start], ks, vs, None, scale, square_causal=True)
        else:
            allowed = torch.arange(first * block, hi, device=q.device)[None, :] <= torch.arange(lo, hi, device=q.device)[:, None]
            if keep is not None:
                allowed = allowed & keep[:, :, None, first * block : hi].bool()
            o, lse = attend_block(q[:, :, lo - start : hi - start], ks, vs, allowed, scale)
        own_out[:, :, lo - start : hi - start], own_lse[:, :, lo - start : hi - start] = o, lse
    if not valid.any():
        return (own_out, own_lse) if with_lse else own_out
    # the chosen blocks: for each key block, the queries (of every head) that chose it, gathered
    qf, idxf, validf = q.reshape(b * h, t, d), idx.reshape(b * h, t, slots), valid.reshape(b * h, t, slots)
    kf, vf = k.reshape(b * h, -1, d), v.reshape(b * h, -1, dv)
    keepf = None if keep is None else keep.expand(b, h, -1).reshape(b * h, -1)
    trash = t * slots  # the slot padded entries write to (cut below)
    chosen_out = q.new_zeros(b * h, trash + 1, dv)  # (query, slot) -> that block's softmax-weighted values
    chosen_lse = q.new_full((b * h, trash + 1), -math.inf)  # and its log-sum-exp
    heads = torch.arange(b * h, device=q.device)[:, None]
    found = Choosers(idxf, validf, means.shape[2])
    for j in range(int(idx[valid].max()) + 1):
        chosen = found.of(j)
        if chosen is None:
            continue
        order, real, slot = chosen
        qg = qf[heads, order]  # (BH, most, D)
        allowed = None if keepf is None else keepf[:, None, j * block : (j + 1) * block].bool()
        o, lse = attend_block(qg, kf[:, j * block : (j + 1) * block], vf[:, j * block : (j + 1) * block], allowed, scale)
        at = torch.where(real, order * slots + slot, trash)
        chosen_out[heads, at] = o  # in place (autograd records each write); padded rows all land in the trash slot
        chosen_lse[heads, at] = lse
    chosen_out = chosen_out[:, :trash].view(b, h, t, slots, dv)
    lse = torch.cat([own_lse[..., None], chosen_lse[:, :trash].view(b, h, t, slots)], dim=3)  # (B, H, T, 1 + slots)
    top = lse.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)
    total = w.sum(-1, keepdim=True)
    w = w / total.clamp_min(torch.finfo(w.dtype).tiny)  # a query with no real key: all 0
    # FlashAttention's merge of the partial softmaxes: own block + each chosen block, by their weights
    out = torch.matmul(w[..., None, 1:], chosen_out)[..., 0, :].addcmul_(own_out, w[..., :1])
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
            out[:, :, lo:hi], lse[:, :, lo:hi] = moba_tile(q[:, :, lo:hi], k[:, :, : start + hi], v[:, :, : start + hi], None,
                                                         means, has_key, start + lo, block, top_k, scale, with_lse=True)
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
        for lo in range(0, n_q, size):
            hi = min(lo + size, n_q)
            t = hi - lo
            for first in range(start + lo, start + hi, block):  # own blocks (square: tiles start on a block)
                a, z = first - start, min(first + block, start + hi) - start
                keys = slice(first, first + z - a)
                gq, gk, gv = flash_backward(grad_out[:, :, a:z], q[:, :, a:z], k[:, :, keys], v[:, :, keys], out[:, :, a:z],
                                            lse[:, :, a:z], 0.0, True, scale=scale)
                dq[:, :, a:z] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
            idx, valid = select_blocks(q[:, :, lo:hi], means, has_key, start + lo, block, top_k)
            if not valid.any():
                continue
            idxf, validf = idx.reshape(b * h, t, -1), valid.reshape(b * h, t, -1)
            heads = torch.arange(b * h, device=q.device)[:, None]
            found = Choosers(idxf, validf, means.shape[2])
            flat = lambda x, width: x[:, :, lo:hi].reshape(b * h, t, width)
            qf, of, gf = flat(q, d), flat(out, dv_dim), flat(grad_out, dv_dim)
            lf = lse[:, :, lo:hi].reshape(b * h, t)
            dqf = q.new_zeros(b * h, t, d)
            kf, vf = k.reshape(b * h, -1, d), v.reshape(b * h, -1, dv_dim)
            dkf, dvf = dk.view(b * h, -1, d), dv.view(b * h, -1, dv_dim)
            for j in range(int(idx[valid].max()) + 1):
                chosen = found.of(j)
                if chosen is None:
                    continue
                order, real, _ = chosen
                g = gf[heads, order] * real[..., None]  # padding rows carry no gradient
                keys = slice(j * block, (j + 1) * block)
                gq, gk, gv = flash_backward(g[None], qf[heads, order][None], kf[None, :, keys], vf[None, :, keys],
                                            of[heads, order][None], lf[heads, order][None], 0.0, False, scale=scale)
                dqf.index_put_((heads.expand_as(order), order), gq[0], accumulate=True)
                dkf[:, keys] += gk[0]
                dvf[:, keys] += gv[0]
            dq[:, :, lo:hi] += dqf.view(b, h, t, d)
        return dq, dk, dv, None, None, None, None, None, None


@register
class MoBA(AttentionVariant):
    spec = VariantSpec(
        name="moba",
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
        not_deployable=(("export", "how many queries choose each block is data-dependent (a varlen gather): torch.export "
                                   "cannot guard on it"),
                        ("onnx", "ONNX export goes through torch.export, which cannot trace the data-dependent gather")),
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

    def check_length(self, n: int) -> int:
        return max(n, (self.top_k + 2) * self.block)  # some queries must leave blocks out

    def selected_blocks(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """bool (B, H, Nq, nb): the earlier blocks each query (the last Nq of Nk positions) attends to."""
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :].to(k.dtype)
        means, has_key = block_means(k, keep, self.block)
        idx, valid = select_blocks(q, means, has_key, k.shape[2] - q.shape[2], self.block, self.top_k)
        chosen = torch.zeros(*q.shape[:3], means.shape[2], dtype=torch.bool, device=q.device)
        return chosen.scatter_(-1, idx, valid)  # an invalid pick writes False wherever it points

    def _attend(self, q, k, v, causal, key_padding_mask):
        if q.dtype in (torch.float16, torch.bfloat16):  # the partial softmaxes are merged by their log-sum-exp: in float32
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
            return (q[:, :, lo:hi], k[:, :, : start + hi], v[:, :, : start + hi], None if keep is None else keep[..., : start + hi],
                    means, has_key, start + lo, self.block, self.top_k, scale)

        if (grad and keep is None and start % self.block == 0 and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
                and not torch.compiler.is_compiling()):
            return _FusedMoBA.apply(q, k, v, means, has_key, self.block, self.top_k, scale, whole_blocks(TILE_QUERIES))
        if not grad:  # each tile's outputs written in place: no second N x Dv buffer
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
            for lo in range(0, n_q, size):
                out[:, :, lo : lo + size] = moba_tile(*tile(lo, min(lo + size, n_q)))
            return out
        outs = [checkpoint(moba_tile, *tile(lo, min(lo + size, n_q)), use_reentrant=False) for lo in range(0, n_q, size)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """Dense softmax attention restricted to the selected blocks and the own block up to each query."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        chosen = self.selected_blocks(q, k, key_padding_mask)  # (B, H, Nq, nb)
        key_block = torch.arange(n_k, device=q.device) // self.block
        pos = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        allowed = chosen[..., key_block] | ((key_block[None, :] == pos // self.block) & (torch.arange(n_k, device=q.device)[None, :] <= pos))
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, :]
        return dense_attention(q, k, v, allowed, self._scale(q))

    # -- decoding: the KV cache and the running sums of complete blocks -----------------------------
    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        state = super()._empty_state(batch, heads, head_dim, value_dim, dtype, device)
        return {**state, "block_sums": torch.empty(batch, heads, 0, head_dim, dtype=dtype, device=device)}

    def _step(self, q, k, v, state):
        keys, values = torch.cat([state.tensors["k"], k], dim=2), torch.cat([state.tensors["v"], v], dim=2)
        sums = state.tensors["block_sums"]
        complete = keys.shape[2] // self.block
        if complete > sums.shape[2]:  # blocks completed by these positions: their sums, once
            new = keys[:, :, sums.shape[2] * self.block : complete * self.block].unflatten(2, (-1, self.block)).sum(3)
            sums = torch.cat([sums, new], dim=2)
        means = sums / self.block
        has_key = torch.ones(1, 1, means.shape[2], dtype=torch.bool, device=q.device)
        if means.shape[2] == 0:  # nothing to choose from yet: every query reads its own block
            means = q.new_zeros(*q.shape[:2], 1, q.shape[-1])
            has_key = torch.zeros(1, 1, 1, dtype=torch.bool, device=q.device)
        out = self._tiles(q, keys, values, None, means, has_key)
        return out, state.advanced(q.shape[2], k=keys, v=values, block_sums=sums)

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
        return int(held * (6 if backward else 3) + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward))

    def extra_repr(self) -> str:
        return f"block={self.block}, top_k={self.top_k}"
