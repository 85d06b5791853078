"""Memory-compressed attention: Liu et al. 2018, "Generating Wikipedia by Summarizing Long Sequences".

Keys and values are shortened along the sequence by a learned strided 1-D convolution
(kernel = stride = c, one per head), so N keys become M = ceil(N / c) slots; queries keep their full
length and attend over the slots with the fused SDPA kernel. Time O(N·M·D) = O(N²·D / c),
extra memory O(N·D).

Causal: slot m summarizes positions mc .. mc+c-1 and is visible to query i only once all of them
are <= i. (With Nq < Nk the queries are the last Nq positions: query i sits at Nk - Nq + i.) Every query also sees the raw (uncompressed) keys of its own unfinished block, the
positions floor((i+1)/c)·c .. i, so the positions <= i are covered exactly once — as slots or raw —
and every query sees at least one key. Nothing from a position > i reaches output i.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, register
from .._decoding import kv_cache, masks_appended
from .._utils import dead_query_rows, dense_attention, masked_softmax, pad_to_multiple, zero_rows
from .full import padding_and_causal_mask, sdpa

MASKED = -1.0e4  # score of a masked slot / empty sink: exp(-1e4) is 0 in every float type


def compress(x: Tensor, weight: Tensor, bias: Tensor, c: int, valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Strided conv (kernel = stride = c) along N, per head.

    x: (B, H, N, Din); weight: (H * Dout, Din, c) as in `F.conv1d(groups=H)`; bias: (H * Dout,);
    valid: (B, N) bool or None. Returns slots (B, H, M, Dout) and slot validity (B, M) or None.
    """
    b, h, n, d_in = x.shape
    if valid is not None:
        x = x * valid[:, None, :, None].to(x.dtype)  # padded positions are zeroed before compression
    w = weight.view(h, -1, d_in, c).permute(0, 3, 2, 1).reshape(h, c * d_in, -1)  # (H, c·Din, Dout), rows as in x
    slots = _BlockMatmul.apply(x, w, c) + bias.view(h, 1, -1)  # (B, H, M, Dout)
    slot_valid = None
    if valid is not None:
        slot_valid = pad_to_multiple(valid, c, dim=-1, value=False)[0].unflatten(1, (-1, c)).any(-1)  # (B, M)
    return slots, slot_valid


