"""The Forgetting Transformer: Lin, Nikishin, He & Courville 2025, "Forgetting Transformer: Softmax Attention
with a Forget Gate" (ICLR 2025). Softmax whose scores fade with a learned, data-dependent forget gate:

    o_i = Σ_{j<=i} exp(s_ij) v_j / Σ_{j<=i} exp(s_ij),   s_ij = scale q_i·k_j + Σ_{l=j+1..i} log f_l
    f_t = σ(k_t·w_h + b_h)    (per K/V head; the paper reads the hidden state, the interface hands us k)

With c_t = Σ_{l<=t} log f_l the bias is c_i − c_j; c_i is the same for every key of row i and a softmax
ignores what a row adds to all its scores, so o_i = softmax_j(scale q_i·k_j − c_j) V: exact softmax over
keys [k_j, −c_j] and queries [scale q_i, 1]. The fast path is that: one more key dim, full.py's fused causal
kernel (no score matrix stored); where the gates forget more than 64 nats, queries in blocks whose −c_j is
taken relative to the block's last position (far keys get large negative biases, near ones stay precise). O(N² D) time like
softmax; O(N D) memory plus a block x N bool mask. Decoding keeps the KV cache and each key's log f.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, register
from .._decoding import appended
from .._utils import dead_query_rows, spans, zero_rows
from .full import full_attention_pairs, sdpa

GATE_BIAS_INIT = 6.9  # σ(6.9) ≈ 0.999: the gate starts near 1 (a key 1000 positions back loses a factor e)
FUSED_SPAN = 64.0  # nats of forgetting one fused call may span: float32 keeps its biases to 64 · 2^-24 ≈ 4e-6


class ForgetGate(nn.Module):
    """log f_t = log σ(k_t·w_h + b_h), per head and position; w starts small, b at `bias`."""

    def __init__(self, heads: int, head_dim: int, bias: float):
        super().__init__()
        self.w = nn.Parameter(torch.randn(heads, head_dim) * head_dim**-0.5 * 0.1)
        self.b = nn.Parameter(torch.full((heads,), float(bias)))

    def forward(self, k: Tensor) -> Tensor:
        """log f (B, Hkv, N) of keys (B, Hkv, N, D), in float32 or wider."""
        dtype = torch.promote_types(k.dtype, torch.float32)
        logits = torch.matmul(k.to(dtype), self.w.to(dtype)[..., None])[..., 0] + self.b.to(dtype)[:, None]
        return F.logsigmoid(logits)


def forgetting_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    scale: float,
    key_padding_mask: Tensor | None,
    block: int,
    fused_span: float = 0.0,
) -> Tensor:
    """Causal forgetting attention of q (B, H, Nq, D), the last Nq of the Nk positions of k, v (B, Hkv, Nk, ·)
    with log forget gates log_f (B, Hkv, Nk) (0 at padding: no forgetting across it). One fused causal call
    where Nq = Nk, no padding, and the gates forget at most `fused_span` nats over the whole sequence (the
    biases, within that span, keep float32's precision); else query blocks, each with its own bias reference
    and a block x N bool mask (exact at any span, and about twice the time: the kernel skips no masked tile)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    c = log_f.double().cumsum(-1)  # (B, Hkv, Nk)
    q1 = torch.cat([q * scale, q.new_ones(*q.shape[:-1], 1)], dim=-1)
    if n_q == n_k and key_padding_mask is None and float((c[..., 0].max() - c[..., -1].min()).detach()) <= fused_span:
        k1 = torch.cat([k, -(c - c[..., -1:]).to(k.dtype)[..., None]], dim=-1)
        return sdpa(q1, k1, v, is_causal=True, scale=1.0)
    dead = dead_query_rows(key_padding_mask, n_q, True)
    out = []
    for rows in spans(n_q, block):
        end = n_k - n_q + rows.stop  # keys 0 .. end − 1 are visible to some query of the block
        bias = -(c[..., :end] - c[..., end - 1 : end])  # Σ log f between each key and the block's last position
        k1 = torch.cat([k[:, :, :end], bias.to(k.dtype)[..., None]], dim=-1)
        i = torch.arange(n_k - n_q + rows.start, end, device=q.device)[:, None]
        mask = torch.arange(end, device=q.device)[None, :] <= i  # (rows, end): bottom-right causal
        if key_padding_mask is not None:
            mask = mask & key_padding_mask[:, None, None, :end]
            if dead is not None:
                mask = mask | dead[:, None, rows, None]
        out.append(sdpa(q1[:, :, rows], k1, v[:, :, :end], attn_mask=mask, scale=1.0))
    return zero_rows(torch.cat(out, dim=2), dead)


@register
class ForgettingAttention(AttentionVariant):
    """Where a gated recurrence forgets by shrinking a fixed-size state, this keeps every key and lets the
    gate push old ones down inside the softmax: exact attention with a learned, input-dependent recency bias
    (ALiBi when f is a constant). The paper trains it from scratch; here a gate that starts at f ≈ 0.999 makes
    an untrained layer close to plain softmax, so a pretrained model can be swapped and then trained.

    Grouped-query inputs are computed natively: the gate and its bias are per K/V head, the extra key dim
    read by the group's query heads."""

    spec = VariantSpec(
        position_study=True,
        why_no_score_bias="its forget gate is already a learned bias by distance (ALiBi where f is a constant); a second one is not implemented",
        name="forgetting",
        kind="exact",
        summary="Forgetting Transformer: softmax with a learned data-dependent forget gate on the scores; fused kernel",
        style=("#637939", "v"),
        reference="Lin, Nikishin, He & Courville 2025, 'Forgetting Transformer: Softmax Attention with a Forget Gate'",
        time_complexity="O(N^2 D)",
        memory_complexity="O(N D) (past 64 nats of forgetting, or with padding: a block x N bool mask a call)",
        supports_non_causal=False,
        why_not_non_causal="the gate decays a key by the positions between it and a later query: a decoder's order",
        supports_cross_attention=False,
        notes="causal only; needs num_heads and head_dim (a forget gate per K/V head); decodes with the KV cache "
        "plus each key's log f",
        function_options=("gate_bias",),
        examples=((("block", 4),), (("block", 5), ("gate_bias", 0.0)), (("block", 4), ("fused_span", 0.0))),
    )

    def __init__(self, *, block: int = 1024, gate_bias: float = GATE_BIAS_INIT, fused_span: float = FUSED_SPAN, **base):
        """
        Args:
            block: queries a call of the fused kernel (each with a block x N bool mask). A tuning knob: the
                result does not depend on it.
            gate_bias: b_h's start: σ(b) is the initial forget gate (6.9: f ≈ 0.999, close to softmax).
            fused_span: the most nats the gates may forget over a sequence for one fused causal call (beyond it,
                query blocks with masks: exact at any span, about twice the time). A tuning knob.
            scale: factor of q in the scores; None means D ** -0.5.
        """
        super().__init__(**base)
        self._check_int("block", block, 1)
        if isinstance(gate_bias, bool) or not isinstance(gate_bias, (int, float)):
            raise ValueError(f"forgetting: option gate_bias={gate_bias!r} is invalid; expected a number")
        self._require_head_shape("a forget gate per head over the key dims")
        if isinstance(fused_span, bool) or not isinstance(fused_span, (int, float)) or not fused_span >= 0:
            raise ValueError(f"forgetting: option fused_span={fused_span!r} is invalid; expected a number >= 0")
        self.block, self.fused_span = block, float(fused_span)
        self.gate = ForgetGate(self._kv_parameter_heads(), self.head_dim, gate_bias)

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        return self._kv_parameters_reason(kv_heads, "its forget gates are")

    def log_forget(self, k: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """log f_t (B, Hkv, N) of the keys; 0 at padded positions (nothing forgotten across them)."""
        log_f = self.gate(k)
        return log_f if key_padding_mask is None else log_f * key_padding_mask[:, None, :].to(log_f.dtype)

    def _attend(self, q, k, v, causal, key_padding_mask):
        log_f = self.log_forget(k, key_padding_mask)
        return forgetting_attention(q, k, v, log_f, self._scale(q), key_padding_mask, self.block, self.fused_span)

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """The definition with every score stored: scale q_i·k_j + (c_i − c_j), masked, softmax (O(N²))."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        log_f = self.log_forget(k, key_padding_mask).to(q.dtype)
        k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        c = log_f.repeat_interleave(q.shape[1] // log_f.shape[1], 1).cumsum(-1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self._scale(q) + c[..., n_k - n_q :, None] - c[..., None, :]
        allowed = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, :]
        weights = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1).nan_to_num(0.0)
        return torch.matmul(weights, v)

    # -- decoding: the KV cache and each key's log f ---------------------------------------------
    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        kv = super()._empty_state(batch, heads, head_dim, value_dim, dtype, device)
        return {**kv, "log_f": torch.zeros(batch, heads, 0, dtype=torch.float32, device=device)}

    def _advanced(self, k, v, state, keep):
        log_f = torch.cat([state.tensors["log_f"], self.log_forget(k, keep).float()], dim=-1)
        keys, values, mask, after = appended(state, k, v, keep)
        return keys, values, mask, after.advanced(0, log_f=log_f)

    def _prefill(self, q, k, v, state, keep):
        return self._advanced(k, v, state, keep)[3]

    def _step(self, q, k, v, state, keep):
        keys, values, mask, after = self._advanced(k, v, state, keep)
        log_f = after.tensors["log_f"]
        return forgetting_attention(q, keys, values, log_f, self._scale(q), mask, self.block, self.fused_span), after

    # -- what the harness reads ------------------------------------------------------------------
    def flops(self, n_q, n_k, d, dv, causal):
        return 2.0 * full_attention_pairs(n_q, n_k, True) * (d + 1 + dv) + 2.0 * n_k * d

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        extra = batch * heads * (n_q + n_k) * (d + 1) * element_size + batch * min(self.block, n_q) * n_k
        return int(extra * (3 if backward else 1)) + super().memory_estimate(
            batch, heads, n_q, n_k, d, dv, element_size, causal, backward
        )

    def extra_repr(self) -> str:
        return f"block={self.block}"
