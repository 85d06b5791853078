"""Log-linear attention: Guo, Yang, Goel, Xing, Dao & Kim 2025, "Log-Linear Attention", on Mamba-2's recurrence.

Mamba-2 keeps one state for the whole past; log-linear attention splits the past of each query t into the
O(log t) buckets of a Fenwick tree and reads each with its own data-dependent weight λ_t^ℓ:

    o_t = Σ_{s<=t} λ_t^{ℓ(t,s)} exp(Σ_{s<r<=t} log a_r) (scale q_t·k_s) Δ_s v_s,    ℓ(t,s) = bit_length(t XOR s)

(ℓ = 0: the query itself; ℓ >= 1: the bucket of 2^(ℓ−1) positions just before t with its lower ℓ − 1 bits
cleared.) With every λ = 1 it is Mamba-2 (the decay a and Δ as mamba2.py's, from the keys). λ_t^ℓ =
softplus(scale q_t·w_h,ℓ + b_h,ℓ), starting at 1. Computed in chunks of C = 2^c positions: inside a chunk the C x C
form with levels 0..c; the earlier chunks as a Fenwick tree of chunk states (a binary counter: a new chunk's
state is a bucket of one, equal buckets merge), read at levels c + 1 + j. O(N C D + N log(N / C) D Dv) time,
O(log N) states; decoding keeps the token-level buckets: popcount(n) D x Dv states after n positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, register
from .._utils import pad_to_multiple
from ._recurrence import SSDDecay


def add_bucket(tree: dict, state: Tensor) -> None:
    """Add a bucket of one (chunk or position) to the Fenwick tree {j: state of 2^j units}, in place: a binary
    counter's carry, two buckets of 2^j making one of 2^(j + 1)."""
    j = 0
    while j in tree:
        state = state + tree.pop(j)
        j += 1
    tree[j] = state


def levels_of(n_q_start: int, n_q: int, n_k: int, device) -> Tensor:
    """ℓ(t, s) = bit_length(t XOR s) for queries at n_q_start .. n_q_start + n_q − 1 and keys 0 .. n_k − 1."""
    x = torch.arange(n_q_start, n_q_start + n_q, device=device)[:, None] ^ torch.arange(n_k, device=device)[None, :]
    powers = 2 ** torch.arange(max(n_q_start + n_q, n_k).bit_length(), device=device)
    return (x[..., None] >= powers).sum(-1)  # (how many powers of two are <= x: its bit length, in integers)