class _BlockMatmul(torch.autograd.Function):
    """slots[m] = x[mc .. mc+c-1] (c·Din numbers, contiguous in x) @ w: one matmul row per block.

    The whole blocks are read in place and the gradient of x is written into one buffer of x's
    shape: no padded copy of x (N·D) is made, forward or backward; only a ragged last block is padded.
    """

    @staticmethod
    def forward(ctx, x, w, c):
        b, h, n, d = x.shape
        whole = n // c * c
        slots = x.new_empty(b, h, math.ceil(n / c), w.shape[-1])
        if whole:
            slots[:, :, : whole // c] = torch.matmul(x[:, :, :whole].unflatten(2, (-1, c)).flatten(-2), w)
        if whole < n:
            slots[:, :, -1:] = torch.matmul(_last_block(x, c), w)
        ctx.save_for_backward(x, w)
        ctx.c = c
        return slots

    @staticmethod
    def backward(ctx, d_slots):
        x, w = ctx.saved_tensors
        c = ctx.c
        b, h, n, d = x.shape
        whole = n // c * c
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x)
            w_t = w.transpose(-1, -2).to(d_slots.dtype)  # under autocast the forward ran in x's dtype, w kept its own
            if whole:
                dx[:, :, :whole] = torch.matmul(d_slots[:, :, : whole // c], w_t).unflatten(-1, (c, d)).flatten(2, 3)
            if whole < n:
                dx[:, :, whole:] = torch.matmul(d_slots[:, :, -1:], w_t).view(b, h, c, d)[:, :, : n - whole]
        if ctx.needs_input_grad[1]:
            dw = w.new_zeros(w.shape)
            if whole:
                dw += torch.matmul(
                    x[:, :, :whole].unflatten(2, (-1, c)).flatten(-2).transpose(-1, -2), d_slots[:, :, : whole // c]
                ).sum(0)
            if whole < n:
                dw += torch.matmul(_last_block(x, c).transpose(-1, -2), d_slots[:, :, -1:]).sum(0)
        return dx, dw, None


def _last_block(x: Tensor, c: int) -> Tensor:
    """The ragged last block of x (B, H, N, D), zero-padded to c positions: (B, H, 1, c·D)."""
    n = x.shape[2]
    whole = n // c * c
    return F.pad(x[:, :, whole:], (0, 0, 0, c - (n - whole))).flatten(-2)[:, :, None]


def _phase_count(n: int, c: int, a: int) -> int:
    """Queries of phase a (positions j·c - 1 + a, j = 0, 1, ..; j = 0 of phase 0 is the zero row at -1)."""
    return (n - a) // c + 1


def _phases(n: int, c: int) -> list[int]:
    """The phases that have a query (N < c leaves some empty)."""
    return [a for a in range(c) if _phase_count(n, c, a) > (1 if a == 0 else 0)]


def _phase(q, k, v, a: int, c: int, e: int, scale: float, key_padding_mask):
    """Phase a's queries augmented for the slots' SDPA call, [q_a, lse_raw, 1/scale, 0..] (B, H, count, E), and
    (a >= 1; else None) its raw part softmax_raw·V_raw (B, H, count, Dv), the raw weights and where their
    log-sum-exp is not clamped."""
    b, h, n, d = q.shape
    count = _phase_count(n, c, a)
    acc = torch.promote_types(q.dtype, torch.float32)
    out_raw = p_raw = live = None
    if a == 0:  # j = 0 is position -1: a zero row, cut after (it keeps the causal mask top-left)
        q_a = F.pad(q[:, :, c - 1 :: c], (0, 0, 1, 0))
        lse = q.new_full((b, h, count, 1), MASKED)  # no raw keys: the sink gets no weight
    else:
        q_a = q[:, :, a - 1 :: c]  # (B, H, count, D)
        # scores and values formed r by r: an O(N·D / c) temporary at a time, no copy of the keys
        s_raw = torch.stack([(q_a * k[:, :, r::c][:, :, :count]).sum(-1, dtype=acc) for r in range(a)], -1) * scale
        if key_padding_mask is not None:
            s_raw = s_raw.masked_fill(~key_padding_mask.unfold(1, a, c)[:, None], float("-inf"))
        lse_raw = torch.logsumexp(s_raw, dim=-1, keepdim=True)  # -inf where every raw key is padding
        live = lse_raw > MASKED  # where the clamp below leaves the log-sum-exp as it is
        p_raw = torch.exp(s_raw - lse_raw.clamp_min(MASKED))  # (B, H, count, a)
        out_raw = torch.zeros(b, h, count, v.shape[-1], dtype=v.dtype, device=v.device)
        for r in range(a):
            out_raw.addcmul_(p_raw[..., r : r + 1].to(v.dtype), v[:, :, r::c][:, :, :count])
        lse = lse_raw.clamp_min(MASKED).to(q.dtype)
    q_aug = torch.cat([q_a, lse, torch.full_like(lse, 1.0 / scale), q_a.new_zeros(b, h, count, e - d - 2)], -1)
    return q_aug, out_raw, p_raw, live


class _Phases(torch.autograd.Function):
    """Per phase a of the block: its queries q_a (positions j·c - 1 + a) augmented for the slots' SDPA call,
    [q_a, lse_raw, 1/scale, 0..] (B, H, count, E), and for a >= 1 its raw part softmax_raw·V_raw (B, H, count, Dv)
    over the raw keys j·c + r, r < a. Queries and raw keys are strided views of q, k, v; the backward adds each
    phase's gradients into one buffer each of q's, k's and v's shapes (autograd through the views would form a
    whole zero-filled gradient per view, summed: several N·D buffers at once)."""

    @staticmethod
    def forward(ctx, q, k, v, c: int, e: int, scale: float, key_padding_mask):
        ctx.set_materialize_grads(False)
        q_augs, raws, saved, phases = [], [], [], _phases(q.shape[2], c)
        for a in phases:
            q_aug, out_raw, p_raw, live = _phase(q, k, v, a, c, e, scale, key_padding_mask)
            q_augs.append(q_aug)
            if a:
                raws.append(out_raw)
                saved += [p_raw, live]
        ctx.save_for_backward(q, k, v, *saved)
        ctx.c, ctx.scale, ctx.phases = c, scale, phases
        return (*q_augs, *raws)

    @staticmethod
    def backward(ctx, *grads):
        q, k, v, *saved = ctx.saved_tensors
        c, scale, phases = ctx.c, ctx.scale, ctx.phases
        d = q.shape[-1]
        acc = torch.promote_types(q.dtype, torch.float32)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        raw_grads = iter(grads[len(phases) :])
        saved_parts = iter(saved)
        for a, g_aug in zip(phases, grads[: len(phases)]):
            if a == 0:
                if g_aug is not None:
                    dq[:, :, c - 1 :: c] += g_aug[:, :, 1:, :d]
                continue
            p_raw, live = next(saved_parts), next(saved_parts)
            g_out = next(raw_grads)
            count = p_raw.shape[2]
            q_a = q[:, :, a - 1 :: c]
            keys = [k[:, :, r::c][:, :, :count] for r in range(a)]
            values = [v[:, :, r::c][:, :, :count] for r in range(a)]
            # d(loss)/d(s_r) = p_r (dp_r - sum_r' p_r' dp_r' + g_lse) where the log-sum-exp is live; p_r dp_r elsewhere
            dp = (
                torch.stack([(g_out * v_r).sum(-1, dtype=acc) for v_r in values], -1)
                if g_out is not None
                else p_raw.new_zeros(p_raw.shape)
            )
            shared = (p_raw * dp).sum(-1, keepdim=True)
            if g_aug is not None:
                shared = shared - g_aug[..., d : d + 1].to(acc)
            ds = p_raw * (dp - shared * live)
            dq_a = dq[:, :, a - 1 :: c]
            if g_aug is not None:
                dq_a += g_aug[..., :d]
            for r in range(a):
                ds_r = (ds[..., r : r + 1] * scale).to(q.dtype)
                dq_a.addcmul_(ds_r, keys[r])
                dk[:, :, r::c][:, :, :count].addcmul_(ds_r, q_a)
                if g_out is not None:
                    dv[:, :, r::c][:, :, :count].addcmul_(p_raw[..., r : r + 1].to(v.dtype), g_out)
        return dq, dk, dv, None, None, None, None


@register
class MemoryCompressedAttention(AttentionVariant):
    """The two key sets share one softmax. The slots go through SDPA with a causal mask, and the raw keys'
    share enters as one extra "sink" key whose score is their log-sum-exp (carried in an extra query
    dimension) and whose value is zero, plus an extra value column of ones that reads back the slots'
    share α: out = SDPA(...)[:Dv] + (1 - α)·softmax_raw·V_raw. Key padding: padded positions are zeroed
    before compression, a slot of padding only is masked (through one more key dimension).
    The queries are taken one phase of the block at a time (positions j·c - 1 + a for a fixed a: a strided
    view), so each phase is one causal SDPA call over the same slots and no key is copied per phase;
    `_Phases` forms each phase's augmented queries and raw part, and its backward writes the gradients of
    q, k and v into one buffer each.
    """

    spec = VariantSpec(
        name="memory_compressed",
        kind="low-rank and compressed",
        family="compressed memory",
        repeats_kv="the strided convolution compressing K and V is learned per query head",
        summary="keys/values compressed by a strided conv (kernel = stride = c) per head; fused SDPA over the N/c slots",
        style=("#9467bd", "P"),
        reference="Liu et al. 2018, 'Generating Wikipedia by Summarizing Long Sequences'",
        time_complexity="O(N^2 D / c)",
        memory_complexity="O(N D)",
        subquadratic=True,
        notes="causal: complete slots <= i plus the raw keys of the query's unfinished block; needs num_heads and head_dim",
        function_options=("compression",),
        examples=((("compression", 3),), (("compression", 2),)),  # with Nq <= c: direct rows; Nq > c: the scan
    )

    def __init__(self, *, compression: int = 3, value_dim: int | None = None, **base):
        """
        Args:
            compression: c, the stride and kernel of the per-head convolution: N keys become ceil(N / c) slots.
            value_dim: Dv of the values this module's value convolution takes (None: head_dim).
        """
        super().__init__(**base)
        self._check_int("compression", compression, 1)
        self._require_head_shape("the per-head convolutions are parameters")
        h, d = self.num_heads, self.head_dim
        self._check_int("value_dim", value_dim, 1, allow_none=True)
        dv = d if value_dim is None else value_dim
        self.compression, self.value_dim = compression, dv
        # conv1d(groups=H) layout: (H * Dout, Din, c)
        self.k_weight = nn.Parameter(torch.empty(h * d, d, compression))
        self.k_bias = nn.Parameter(torch.empty(h * d))
        self.v_weight = nn.Parameter(torch.empty(h * dv, dv, compression))
        self.v_bias = nn.Parameter(torch.empty(h * dv))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w, bias in ((self.k_weight, self.k_bias), (self.v_weight, self.v_bias)):
            bound = 1.0 / math.sqrt(w.shape[1] * w.shape[2])  # nn.Conv1d's default
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(bias, -bound, bound)

    def _check_value_dim(self, v: Tensor) -> None:
        if v.shape[-1] != self.value_dim:
            raise ValueError(f"memory_compressed: built for value dim {self.value_dim}, got Dv={v.shape[-1]}")

    def compressed_kv(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None):
        """(slots_k (B, H, M, D), slots_v (B, H, M, Dv), slot validity (B, M) or None)."""
        self._check_value_dim(v)
        kc, slot_valid = compress(k, self.k_weight, self.k_bias, self.compression, key_padding_mask)
        vc, _ = compress(v, self.v_weight, self.v_bias, self.compression, key_padding_mask)
        return kc, vc, slot_valid

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        n_q, n_k = q.shape[-2], k.shape[-2]
        if causal and n_q < n_k and n_q <= self.compression:
            # a few last positions (decoding with a KV cache: Nq = 1): their rows over [slots, raw keys]
            # directly, O(Nq (M + Nk)) = O(Nk) memory
            kc, vc, slot_valid = self.compressed_kv(k, v, key_padding_mask)
            return self._reference_weights(q, k, kc, slot_valid, True, key_padding_mask, torch.cat([vc, v], 2))
        if causal:
            # Nq < Nk: the queries are the last Nq positions; zero rows put them there and are cut after
            q_full = q if n_q == n_k else F.pad(q, (0, 0, n_k - n_q, 0))
            out = self._causal(q_full, k, v, key_padding_mask)[:, :, n_k - n_q :]
            return zero_rows(out, dead_query_rows(key_padding_mask, n_q, True))
        kc, vc, slot_valid = self.compressed_kv(k, v, key_padding_mask)
        if slot_valid is None:
            return sdpa(q, kc, vc, scale=self._scale(q))
        dead = dead_query_rows(slot_valid, q.shape[-2], False)
        mask = padding_and_causal_mask(slot_valid, q.shape[-2], False, dead)
        return zero_rows(sdpa(q, kc, vc, attn_mask=mask, scale=self._scale(q)), dead)

    def _causal(self, q, k, v, key_padding_mask) -> Tensor:
        """Nq == Nk. Query i sees the slots of the blocks complete by i, j(i) = floor((i + 1) / c) of them, and the
        raw keys j(i)·c .. i. Write i = j·c - 1 + a (a = 0 .. c-1, the phase): the queries of one phase a form a
        sequence in j that sees slots < j and the a raw keys j·c .. j·c + a - 1, so each phase is one causal
        SDPA call over the slots (no key copied per phase), its queries and raw keys strided views of q, k, v."""
        b, h, n, d = q.shape
        c, dv, scale = self.compression, v.shape[-1], self._scale(q)
        # keys [sink, slot_0, slot_1, ..] in one head dim E (the fused kernel needs q, k, v to share it):
        #   q_aug = [q, lse_raw, 1/scale, 0..]   slot key = [k_c, 0, mask_score, 0..]   sink key = [0, 1/scale, 0, 0..]
        #   slot value = [v_c, 1, 0..]   sink value = 0
        # so the sink's score is the log-sum-exp of the query's raw keys, and the value column of ones reads
        # back the slots' share α of the one softmax: out = SDPA(...)[:Dv] + (1 - α)·softmax_raw·V_raw
        e = max(d + 2, dv + 1)
        self._check_value_dim(v)
        slots = n // c  # complete slots; phase a has floor((n - a) / c) + 1 queries, the first seeing the sink only
        kc, slot_valid = compress(k, self.k_weight, self.k_bias, c, key_padding_mask)
        pen = kc.new_zeros(b, slots) if slot_valid is None else (~slot_valid[:, :slots]).to(kc.dtype) * MASKED
        sink_k = kc.new_zeros(b, h, 1, e)
        sink_k[..., d] = 1.0 / scale
        k_aug = torch.cat(
            [
                sink_k,
                torch.cat(
                    [
                        kc[:, :, :slots],
                        kc.new_zeros(b, h, slots, 1),
                        pen[:, None, :, None].expand(b, h, slots, 1),
                        kc.new_zeros(b, h, slots, e - d - 2),
                    ],
                    -1,
                ),
            ],
            2,
        )  # (B, H, 1 + slots, E)
        del kc  # (one of the two compressed tensors at a time)
        vc, _ = compress(v, self.v_weight, self.v_bias, c, key_padding_mask)
        v_aug = torch.cat(
            [
                vc.new_zeros(b, h, 1, e),
                torch.cat([vc[:, :, :slots], vc.new_ones(b, h, slots, 1), vc.new_zeros(b, h, slots, e - dv - 1)], -1),
            ],
            2,
        )
        del vc
        phases = _phases(n, c)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            pieces = _Phases.apply(
                q, k, v, c, e, scale, key_padding_mask
            )  # each phase's q_aug, then raw parts (a >= 1)
            raws = iter(pieces[len(phases) :])
            inputs = ((a, q_aug, next(raws) if a else None) for a, q_aug in zip(phases, pieces[: len(phases)]))
        else:  # inference: one phase's pieces at a time
            inputs = ((a, *_phase(q, k, v, a, c, e, scale, key_padding_mask)[:2]) for a in phases)
        out = q.new_empty(b, h, n, dv)
        for a, q_aug, out_raw in inputs:
            count = q_aug.shape[2]
            o = sdpa(q_aug, k_aug[:, :, :count], v_aug[:, :, :count], is_causal=True, scale=scale)
            del q_aug
            if a == 0:
                out[:, :, c - 1 :: c] = o[:, :, 1:, :dv]
            else:
                out[:, :, a - 1 :: c] = torch.addcmul(o[..., :dv], 1 - o[..., dv : dv + 1], out_raw)
            del o, out_raw
        return out

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """The same compression, then dense softmax attention over [slots, raw keys] with the visibility mask."""
        k, v = self._grouped_kv(q, k, v)  # grouped K/V: repeated to the query heads, as the forward repeats them
        kc, vc, slot_valid = self.compressed_kv(k, v, key_padding_mask)
        values = torch.cat([vc, v], 2) if causal else vc
        return self._reference_weights(q, k, kc, slot_valid, causal, key_padding_mask, values)

    def _reference_weights(self, q, k, kc, slot_valid, causal, key_padding_mask, values):
        """Dense attention of q over [slots (, raw keys when causal)] applied to `values`."""
        n_q, n_k, m, c = q.shape[-2], k.shape[-2], kc.shape[-2], self.compression
        slot_ok = torch.ones(1, m, dtype=torch.bool, device=q.device) if slot_valid is None else slot_valid
        if not causal:
            return dense_attention(q, kc, values, slot_ok[:, None, None, :], self._scale(q))
        i = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]  # query positions (the last Nq)
        complete = (torch.arange(m, device=q.device)[None, :] + 1) * c - 1 <= i  # slot fully <= i
        j = torch.arange(n_k, device=q.device)[None, :]
        recent = (j >= (i + 1) // c * c) & (j <= i)  # raw keys of the unfinished block
        raw_ok = torch.ones(1, n_k, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
        allowed = torch.cat(
            [complete[None, None] & slot_ok[:, None, None, :], recent[None, None] & raw_ok[:, None, None, :]], -1
        )
        return dense_attention(q, torch.cat([kc, k], 2), values, allowed, self._scale(q))

    def attention_matrix(self, q, k, *, causal=False, key_padding_mask=None):
        """Weight each query gives each original position: a slot's weight is spread evenly over its c
        positions (the conv mixes them with learned weights, so no single share is more right); raw
        keys keep their own weight. Rows sum to 1, like the softmax weights of the other variants."""
        with torch.no_grad():
            n_k, c = k.shape[-2], self.compression
            m = math.ceil(n_k / c)
            kc, slot_valid = compress(k, self.k_weight, self.k_bias, c, key_padding_mask)
            # the module's own definition with v = identity over [slots, raw keys] gives the weights on each
            width = m + (n_k if causal else 0)
            eye = torch.eye(width, dtype=q.dtype, device=q.device).expand(*q.shape[:2], -1, -1)
            weights = self._reference_weights(q, k, kc, slot_valid, causal, key_padding_mask, eye)
            slots, raw = weights[..., :m], weights[..., m:]
            spread = slots.repeat_interleave(c, dim=-1)[..., :n_k] / c
            return spread + raw if causal else spread

    # -- decoding: the slots of complete blocks and the raw keys of the unfinished one ------------------
    state_kind = "compressed"
    step_positions = 256  # (a step forms its t x (N / c + c + t) scores)

    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        slots = kv_cache(batch, heads, head_dim, value_dim, dtype, device)
        raw = kv_cache(batch, heads, head_dim, value_dim, dtype, device)
        return {"slot_k": slots["k"], "slot_v": slots["v"], "k": raw["k"], "v": raw["v"]}  # N / c slots, < c raw

    def _advanced(self, k: Tensor, v: Tensor, state, keep) -> tuple[Tensor, Tensor, Tensor | None, object]:
        """(the raw keys and values from the first position after the kept slots' blocks, new positions included,
        their padding mask or None; the state after them): blocks the new positions complete are compressed
        into slots, once (padded positions zeroed first, as the forward does; a slot of padding only is invalid)."""
        c = self.compression
        raw_k, raw_v = torch.cat([state.tensors["k"], k], dim=2), torch.cat([state.tensors["v"], v], dim=2)
        raw_mask = masks_appended(state, state.tensors.get("mask"), state.tensors["k"].shape[2], keep, k.shape[2])
        whole = raw_k.shape[2] // c * c
        slot_k, slot_v = (
            state.tensors["slot_k"],
            state.tensors["slot_v"],
        )  # buffers: the first L // c rows are the slots
        have = state.length // c
        slot_valid = state.tensors.get("slot_valid")
        if raw_mask is not None and slot_valid is None:
            slot_valid = torch.ones(state.batch, have, dtype=torch.bool, device=state.device)
        if whole:
            new_k, new_v, valid = self.compressed_kv(
                raw_k[:, :, :whole], raw_v[:, :, :whole], None if raw_mask is None else raw_mask[:, :whole]
            )
            need = have + new_k.shape[2]
            if need > slot_k.shape[2]:  # grown to twice what is needed: a block's slot is written in place, not the
                grow = lambda buf: torch.cat(
                    [buf[:, :, :have], buf.new_empty(*buf.shape[:2], 2 * need - have, buf.shape[-1])], 2
                )  # noqa: E731
                slot_k, slot_v = grow(slot_k), grow(slot_v)  # whole cache copied at every block
            slot_k[:, :, have:need], slot_v[:, :, have:need] = new_k, new_v
            if valid is not None:
                slot_valid = torch.cat([slot_valid, valid], dim=1)
        masks = {} if raw_mask is None else {"mask": raw_mask[:, whole:], "slot_valid": slot_valid}
        after = state.advanced(
            k.shape[2], slot_k=slot_k, slot_v=slot_v, k=raw_k[:, :, whole:], v=raw_v[:, :, whole:], **masks
        )
        return raw_k, raw_v, raw_mask, after

    def _slots(self, state) -> tuple[Tensor, Tensor]:
        """The slots of the complete blocks (views of the state's buffers)."""
        m = state.length // self.compression
        return state.tensors["slot_k"][:, :, :m], state.tensors["slot_v"][:, :, :m]

    def step_read_bytes(self, state):
        slot_k, slot_v = self._slots(state)
        raw = state.tensors["k"], state.tensors["v"]
        return sum(t.numel() * t.element_size() for t in (slot_k, slot_v, *raw))

    def _prefill(self, q, k, v, state, keep):
        return self._advanced(k, v, state, keep)[3]

    def _step(self, q, k, v, state, keep):
        """The t new positions at L .. L + t - 1 over the slots complete by then and the raw keys of their own
        unfinished block (the causal definition of `reference`): O((N / c + c + t) t D) per step."""
        c, n, t = self.compression, state.length, q.shape[2]
        first_raw = n // c * c  # the position of the first raw key kept
        raw_k, raw_v, raw_mask, after = self._advanced(k, v, state, keep)
        slot_k, slot_v = self._slots(after)
        i = torch.arange(n, n + t, device=q.device)[:, None]
        complete = (torch.arange(slot_k.shape[2], device=q.device)[None, :] + 1) * c - 1 <= i
        pos = torch.arange(first_raw, first_raw + raw_k.shape[2], device=q.device)[None, :]
        recent = (pos >= (i + 1) // c * c) & (pos <= i)
        allowed = torch.cat([complete, recent], -1)
        if raw_mask is not None:  # (B, 1, t, slots + raw): invalid slots and padded raw keys left out
            allowed = allowed & torch.cat([after.tensors["slot_valid"], raw_mask], 1)[:, None, None, :]
        # one softmax over [slots, raw keys], the two score blocks side by side (no copy of the slots)
        scale = self._scale(q)
        scores = (
            torch.cat([torch.matmul(q, slot_k.transpose(-1, -2)), torch.matmul(q, raw_k.transpose(-1, -2))], -1) * scale
        )
        p = masked_softmax(scores, allowed)
        m = slot_k.shape[2]
        return torch.matmul(p[..., :m], slot_v) + torch.matmul(p[..., m:], raw_v), after

    def flops(self, n_q: int, n_k: int, d: int, dv: int, causal: bool) -> float:
        m = math.ceil(n_k / self.compression)
        conv = 2.0 * m * self.compression * (d * d + dv * dv)
        pairs = n_q * m / 2 if causal else n_q * m
        return conv + 2.0 * pairs * (d + dv)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        io = batch * heads * (n_q + n_k) * (d + dv) * element_size
        return int(io * ((6 if causal else 2) * (2 if backward else 1)))

    def extra_repr(self) -> str:
        return f"compression={self.compression}, num_heads={self.num_heads}, head_dim={self.head_dim}"
