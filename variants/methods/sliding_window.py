"""Sliding-window (local) attention with optional global tokens, as in Longformer (Beltagy et al. 2020).

Query i attends to keys j with |i - j| <= w (causal: i - w <= j <= i). The first g positions are
global: they attend to every key, and every query attends to them (causal: still only j <= i).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._base import AttentionVariant, VariantSpec, dense_mask, register
from .._decoding import kv_cache, masks_appended, padded
from .._utils import dense_attention
from .full import sdpa

GROUP_SCORE_BYTES = 8 * 2**20  # scores held at once per group of blocks (a few such buffers live)


def band_pairs(n: int, window: int, n_global: int, causal: bool) -> int:
    """Number of (query, key) pairs the pattern allows (for FLOP counts)."""
    w, g = min(window, n), min(n_global, n)
    if causal:  # keys max(0, i-w)..i for each i
        band = sum(min(i, w) + 1 for i in range(min(n, w + 1))) + max(0, n - w - 1) * (w + 1)
    else:
        band = n * (2 * w + 1) - w * (w + 1)  # clipped at both ends
    # global rows/cols add what the band does not already cover; a close upper bound is enough here
    extra = g * n * (1 if causal else 2)
    return min(band + extra, n * (n + 1) // 2 if causal else n * n)


def longformer_mask(
    n_q: int, n_k: int, window: int, n_global: int, causal: bool, key_padding_mask: Tensor | None, device
) -> Tensor:
    """Dense (B|1, 1, Nq, Nk) bool mask of the pattern, for reference checks at small N only.

    Nq < Nk (causal only): the queries are the last Nq positions, query i at Nk - Nq + i."""
    i = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    allowed = (i - j).abs() <= window
    if n_global:
        allowed = allowed | (i < n_global) | (j < n_global)
    extra = dense_mask(n_q, n_k, causal, key_padding_mask, device)
    return allowed[None, None] if extra is None else allowed[None, None] & extra


def default_block_size(window: int, n: int) -> int:
    """Block size b: half the window, within [32, 128] (few wasted keys, matmuls big enough), and <= N."""
    return max(1, min(max(window // 2, 32), 128, n))


class _Layout:
    """Where the blocks are: sizes and the masks shared by every group."""

    def __init__(self, n: int, window: int, block: int, n_global: int, causal: bool, key_valid: Tensor | None, device):
        self.n, self.w, self.b, self.g, self.causal = n, window, block, n_global, causal
        self.nb = math.ceil(n / block)
        self.r = min(math.ceil(window / block), self.nb - 1)  # neighbour blocks on each side
        # blocks t-r .. t+r (causal: t-r .. t: a causal query sees no later block, so none is gathered)
        self.right = 0 if causal else self.r
        self.span = (self.r + 1 + self.right) * block  # keys gathered per block
        a = torch.arange(block, device=device)[:, None]
        c = torch.arange(self.span, device=device)[None, :]
        rel = (self.r * block + a) - c  # query position - key position, the same in every block
        self.band = (rel >= 0) & (rel <= window) if causal else rel.abs() <= window  # (b, span)
        # which gathered key positions are real: inside [0, N), not padding, not global (counted separately)
        ext = torch.ones(n, dtype=torch.bool, device=device)[None] if key_valid is None else key_valid
        ext = ext.clone()
        ext[:, :n_global] = False
        pad_right = self.nb * block - n + self.r * block
        self.key_ok_ext = torch.nn.functional.pad(ext, (self.r * block, pad_right), value=False)  # (B|1, (nb+2r)·b)
        self.uniform_inside = key_valid is None and n_global == 0
        self._interior_masks: dict[int, tuple[Tensor, Tensor]] = {}
        self._interior_additive: dict[tuple, Tensor] = {}
        self.global_ok = None
        if n_global:
            self.global_ok = (
                torch.ones(1, n_global, dtype=torch.bool, device=device)
                if key_valid is None
                else key_valid[:, :n_global]
            )

    def groups(self, batch: int, heads: int, extra_keys: int):
        """Yield (t0, t1) block ranges whose scores fit GROUP_SCORE_BYTES."""
        per_block = batch * heads * self.b * (self.span + extra_keys) * 4
        step = max(1, GROUP_SCORE_BYTES // max(per_block, 1))
        for t0 in range(0, self.nb, step):
            yield t0, min(self.nb, t0 + step)

    def _interior(self, t0: int, t1: int) -> bool:
        """Without padding or global tokens, every group clear of the sequence ends has the same masks."""
        return self.uniform_inside and t0 >= self.r and t1 + self.right <= self.nb - 1

    def mask(self, t0: int, t1: int) -> tuple[Tensor, Tensor]:
        """For the queries of blocks t0..t1: (allowed (B|1, G, b, span + g), dead (B|1, G, b, 1)).

        `dead` marks rows that may see no key; they are opened to every key in `allowed` so no
        kernel produces NaN, and their outputs are set to zero.
        """
        interior = self._interior(t0, t1)
        if interior and (t1 - t0) in self._interior_masks:
            return self._interior_masks[t1 - t0]
        result = self._mask(t0, t1)
        if interior:
            self._interior_masks[t1 - t0] = result
        return result

    def additive(self, t0: int, t1: int, dtype) -> Tensor:
        """`mask` as scores to add: 0 where allowed, -inf elsewhere, (B|1, G, b, span + g) in `dtype` (what torch's
        CPU flash kernels take when called directly); cached like `mask`."""
        interior = self._interior(t0, t1)
        key = (t1 - t0, dtype)
        if interior and key in self._interior_additive:
            return self._interior_additive[key]
        allowed, _ = self.mask(t0, t1)
        result = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        if interior:
            self._interior_additive[key] = result
        return result

    def _mask(self, t0: int, t1: int) -> tuple[Tensor, Tensor]:
        b, s = self.b, self.span
        key_ok = self.key_ok_ext[:, t0 * b : (t1 + self.r + self.right) * b].unfold(1, s, b)  # (B|1, G, span)
        allowed = self.band[None, None] & key_ok[:, :, None, :]  # (B|1, G, b, span)
        if self.g:
            q_pos = torch.arange(t0 * b, t1 * b, device=allowed.device).view(t1 - t0, b, 1)
            glob = self.global_ok[:, None, None, :]  # (B|1, 1, 1, g)
            if self.causal:
                glob = glob & (torch.arange(self.g, device=allowed.device) <= q_pos)  # (B|1, G, b, g)
            glob = glob.expand(allowed.shape[0], t1 - t0, b, self.g)
            allowed = torch.cat([allowed.expand(glob.shape[0], *allowed.shape[1:]), glob], dim=-1)
        dead = ~allowed.any(-1, keepdim=True)
        return allowed | dead, dead


def _window(x: Tensor, layout: _Layout, t0: int, t1: int) -> Tensor:
    """Positions (t0 - r)·b .. (t1 + right)·b of x (B, H, N, D), zeros outside [0, N): the keys blocks t0..t1
    may reach. Only a group at an end of the sequence is copied (to pad it); the rest is a view."""
    lo, hi = (t0 - layout.r) * layout.b, (t1 + layout.right) * layout.b
    part = x[:, :, max(lo, 0) : min(hi, layout.n)]
    if lo < 0 or hi > layout.n:
        part = torch.nn.functional.pad(part, (0, 0, max(0, -lo), max(0, hi - layout.n)))
    return part


def _gather(x: Tensor, layout: _Layout, t0: int, t1: int, x_global: Tensor | None) -> Tensor:
    """Keys/values each block of t0..t1 may reach: (B, H, G, span + g, D), gathered from x (B, H, N, D)."""
    b, s = layout.b, layout.span
    blocks = _window(x, layout, t0, t1).unfold(2, s, b).transpose(-1, -2)  # (B, H, G, span, D)
    if x_global is None:
        return blocks.contiguous()  # one copy, so the matmuls below run as plain batched GEMMs
    glob = x_global[:, :, None].expand(-1, -1, t1 - t0, -1, -1)  # (B, H, G, g, D)
    return torch.cat([blocks, glob], dim=-2)


def _rows(x: Tensor, layout: _Layout, t0: int, t1: int) -> Tensor:
    """Positions t0·b .. t1·b of x (B, H, N, D) as blocks (B, H, G, b, D): a view, except for a group holding the
    ragged end of the sequence (zero rows appended: a copy of that group only)."""
    b = layout.b
    part = x[:, :, t0 * b : t1 * b]
    if part.shape[2] < (t1 - t0) * b:
        part = torch.nn.functional.pad(part, (0, 0, 0, (t1 - t0) * b - part.shape[2]))
    return part.unflatten(2, (t1 - t0, b))


def _put_rows(dest: Tensor, blocks: Tensor, b: int, s0: int, add: bool) -> None:
    """Write (or add) blocks (B, H, G, b, D), the blocks s0 .. s0 + G of the sequence, into dest (B, H, N, D):
    blocks outside [0, N) are left out, and the rows of a ragged last block past N."""
    n = dest.shape[2]
    nb = -(-n // b)
    a0, a1 = max(s0, 0), min(s0 + blocks.shape[2], nb)
    if a0 >= a1:
        return
    part = blocks[:, :, a0 - s0 : a1 - s0]
    lo, hi = a0 * b, min(a1 * b, n)
    if hi - lo == (a1 - a0) * b:  # whole blocks: in place, no copy
        target = dest[:, :, lo:hi].unflatten(2, (a1 - a0, b))
        target.add_(part) if add else target.copy_(part)
    else:
        rows = part.flatten(2, 3)[:, :, : hi - lo]
        dest[:, :, lo:hi].add_(rows) if add else dest[:, :, lo:hi].copy_(rows)


def _blocks_first(x: Tensor) -> Tensor:
    """(B, H, G, ·, ·) -> (B·G, H, ·, ·): each block a batch entry, the 4-D layout the fused kernels take."""
    return x.transpose(1, 2).flatten(0, 1)


def _blocks_back(x: Tensor, batch: int) -> Tensor:
    """(B·G, H, ·, ·) -> (B, H, G, ·, ·), the inverse of `_blocks_first`."""
    return x.unflatten(0, (batch, -1)).transpose(1, 2)


def _per_block(mask: Tensor, batch: int) -> Tensor:
    """A group's mask (B|1, G, b, ·) in the fused kernels' layout: (B·G, 1, b, ·), one per block, shared by the heads."""
    return mask.expand(batch, *mask.shape[1:]).flatten(0, 1)[:, None]


def _flash_cpu(q: Tensor, v: Tensor) -> bool:
    """Whether torch's CPU flash-attention kernels are called directly: they take a mask and return the
    log-sum-exp of each row, which the backward reuses (their own backward kernel, instead of five matmuls
    and a softmax written here). They need one head dim for q, k and v."""
    return (
        q.device.type == "cpu"
        and q.shape[-1] == v.shape[-1]
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
    )


def _band_attention_fused(
    q: Tensor, k: Tensor, v: Tensor, layout: _Layout, scale: float, lse: Tensor | None = None
) -> Tensor:
    """Each group of blocks through the fused SDPA kernel, the band as its mask; no score is stored.
    With `lse` (a (B, H, nb·b) buffer, CPU): torch's flash kernel called directly writes each row's log-sum-exp there."""
    B, H, N, _ = q.shape
    g = layout.g
    k_glob, v_glob = (k[:, :, :g], v[:, :, :g]) if g else (None, None)
    out = q.new_empty(B, H, N, v.shape[-1])
    for t0, t1 in layout.groups(B, H, g):
        qg = _blocks_first(_rows(q, layout, t0, t1))  # (B·G, H, b, D)
        kg = _blocks_first(_gather(k, layout, t0, t1, k_glob))  # (B·G, H, keys, D)
        vg = _blocks_first(_gather(v, layout, t0, t1, v_glob))
        allowed, dead = (_per_block(m, B) for m in layout.mask(t0, t1))  # (B·G, 1, b, ·)
        if lse is None:
            o = sdpa(qg, kg, vg, attn_mask=allowed, scale=scale)  # (B·G, H, b, Dv)
        else:
            o, row_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qg, kg, vg, 0.0, False, attn_mask=_per_block(layout.additive(t0, t1, q.dtype), B), scale=scale
            )
            lse[:, :, t0 * layout.b : t1 * layout.b] = _blocks_back(row_lse[..., None], B).flatten(2, 3)[..., 0]
        _put_rows(out, _blocks_back(o.masked_fill(dead, 0.0), B), layout.b, t0, add=False)
    return out


def _band_attention_biased(q: Tensor, k: Tensor, v: Tensor, layout: _Layout, scale: float, score_bias) -> Tensor:
    """The band with score_bias(distance) added, written out group by group and differentiated by autograd (a
    learned bias trains; the fused kernels give no gradient of their mask). The distances inside every block's
    band are the same, so the bias is formed once, (H, b, span). Autograd keeps each group's weights for the
    backward: O(N (w + b)) memory a head, still linear in N."""
    B, H, N, _ = q.shape
    rel = (layout.r * layout.b + torch.arange(layout.b, device=q.device))[:, None] - torch.arange(
        layout.span, device=q.device
    )
    bias = score_bias(rel, layout.causal).to(torch.promote_types(q.dtype, torch.float32))[:, None]  # (H, 1, b, span)
    out = []
    for t0, t1 in layout.groups(B, H, 0):
        allowed, dead = layout.mask(t0, t1)  # (B|1, G, b, span), (B|1, G, b, 1)
        s = torch.matmul(_rows(q, layout, t0, t1), _gather(k, layout, t0, t1, None).transpose(-1, -2)) * scale
        s = (s.to(bias.dtype) + bias).masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1).to(v.dtype)  # (B, H, G, b, span)
        out.append(torch.matmul(p, _gather(v, layout, t0, t1, None)).masked_fill(dead[:, None], 0.0))
    return torch.cat(out, dim=2).flatten(2, 3)[:, :, :N]


class _BandAttention(torch.autograd.Function):
    """Blocked band(+global) attention: fused forward; backward recomputes each group's weights.

    Storing every group's weights for backward would cost O(N·w) memory per head; recomputing them
    keeps backward within the same bound as forward. On the CPU the forward keeps each row's log-sum-exp
    (N numbers a head) and each group goes through torch's flash backward kernel; elsewhere the backward
    is written out (`_group_backward`). The gradients are formed in buffers of exactly q's, k's and v's
    shapes (contiguous: autograd keeps them as they are, where a view of a padded buffer would be copied),
    each key block's share added where it came from.
    """

    @staticmethod
    def forward(ctx, q, k, v, layout: _Layout, scale: float):
        lse = None
        if _flash_cpu(q, v):
            lse = q.new_empty(
                q.shape[0], q.shape[1], layout.nb * layout.b, dtype=torch.promote_types(q.dtype, torch.float32)
            )
        out = _band_attention_fused(q, k, v, layout, scale, lse)
        ctx.save_for_backward(
            q, k, v, out, *(() if lse is None else (lse,))
        )  # inputs autograd holds anyway, the output
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        B, H, N, D = q.shape
        b, g, r = layout.b, layout.g, layout.r
        grad_out = grad_out.contiguous()
        k_glob, v_glob = (k[:, :, :g], v[:, :, :g]) if g else (None, None)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dk_glob = k.new_zeros(B, H, g, D) if g else None
        dv_glob = v.new_zeros(B, H, g, v.shape[-1]) if g else None
        for t0, t1 in layout.groups(B, H, g):
            allowed, dead = layout.mask(t0, t1)  # (B|1, G, b, keys), (B|1, G, b, 1)
            dog = _rows(grad_out, layout, t0, t1).masked_fill(dead[:, None], 0.0)  # dead rows were zeroed
            kg, vg = _gather(k, layout, t0, t1, k_glob), _gather(v, layout, t0, t1, v_glob)  # (B, H, G, keys, ·)
            if lse:
                row_lse = _blocks_first(lse[0][:, :, t0 * b : t1 * b].unflatten(2, (t1 - t0, b)))  # (B·G, H, b)
                grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    _blocks_first(dog),
                    _blocks_first(_rows(q, layout, t0, t1)),
                    _blocks_first(kg),
                    _blocks_first(vg),
                    _blocks_first(_rows(out, layout, t0, t1)),
                    row_lse,
                    0.0,
                    False,
                    attn_mask=_per_block(layout.additive(t0, t1, q.dtype), B),
                    scale=scale,
                )
                dqg, dkg, dvg = (_blocks_back(grad, B) for grad in grads)
            else:
                dqg, dkg, dvg = _group_backward(
                    _rows(q, layout, t0, t1), kg, vg, _rows(out, layout, t0, t1), dog, allowed, scale
                )
            _put_rows(dq, dqg, b, t0, add=False)
            for o in range(layout.span // b):  # key block o of query block t is block t + o - r of the sequence
                keys = slice(o * b, (o + 1) * b)
                _put_rows(dk, dkg[:, :, :, keys], b, t0 + o - r, add=True)
                _put_rows(dv, dvg[:, :, :, keys], b, t0 + o - r, add=True)
            if g:
                dk_glob += dkg[:, :, :, layout.span :].sum(2)
                dv_glob += dvg[:, :, :, layout.span :].sum(2)
        if g:
            dk[:, :, :g] += dk_glob
            dv[:, :, :g] += dv_glob
        return dq, dk, dv, None, None


def _group_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, grad_out: Tensor, allowed: Tensor, scale: float):
    """(dq, dk, dv) of one group, (B, H, G, ·, ·) each, written out: the weights recomputed from the scores
    (softmax), then the four products of attention's backward (as FlashAttention's backward forms them)."""
    acc = torch.promote_types(q.dtype, torch.float32)  # weights in float32 at least
    qs = q * scale  # scale folded in
    s = torch.matmul(qs, k.transpose(-1, -2)).to(acc)  # (B, H, G, b, keys)
    p = torch.softmax(s.masked_fill_(~allowed[:, None], float("-inf")), dim=-1)  # the forward's weights
    del s
    dp = torch.matmul(grad_out, v.transpose(-1, -2)).to(acc)
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
    ds = dp.sub_(delta).mul_(p)  # d(loss)/d(scores)
    del dp
    p, ds = p.to(v.dtype), ds.to(q.dtype)
    return (
        torch.matmul(ds, k).mul_(scale),
        torch.matmul(ds.transpose(-1, -2), qs),
        torch.matmul(p.transpose(-1, -2), grad_out),
    )


def _global_rows(
    q: Tensor, k: Tensor, v: Tensor, n_global: int, causal: bool, key_valid: Tensor | None, scale: float
) -> Tensor:
    """Rows of the g global queries: dense attention over every key, (B, H, g, Dv); O(g·N) memory."""
    acc = torch.promote_types(q.dtype, torch.float32)
    # (k q_g^T)^T rather than q_g k^T: the same scores, and the gradient of k comes out as a contiguous (B, H, N, D)
    # (not a transposed one, which autograd would sum into the band's dk as a strided tensor, then copy)
    s = torch.matmul(k, q[:, :, :n_global].transpose(-1, -2)).transpose(-1, -2).to(acc) * scale  # (B, H, g, N)
    allowed = torch.ones_like(s, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    return torch.matmul(p.to(v.dtype), v)


class LongformerPattern(AttentionVariant):
    """What every implementation of the pattern shares: its options, its dense definition, its FLOPs."""

    def __init__(self, *, window: int = 256, global_tokens: int = 0, **base):
        """
        Args:
            window: w, the band's half-width: query i attends keys j with |i - j| <= w (causal: i - w <= j <= i).
            global_tokens: g, the first g positions attend to every key and are attended by every query.
        """
        super().__init__(**base)
        self._check_int("window", window, 1)
        self._check_int("global_tokens", global_tokens, 0)
        self.window, self.global_tokens = window, global_tokens

    def softmax_equivalent_length(self) -> int | None:
        return self.window + 1  # every |i - j| <= w: the band is the whole matrix

    def check_length(self, n: int) -> int:
        # long enough that some 128-wide tiles / blocks lie wholly outside the band (2w + 3 tiles),
        # so the code that skips them is checked too
        return max(n, 2 * self.window + 3 * 128 + self.global_tokens)

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        allowed = longformer_mask(
            q.shape[-2], k.shape[-2], self.window, self.global_tokens, causal, key_padding_mask, q.device
        )
        return dense_attention(q, k, v, allowed, self._scale(q))

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None, score_bias=None
    ) -> Tensor:
        n_q, n_k = q.shape[-2], k.shape[-2]
        biased = {} if score_bias is None else {"score_bias": score_bias}  # (only a variant carrying one gets it)
        if n_q == n_k:
            return self._attend_self(q, k, v, causal, key_padding_mask, **biased)
        # causal with Nq < Nk (the interface checked it): the queries are the last Nq positions, as when
        # decoding with a KV cache. Without global tokens they see only the last Nq + w keys: keep exactly
        # that many (padded keys before the first one, masked, while Nk is shorter), put the queries at
        # their positions with zero rows before them, and keep the last Nq rows of the self-attention:
        # O((Nq + w) w) per call whatever Nk, and one shape for every decoding step (FlexAttention
        # compiles per shape). Global keys sit at the start: with them, every key is kept.
        if not self.global_tokens:
            start = n_k - n_q - self.window
            if start >= 0:  # (a copy: a view's strides would change with Nk, and FlexAttention recompiles on strides)
                k, v = k[:, :, start:].contiguous(), v[:, :, start:].contiguous()
                key_padding_mask = None if key_padding_mask is None else key_padding_mask[:, start:]
            else:
                if key_padding_mask is None:
                    key_padding_mask = torch.ones(k.shape[0], n_k, dtype=torch.bool, device=k.device)
                key_padding_mask = torch.nn.functional.pad(key_padding_mask, (-start, 0), value=False)
                k, v = (torch.nn.functional.pad(t, (0, 0, -start, 0)) for t in (k, v))
        q = torch.nn.functional.pad(q, (0, 0, k.shape[-2] - n_q, 0))
        return self._attend_self(q, k, v, True, key_padding_mask, **biased)[:, :, -n_q:]

    def _attend_self(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        """Nq == Nk."""
        raise NotImplementedError

    # -- decoding: the keys the window can still reach ---------------------------------------------
    state_kind = "window"
    step_positions = 256  # (a step forms its t x (g + w + t) scores)

    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        # the first g positions (global: every later query reads them; StreamingLLM's sinks) and the last w
        empty = kv_cache(batch, heads, head_dim, value_dim, dtype, device)
        return {"sink_k": empty["k"], "sink_v": empty["v"], "k": empty["k"], "v": empty["v"]}

    def _prefill(self, q, k, v, state, keep):
        # what the window still reaches after these positions: no output computed (nothing of t x t)
        return self._advanced(k, v, state, keep)

    def _advanced(self, k, v, state, keep):
        """The state after new keys and values at L .. L + t - 1: the sinks topped up to g, the last w of the rest
        (with their padding masks once a position kept is padding)."""
        g, w, n, t = self.global_tokens, self.window, state.length, k.shape[2]
        sink_k, sink_v, win_k, win_v = (state.tensors[key] for key in ("sink_k", "sink_v", "k", "v"))
        new_sinks = max(0, min(t, g - n))  # new positions that are global
        keep_w = max(0, min(w, n + t - g))  # window positions after the step: max(g, L + t - w) .. L + t - 1
        cut = win_k.shape[2] + t - new_sinks - keep_w
        win_k, win_v = (
            torch.cat([old, new[:, :, new_sinks:]], dim=2)[:, :, cut:] for old, new in ((win_k, k), (win_v, v))
        )
        masks = {}
        sink_mask, win_mask = state.tensors.get("sink_mask"), state.tensors.get("mask")
        if keep is not None or win_mask is not None:
            sink_mask = masks_appended(
                state, sink_mask, sink_k.shape[2], None if keep is None else keep[:, :new_sinks], new_sinks
            )
            win_mask = masks_appended(
                state,
                win_mask,
                state.tensors["k"].shape[2],
                None if keep is None else keep[:, new_sinks:],
                t - new_sinks,
            )
            masks = {"sink_mask": sink_mask, "mask": win_mask[:, cut:]}
        return state.advanced(
            t,
            sink_k=torch.cat([sink_k, k[:, :, :new_sinks]], dim=2),
            sink_v=torch.cat([sink_v, v[:, :, :new_sinks]], dim=2),
            k=win_k,
            v=win_v,
            **masks,
        )

    def _step(self, q, k, v, state, keep):
        """The t new positions at L .. L + t - 1 against the sinks (positions 0 .. g - 1), the window (the last
        w positions before L, those >= g) and each other, by the pattern's mask: O((g + w + t) t D) whatever L.
        The state keeps at most g + w positions."""
        g, w, n, t = self.global_tokens, self.window, state.length, q.shape[2]
        sink_k, sink_v, win_k, win_v = (state.tensors[key] for key in ("sink_k", "sink_v", "k", "v"))
        keys, values = torch.cat([sink_k, win_k, k], dim=2), torch.cat([sink_v, win_v, v], dim=2)
        dev = q.device
        pos = torch.cat(
            [torch.arange(sink_k.shape[2], device=dev), torch.arange(n - win_k.shape[2], n + t, device=dev)]
        )
        i = torch.arange(n, n + t, device=dev)[:, None]
        allowed = (pos <= i) & ((i - pos <= w) | (pos < g) | (i < g))  # the causal pattern of longformer_mask
        after = self._advanced(k, v, state, keep)
        if padded(after):  # the kept positions' masks and the new ones', in the order of `keys`
            real = torch.cat(
                [
                    after.tensors["sink_mask"][:, : sink_k.shape[2]],
                    masks_appended(state, state.tensors.get("mask"), win_k.shape[2], keep, t),
                ],
                dim=1,
            )
            allowed = allowed & real[:, None, None, :]
        return dense_attention(q, keys, values, allowed, self._scale(q)), after

    def flops(self, n_q: int, n_k: int, d: int, dv: int, causal: bool) -> float:
        return 2.0 * band_pairs(n_q, self.window, self.global_tokens, causal) * (d + dv)

    def extra_repr(self) -> str:
        return f"window={self.window}, global_tokens={self.global_tokens}"


@register
class SlidingWindowAttention(LongformerPattern):
    """How it is computed without an N x N matrix: the sequence is cut into blocks of b positions. The
    keys any query of block t can reach lie in blocks t-r .. t+r (r = ceil(w / b); causal: t-r .. t), so
    each block's queries are scored against those (2r+1)·b (causal: (r+1)·b) keys plus the g global keys,
    and the exact band is masked inside that small rectangle. Time O(N·(w + g)·D), memory O(N·w) at most — and in practice less:
    blocks are processed in groups sized to a memory bound.

    Forward: each group of blocks goes through the fused SDPA kernel with the band as its mask, so
    no score is stored at all. Backward (`_BandAttention`): each group's weights are recomputed and its
    gradients formed block by block, as FlashAttention does — on the CPU by torch's own flash backward
    kernel, from the log-sum-exp of each row that the forward kept (N numbers a head); elsewhere written
    out here (`_group_backward`). Autograd through the forward's groups instead would keep every group's
    gathered keys and values, (2r+1)·b per block: several copies of K and V.
    """

    spec = VariantSpec(
        position_study=True,
        name="sliding_window",
        kind="local and sparse",
        family="sliding window",
        # in SmolLM2 (8192 positions): a window of 1024, alone and with StreamingLLM's 4 sinks
        lm_defaults=((("window", 1024),), (("window", 1024), ("global_tokens", 4))),
        repeats_kv="its band kernel (forward and written-out backward) takes one K/V head per query head",
        state_repeats_kv="",  # the window and the sinks need K and V only: kept per K/V head, decoded grouped
        summary="Longformer sliding window (|i-j| <= w) + global tokens, blocked in pure PyTorch",
        style=("#2ca02c", "s"),
        reference="Beltagy et al. 2020, 'Longformer: The Long-Document Transformer'",
        time_complexity="O(N (w + g) D)",
        memory_complexity="O(N D) + one group of block scores (bounded)",
        supports_cross_attention=False,
        subquadratic=True,
        carries_score_bias=True,  # (without global tokens: blocks written out, autograd's backward)
        notes="self-attention (and causal with Nq < Nk: the last Nq positions); w >= N equals full attention",
        reach_option="window",
        function_options=("window", "global_tokens"),
        examples=((("window", 3),), (("window", 3), ("global_tokens", 2), ("block_size", 4))),  # two code paths
    )

    def __init__(self, *, window: int = 256, global_tokens: int = 0, block_size: int | None = None, **base):
        """
        Args:
            block_size: queries per block (keys gathered per block: the block and r neighbours on each side);
                None picks min(max(w/2, 32), 128). A tuning knob: the result does not depend on it.
        """
        super().__init__(window=window, global_tokens=global_tokens, **base)
        self._check_int("block_size", block_size, 1, allow_none=True)
        self.block_size = block_size

    def _attend_self(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None, score_bias=None
    ) -> Tensor:
        n = q.shape[-2]
        g = min(self.global_tokens, n)
        if score_bias is not None:
            if self.global_tokens:
                raise ValueError(
                    f"sliding_window: a score bias with global_tokens={self.global_tokens} is not implemented; "
                    "use global_tokens=0 with a bias"
                )
            block = min(self.block_size, n) if self.block_size else default_block_size(self.window, n)
            layout = _Layout(n, self.window, block, 0, causal, key_padding_mask, q.device)
            return _band_attention_biased(q, k, v, layout, self._scale(q), score_bias)
        block = min(self.block_size, n) if self.block_size else default_block_size(self.window, n)
        layout = _Layout(n, self.window, block, g, causal, key_padding_mask, q.device)
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        attend = _BandAttention.apply if needs_grad else _band_attention_fused  # same forward either way
        out = attend(q, k, v, layout, self._scale(q))
        if g:  # global queries see every key: replace their rows
            out = torch.cat([_global_rows(q, k, v, g, causal, key_padding_mask, self._scale(q)), out[:, :, g:]], dim=2)
        return out

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        io = batch * heads * n_q * (d + dv) * element_size
        return int(GROUP_SCORE_BYTES * 4 + io * (6 if backward else 3))
