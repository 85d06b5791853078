"""Multi-head latent attention: DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model"; converting a trained model's K/V to it: Ji et al. 2025 (MHA2MLA), Meng et
al. 2025 (TransMLA).

Every K/V head's keys and values of a position are compressed into one shared latent c_t of latent_dim dims and
expanded back; a decoupled rotary part of each key (rope_dim dims a head) is kept as it is:

    c_t = [k̂_t, v_t] W_down          (k̂: the keys without their kept dims, all K/V heads side by side)
    k_t,h = [k^R_t,h, (c_t W_uk)_h],   v_t,h = (c_t W_uv)_h,     o = softmax(scale q kᵀ) v   (exact, fused kernel)

Decoding keeps c_t and k^R_t: latent_dim + Hkv · rope_dim numbers a position instead of the KV cache's
2 · Hkv · D. A step reads it in the absorbed form: W_uk folded into the query (q̂ W_ukᵀ · c_s = q̂ · c_s W_uk)
and W_uv applied once to the weighted sum of latents, so nothing is expanded. `fit(k, v)` sets W_down, W_uk,
W_uv from the SVD of sample keys and values (their top latent_dim right singular vectors), as MHA2MLA does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, register
from .._checks import causal_mask
from .._decoding import masks_appended
from .._utils import masked_softmax
from .full import FullAttention, full_attention_pairs


@register
class MultiHeadLatentAttention(AttentionVariant):
    """Exact softmax over keys and values that pass through a latent bottleneck: the function changes (the
    reconstruction is low-rank) but the cost is softmax's, and the decoding state shrinks. The kept key dims
    are the highest-frequency rotary pairs (i and i + D/2 for the first rope_dim/2 i, as transformers rotates
    them), what MHA2MLA keeps of RoPE. A fresh layer projects [k̂, v] onto a random orthonormal basis; `fit`
    makes it the best rank-latent_dim projection of data (the model's own keys and values). Trained from
    scratch, keep some key dims out (rope_dim > 0, DeepSeek's decoupled key): with every key dim rebuilt from the
    latent, Zoology's MQAR model stayed at chance (docs/quality.md, "The methods of 2025–26 on MQAR")."""

    spec = VariantSpec(
        why_no_score_bias="its scores are exact softmax over keys rebuilt from the latent, where a bias would fit; not implemented here",
        name="mla",
        kind="low-rank and compressed",
        summary="multi-head latent attention: K, V through one latent per position (+ kept rotary key dims); decodes from the latent",
        style=("#9c9ede", "8"),
        reference="DeepSeek-AI 2024, 'DeepSeek-V2'; Ji et al. 2025 (MHA2MLA); Meng et al. 2025 (TransMLA)",
        time_complexity="O(Nq Nk D + N Hkv D latent_dim)",
        memory_complexity="O(N (latent_dim + Hkv D))",
        supports_cross_attention=True,
        notes="needs num_heads and head_dim (projections over every K/V head); decodes with latent_dim + "
        "Hkv · rope_dim numbers a position",
        function_options=("latent_dim", "rope_dim"),
        examples=((("latent_dim", 3),), (("latent_dim", 4), ("rope_dim", 2))),
    )
    state_kind = "latent"
    shared_state = ("c",)  # the state's tensors kept once for every head (the latents), not per K/V head
    mixes_kv_heads = True  # each head's keys and values are read from every K/V head's (a NaN reaches them all)

    def __init__(self, *, latent_dim: int | None = None, rope_dim: int = 0, **base):
        """
        Args:
            latent_dim: d_c, the latent's dims a position (None: Hkv · D / 2, a quarter of the KV cache's 2 Hkv D);
                at most Hkv · D.
            rope_dim: dims of each K/V head's key kept out of the latent (the first rope_dim / 2 rotary pairs);
                even, at most head_dim.
            scale: factor of q in the scores; None means D ** -0.5.
        """
        super().__init__(**base)
        self._require_head_shape("its projections span every K/V head")
        d, kv = self.head_dim, self.num_kv_heads or self.num_heads
        self._check_int("rope_dim", rope_dim, 0)
        if rope_dim % 2 or rope_dim > d:
            raise ValueError(f"mla: option rope_dim={rope_dim} is invalid; expected an even int in 0..{d} (head_dim)")
        latent_dim = kv * d // 2 if latent_dim is None else latent_dim
        self._check_int("latent_dim", latent_dim, 1)
        if latent_dim > kv * d:
            raise ValueError(
                f"mla: option latent_dim={latent_dim} is invalid; expected at most Hkv · D = {kv} · {d} = {kv * d} "
                "(a wider latent saves less than half the KV cache)"
            )
        self.latent_dim, self.rope_dim, self.kv_heads = latent_dim, rope_dim, kv
        half = rope_dim // 2
        kept = [*range(half), *range(d // 2, d // 2 + half)]
        self.register_buffer("kept", torch.tensor(kept, dtype=torch.long), persistent=False)
        self.register_buffer("rest", torch.tensor([i for i in range(d) if i not in kept], dtype=torch.long), False)
        width, split = kv * (2 * d - rope_dim), kv * (d - rope_dim)
        basis = torch.randn(width, latent_dim)  # a random orthonormal basis until `fit`: every dim half kept
        basis = basis if basis.is_meta else torch.linalg.qr(basis)[0]
        self.down = nn.Parameter(basis.clone())  # (width, d_c)
        self.up_k = nn.Parameter(basis[:split].T.clone())  # (d_c, Hkv (D - r))
        self.up_v = nn.Parameter(basis[split:].T.clone())  # (d_c, Hkv D)
        self._softmax = FullAttention(scale=self.scale)

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        return self._kv_parameters_reason(kv_heads, "its projections are")

    # -- the latent --------------------------------------------------------------------------------
    def _joint(self, k: Tensor, v: Tensor) -> Tensor:
        """[k̂, v] (B, N, Hkv (2D − r)): every K/V head's compressed key dims, then its values."""
        k_rest = k.index_select(-1, self.rest)
        return torch.cat([k_rest.transpose(1, 2).flatten(2), v.transpose(1, 2).flatten(2)], dim=-1)

    def compress(self, k: Tensor, v: Tensor) -> Tensor:
        """The latents c (B, N, latent_dim) of keys and values (B, Hkv, N, D)."""
        return torch.matmul(self._joint(k, v), self.down.to(k.dtype))

    def expand(self, c: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, Hkv, N, D) from latents and the kept key dims (B, Hkv, N, rope_dim)."""
        b, n = c.shape[:2]
        d, kv = self.head_dim, self.kv_heads
        k_rest = torch.matmul(c, self.up_k.to(c.dtype)).view(b, n, kv, d - self.rope_dim).transpose(1, 2)
        v = torch.matmul(c, self.up_v.to(c.dtype)).view(b, n, kv, d).transpose(1, 2)
        k = k_rest.new_empty(b, kv, n, d)
        k[..., self.rest], k[..., self.kept] = k_rest, k_rope
        return k, v

    @torch.no_grad()
    def fit(self, k: Tensor, v: Tensor) -> float:
        """Set W_down, W_uk, W_uv to the best rank-latent_dim projection of these keys and values (B, Hkv, N, D),
        in the least-squares sense (the SVD of [k̂, v]); returns the fraction of their energy it keeps."""
        x = self._joint(k, v).flatten(0, 1).double()  # (samples, width)
        _, s, vh = torch.linalg.svd(x, full_matrices=False)
        basis = vh[: self.latent_dim].T  # (width, d_c); fewer samples than d_c: the other latent dims unused
        basis = torch.nn.functional.pad(basis, (0, self.latent_dim - basis.shape[1]))
        split = self.kv_heads * (self.head_dim - self.rope_dim)
        self.down.copy_(basis.to(self.down.dtype))
        self.up_k.copy_(basis[:split].T.to(self.up_k.dtype))
        self.up_v.copy_(basis[split:].T.to(self.up_v.dtype))
        return float(s[: self.latent_dim].pow(2).sum() / s.pow(2).sum())

    # -- the forward: exact softmax over the reconstruction ------------------------------------------
    def _attend(self, q, k, v, causal, key_padding_mask):
        keys, values = self.expand(self.compress(k, v), k.index_select(-1, self.kept))
        return self._softmax._attend(q, keys, values, causal, key_padding_mask)

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        keys, values = self.expand(self.compress(k, v), k.index_select(-1, self.kept))
        return self._softmax.reference(q, keys, values, causal=causal, key_padding_mask=key_padding_mask)

    def attention_matrix(self, q, k, *, causal=False, key_padding_mask=None):
        """softmax(scale q k̃ᵀ) with k̃ the keys' reconstruction through the latent with zero values: one latent
        holds both, so with real values the reconstructed keys move with them (the weights this draws are the
        keys' own share)."""
        v = k.new_zeros(*k.shape[:-1], self.head_dim)
        keys, _ = self.expand(self.compress(k, v), k.index_select(-1, self.kept))
        eye = torch.eye(k.shape[-2], dtype=q.dtype, device=q.device).expand(*k.shape[:2], -1, -1)
        with torch.no_grad():
            return self._softmax(q, keys, eye, causal=causal, key_padding_mask=key_padding_mask)

    # -- decoding: the latents, read in the absorbed form -------------------------------------------
    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        return {
            "c": torch.empty(batch, 0, self.latent_dim, dtype=dtype, device=device),
            "k_rope": torch.empty(batch, heads, 0, self.rope_dim, dtype=dtype, device=device),
        }

    def _appended(self, k, v, state, keep):
        n = state.length
        c = torch.cat([state.tensors["c"], self.compress(k, v)], dim=1)
        k_rope = torch.cat([state.tensors["k_rope"], k.index_select(-1, self.kept)], dim=2)
        mask = masks_appended(state, state.tensors.get("mask"), n, keep, k.shape[2])
        extra = {} if mask is None else {"mask": mask}
        return c, k_rope, mask, state.advanced(k.shape[2], c=c, k_rope=k_rope, **extra)

    def _prefill(self, q, k, v, state, keep):
        return self._appended(k, v, state, keep)[3]

    def _step(self, q, k, v, state, keep):
        """Scores q̂ W_uk,hᵀ · c_s + q^R · k^R_s; output (Σ_s p_s c_s) W_uv,h: the latents never expanded.

        The absorbed form holds H · t scores a cached position where the expanded one holds 2 · Hkv · D keys
        and values; a chunk of more new queries than that (a prompt fed as a step) is expanded and read by the
        fused kernel, bottom-right causal, so no t × n scores are stored."""
        c, k_rope, mask, after = self._appended(k, v, state, keep)
        b, h, t, d = q.shape
        if h * t > 2 * self.kv_heads * d:
            keys, values = self.expand(c, k_rope)
            return self._softmax(q, keys, values, causal=True, key_padding_mask=mask), after
        kv, groups, n = self.kv_heads, h // self.kv_heads, c.shape[1]
        up_k = self.up_k.to(q.dtype).view(self.latent_dim, kv, d - self.rope_dim)  # (d_c, Hkv, D − r)
        up_v = self.up_v.to(q.dtype).view(self.latent_dim, kv, d)
        qg = q.unflatten(1, (kv, groups))  # (B, Hkv, G, t, D)
        q_latent = torch.einsum("bgmte,cge->bgmtc", qg.index_select(-1, self.rest), up_k)  # W_uk folded into q
        scores = torch.einsum("bgmtc,bnc->bgmtn", q_latent, c)
        if self.rope_dim:
            scores = scores + torch.einsum("bgmtr,bgnr->bgmtn", qg.index_select(-1, self.kept), k_rope)
        allowed = causal_mask(t, n, q.device)[None, None, None]
        if mask is not None:
            allowed = allowed & mask[:, None, None, None, :]
        seen = allowed.any(-1, keepdim=True)
        p = masked_softmax(scores * self._scale(q), allowed)  # an empty row: zeros, no NaN gradient
        weighted = torch.einsum("bgmtn,bnc->bgmtc", p, c)  # Σ_s p_s c_s
        out = torch.einsum("bgmtc,cge->bgmte", weighted, up_v).flatten(1, 2)
        return torch.where(seen.flatten(1, 2), out, 0.0), after

    # -- what the harness reads ------------------------------------------------------------------
    def flops(self, n_q, n_k, d, dv, causal):
        kv, width = self.kv_heads, self.down.shape[0]
        per_head = 2.0 * full_attention_pairs(n_q, n_k, causal) * (d + dv)
        latents = 2.0 * n_k * self.latent_dim * (width + kv * (2 * d - self.rope_dim))
        return per_head + latents / (self.num_heads or 1)  # (the harness counts per batch x head)

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        extra = batch * n_k * (self.latent_dim + self.down.shape[0] + 2 * self.kv_heads * d) * element_size
        return int(extra * (3 if backward else 1)) + self._softmax.memory_estimate(
            batch, heads, n_q, n_k, d, dv, element_size, causal, backward
        )

    def extra_repr(self) -> str:
        return f"latent_dim={self.latent_dim}, rope_dim={self.rope_dim}"