@register
class LogLinearAttention(AttentionVariant):
    """Between linear (one state) and softmax (every key): O(log N) states, so the far past is kept in coarser
    and coarser buckets whose weights the query chooses. Grouped-query inputs natively: the decay, Δ and the
    states per K/V head; λ per query head. Padding skips a position's decay and write (it keeps its index in
    the tree)."""

    spec = VariantSpec(
        name="log_linear",
        kind="recurrent",
        summary="log-linear attention (Mamba-2): a Fenwick tree of O(log N) states, each read with its own weight",
        style=("#e6550d", "d"),
        reference="Guo, Yang, Goel, Xing, Dao & Kim 2025, 'Log-Linear Attention'",
        time_complexity="O(N C D + N log(N/C) D Dv)",
        memory_complexity="O(N Dv + log N D Dv)",
        supports_non_causal=False,
        why_not_non_causal="a recurrence over positions: the tree at t holds positions <= t only",
        supports_cross_attention=False,
        subquadratic=True,
        notes="causal only; needs num_heads and head_dim; N <= 2^(levels − 1); decodes with popcount(N) D x Dv "
        "states (at most log2 N + 1)",
        function_options=("levels",),
        examples=((("chunk_size", 4), ("levels", 11)), (("chunk_size", 2), ("levels", 12))),
    )
    state_kind = "fenwick"

    def __init__(self, *, chunk_size: int = 64, levels: int = 17, **base):
        """
        Args:
            chunk_size: C, positions per chunk (a power of two). A tuning knob: the result does not depend on it.
            levels: the λ weights a query has (levels 0 .. levels − 1): sequences of up to 2^(levels − 1)
                positions (17: 65536).
            scale: factor of q in o_t; None means D ** -0.5.
        """
        super().__init__(**base)
        self._check_int("chunk_size", chunk_size, 1)
        self._check_int("levels", levels, 2)
        if chunk_size & (chunk_size - 1):
            raise ValueError(f"log_linear: option chunk_size={chunk_size} is invalid; expected a power of two")
        self._require_head_shape("gates and level weights per head")
        self.chunk_size, self.levels = chunk_size, levels
        self.dt = SSDDecay(self._kv_parameter_heads(), self.head_dim)
        self.w_level = nn.Parameter(torch.randn(self.num_heads, self.head_dim, levels) * self.head_dim**-0.5 * 0.1)
        self.b_level = nn.Parameter(torch.full((self.num_heads, levels), math.log(math.expm1(1.0))))  # softplus: 1

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        return self._kv_parameters_reason(kv_heads, "its gates are")

    def length_unsupported_reason(self, n_q: int, n_k: int) -> str | None:
        if n_k > 2 ** (self.levels - 1):
            need = max(1, math.ceil(math.log2(n_k))) + 1
            return f"levels={self.levels} fits up to {2 ** (self.levels - 1)} positions, not N={n_k}; use levels={need}"
        return None

    # -- inputs ------------------------------------------------------------------------------------------
    def _inputs(self, q, k, v, keep):
        """(q scaled, grouped (B, Hkv, G, N, D); k; v Δ-scaled; log a (B, Hkv, N); λ (B, Hkv, G, N, levels))."""
        log_a, dt = self.dt(k)
        v = v * dt[..., None]
        if keep is not None:  # a skipped position: no decay, no write
            log_a, k = log_a * keep, k * keep[..., None]
        q = q * self._scale(q)
        lam = F.softplus(torch.matmul(q, self.w_level.to(q.dtype)[None]) + self.b_level.to(q.dtype)[None, :, None])
        groups = (k.shape[1], q.shape[1] // k.shape[1])
        return q.unflatten(1, groups), k, v, log_a, lam.unflatten(1, groups)

    # -- the chunked forward ---------------------------------------------------------------------------
    def _attend(self, q, k, v, causal, key_padding_mask):
        if q.dtype in (torch.float16, torch.bfloat16):
            return self._attend(q.float(), k.float(), v.float(), causal, key_padding_mask).to(q.dtype)
        n_q, n_k = q.shape[-2], k.shape[-2]
        q = F.pad(q, (0, 0, n_k - n_q, 0))  # the queries are the last Nq positions
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :].to(k.dtype)
        out, _ = self._chunks(*self._inputs(q, k, v, keep))
        return out[:, :, n_k - n_q :]

    def _chunks(self, q, k, v, log_a, lam):
        """Outputs (B, H, N, Dv) and the chunk-level tree {j: state} after the last complete chunk."""
        n = k.shape[2]
        c = min(self.chunk_size, 1 << max(0, (n - 1).bit_length()))
        q, k, v, log_a, lam = (
            pad_to_multiple(t, c, dim=d)[0] for t, d in ((q, 3), (k, 2), (v, 2), (log_a, 2), (lam, 3))
        )
        depth = c.bit_length() - 1  # C = 2^depth: levels 0 .. depth inside a chunk
        inside = levels_of(0, c, c, q.device)
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        tree: dict[int, Tensor] = {}  # j -> the decayed sum of a bucket of 2^j chunks, at the current chunk's start
        outs = []
        for t in range(k.shape[2] // c):
            sl = slice(t * c, (t + 1) * c)
            qc, kc, vc, lc = q[:, :, :, sl], k[:, :, sl], v[:, :, sl], lam[:, :, :, sl]
            b = log_a[:, :, sl].cumsum(-1)  # (B, Hkv, C): decay from the chunk's start, inclusive
            decay = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, -math.inf).exp()[:, :, None]
            weights = torch.gather(lc, -1, inside.expand(*lc.shape[:-1], c)) * decay  # λ_t^ℓ(t,s) a_ts
            out = torch.matmul(torch.matmul(qc, kc[:, :, None].transpose(-1, -2)) * weights, vc[:, :, None])
            q_in = qc * b.exp()[:, :, None, :, None]
            for j, state in tree.items():  # the earlier chunks, bucket by bucket
                out = out + lc[..., depth + 1 + j, None] * torch.matmul(q_in, state[:, :, None])
            outs.append(out)
            total = b[..., -1:]
            writes = torch.matmul((kc * (total - b).exp()[..., None]).transpose(-1, -2), vc)  # to the chunk's end
            tree = {j: s * total.exp()[..., None] for j, s in tree.items()}
            add_bucket(tree, writes)
        return torch.cat(outs, dim=3).flatten(1, 2)[:, :, :n], tree

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """Every weight stored (O(N²)): λ_t^ℓ(t,s) exp(Σ log a) (scale q_t·k_s) Δ_s v_s."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        q = F.pad(q, (0, 0, n_k - n_q, 0))
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :].to(k.dtype)
        qg, k, v, log_a, lam = self._inputs(q, k, v, keep)
        b = log_a.cumsum(-1)
        causal = torch.ones(n_k, n_k, dtype=torch.bool, device=q.device).tril()
        decay = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, -math.inf).exp()[:, :, None]
        level = levels_of(0, n_k, n_k, q.device)
        weights = torch.gather(lam, -1, level.expand(*lam.shape[:-1], n_k)) * decay
        out = torch.matmul(torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * weights, v[:, :, None])
        return out.flatten(1, 2)[:, :, n_k - n_q :]

    # -- decoding: the token-level tree --------------------------------------------------------------
    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        return {"S": torch.zeros(batch, heads, 0, head_dim, value_dim, dtype=dtype, device=device)}

    def _prefill(self, q, k, v, state, keep):
        return self._step(q, k, v, state, keep)[1]

    def _step(self, q, k, v, state, keep):
        """Position by position: the query reads itself (level 0) and the buckets of the n positions before it
        (bucket 2^j at level j + 1, present where bit j of n is set); then it joins as a bucket of one."""
        n0 = state.length
        mask = None if keep is None else keep[:, None, :].to(k.dtype)
        qg, k, v, log_a, lam = self._inputs(q, k, v, mask)
        present = [j for j in range(n0.bit_length()) if n0 >> j & 1]
        tree = dict(zip(present, state.tensors["S"].unbind(2)))
        outs = []
        for i in range(k.shape[2]):
            a = log_a[:, :, i].exp()[..., None, None]
            tree = {j: s * a for j, s in tree.items()}
            write = k[:, :, i, :, None] * v[:, :, i, None, :]
            read = lam[:, :, :, i, 0, None, None] * write[:, :, None]
            for j, s in tree.items():
                read = read + lam[:, :, :, i, j + 1, None, None] * s[:, :, None]
            outs.append(torch.einsum("bgmd,bgmde->bgme", qg[:, :, :, i], read))
            add_bucket(tree, write)
        stacked = torch.stack([tree[j] for j in sorted(tree)], dim=2) if tree else state.tensors["S"]
        return torch.stack(outs, dim=3).flatten(1, 2), state.advanced(k.shape[2], S=stacked)

    # -- what the harness reads ------------------------------------------------------------------
    def flops(self, n_q, n_k, d, dv, causal):
        c = min(self.chunk_size, n_k)
        reads = max(1.0, math.log2(max(n_k / c, 1)) / 2 + 1)  # buckets a chunk reads, on average
        return n_k * (2.0 * c * (d + dv) + 2.0 * d * dv * (reads + 1) + 2.0 * d * self.levels)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        c = min(self.chunk_size, n_k)
        chunks = -(-n_k // c)
        tree = batch * heads * d * dv * 4 * (math.log2(chunks) + 2 if chunks > 1 else 2)
        per = batch * heads * n_k * (c * 3 + self.levels + d + dv) * 4
        saved = batch * heads * chunks * (math.log2(chunks) + 2) * d * dv * 4 if backward else 0
        return int(tree + per * (3 if backward else 1) + saved) + super().memory_estimate(
            batch, heads, n_q, n_k, d, dv, element_size, causal, backward
        )

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, levels={self.levels}"
