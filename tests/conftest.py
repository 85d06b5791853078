"""Independent dense references (float64), input factories and the registry's test cases, shared by the tests.

Nothing here imports the variants' own helpers: these are the sources of truth the variants are
compared against. The shared contract tests take their cases from the registry (`registry_cases`:
every registered variant with each option set its spec gives as `examples`), so a variant is tested
the moment its file exists; `independent_reference` says what to add for one without a reference here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import variants


def make_qkv(b=2, h=2, n_q=16, n_k=None, d=8, dv=None, dtype=torch.float64, seed=0, requires_grad=True):
    """Random q (B,H,Nq,D), k (B,H,Nk,D), v (B,H,Nk,Dv)."""
    n_k = n_q if n_k is None else n_k
    dv = d if dv is None else dv
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, h, n_k, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, h, n_k, dv, generator=g, dtype=torch.float64).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def make_padding(b, n, seed=1, all_padded_row=True):
    """bool (B, N), True = real token; batch row 1 all padding when asked (and B > 1)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, n, generator=g) > 0.3
    if all_padded_row and b > 1:
        mask[1] = False
    return mask


def per_query_head(q, *kv):
    """The K/V-side tensors (B, Hkv, ...) with each head repeated for the H / Hkv query heads it serves (grouped-query
    attention's definition: query head h reads K/V head h // (H / Hkv))."""
    groups = q.shape[1] // kv[0].shape[1]
    return [t.repeat_interleave(groups, dim=1) for t in kv]


def ref_attention(q, k, v, allowed=None, scale=None):
    """softmax(q kᵀ · scale) v in float64 with a bool mask; rows with nothing allowed -> 0; k, v of fewer heads than
    q serve groups of query heads."""
    q, k, v = q.double(), *per_query_head(q, k.double(), v.double())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # all -inf rows
    return torch.einsum("bhij,bhjd->bhid", p, v)


def causal_and_padding(n_q, n_k, causal, kpm):
    """Causal with Nq < Nk: the queries are the last Nq positions (query i at Nk - Nq + i sees j <= it)."""
    allowed = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        i = torch.arange(n_k - n_q, n_k)[:, None]
        allowed = torch.arange(n_k)[None, :] <= i
    allowed = allowed[None, None]
    if kpm is not None:
        allowed = allowed & kpm[:, None, None, :]
    return allowed


def ref_full(q, k, v, causal=False, kpm=None, scale=None):
    return ref_attention(q, k, v, causal_and_padding(q.shape[-2], k.shape[-2], causal, kpm), scale)


def ref_sliding_window(q, k, v, window, n_global=0, causal=False, kpm=None, scale=None):
    n_q, n = q.shape[-2], k.shape[-2]
    i = torch.arange(n - n_q, n)[:, None]  # query positions
    j = torch.arange(n)[None, :]
    allowed = (i - j).abs() <= window
    if n_global:
        allowed = allowed | (i < n_global) | (j < n_global)
    return ref_attention(q, k, v, allowed[None, None] & causal_and_padding(n_q, n, causal, kpm), scale)


def linear_kernel(q, k, feature_map="elu", max_len=None, causal=False):
    """The kernel φ(q_i)·φ(k_j) of each feature map, written from its definition (not from features):
    elu: (elu(q)+1)·(elu(k)+1); relu: relu(q)·relu(k); taylor: 1 + s + s²/2 with s = q·k/√D;
    cosformer: relu(q_i)·relu(k_j) cos(π (i − j) / 2M), M = max_len or max(Nq, Nk), query i at
    position Nk − Nq + i when causal."""
    if feature_map == "elu":
        return (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)
    if feature_map == "relu":
        return q.relu() @ k.relu().transpose(-1, -2)
    if feature_map == "taylor":
        s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        return 1 + s + s * s / 2
    if feature_map == "cosformer":
        n_q, n_k = q.shape[-2], k.shape[-2]
        m = max_len or max(n_q, n_k)
        i = torch.arange(n_q, dtype=torch.float64)[:, None] + (n_k - n_q if causal else 0)
        j = torch.arange(n_k, dtype=torch.float64)[None, :]
        return (q.relu() @ k.relu().transpose(-1, -2)) * torch.cos(torch.pi * (i - j) / (2 * m))
    raise AssertionError(f"no reference kernel for feature_map={feature_map!r}")


def ref_linear(q, k, v, causal=False, kpm=None, eps=1e-6, feature_map="elu", max_len=None):
    """A = φ(Q) φ(K)ᵀ (masked), rows normalized by their sums + eps, times V; φ = elu + 1 unless told."""
    q, k, v = q.double(), k.double(), v.double()
    a = linear_kernel(q, k, feature_map, max_len, causal)
    a = a * causal_and_padding(q.shape[-2], k.shape[-2], causal, kpm)
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def ref_performer(q, k, v, projection, scale=None, causal=False, kpm=None):
    """FAVOR+ from the paper: φ(x) = exp(W x − ‖x‖²/2)/√m on a = q·scale·D^¼ and b = k·D^-¼ (so that
    E[φ(a)·φ(b)] = exp(scale q·k)), then A = φ(a)φ(b)ᵀ masked, rows normalized (no eps; empty rows 0)."""
    q, k, v, w = q.double(), k.double(), v.double(), projection.double()
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale

    def phi(x):
        return torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / w.shape[0] ** 0.5

    a = phi(q * scale * d**0.25) @ phi(k * d**-0.25).transpose(-1, -2)
    a = a * causal_and_padding(q.shape[-2], k.shape[-2], causal, kpm)
    return (a @ v) / a.sum(-1, keepdim=True).clamp_min(1e-300)  # a row that sees no key: 0 / 1e-300 = 0


def ref_memory_compressed(q, k, v, module, causal=False, kpm=None):
    """The module's conv applied with F.conv1d (groups = heads), then dense attention with the slot mask."""
    b, h, n, d = k.shape
    c = module.compression
    k, v = k.double(), v.double()
    if kpm is not None:
        k = k * kpm[:, None, :, None]
        v = v * kpm[:, None, :, None]
    pad = (-n) % c

    def conv(x, weight, bias):
        x = F.pad(x, (0, 0, 0, pad))  # (B, H, N', D)
        bx, hx, nx, dx = x.shape
        y = F.conv1d(
            x.permute(0, 1, 3, 2).reshape(bx, hx * dx, nx), weight.double(), bias.double(), stride=c, groups=hx
        )
        return y.view(bx, hx, -1, y.shape[-1]).permute(0, 1, 3, 2)  # (B, H, M, Dout)

    kc, vc = conv(k, module.k_weight, module.k_bias), conv(v, module.v_weight, module.v_bias)
    m = kc.shape[2]
    real = torch.ones(b, n + pad, dtype=torch.bool)
    real[:, n:] = False
    if kpm is not None:
        real[:, :n] = kpm
    slot_ok = real.view(b, m, c).any(-1)  # a slot of padding only is masked
    n_q = q.shape[-2]
    if not causal:
        return ref_attention(q, kc, vc, slot_ok[:, None, None, :].expand(b, 1, n_q, m))
    i = torch.arange(n - n_q, n)[:, None]  # query positions: the last Nq
    visible_slot = ((torch.arange(m)[None, :] + 1) * c - 1 <= i)[None, None] & slot_ok[:, None, None, :]
    j = torch.arange(n)[None, :]
    own_block = ((j >= ((i + 1) // c) * c) & (j <= i))[None, None]
    if kpm is not None:
        own_block = own_block & kpm[:, None, None, :]
    keys, values = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
    return ref_attention(
        q, keys, values, torch.cat([visible_slot.expand(b, 1, n_q, m), own_block.expand(b, 1, n_q, n)], -1)
    )


# each takes the variant as built (its options) and the scale it applies to q·k (`_scale`: its `scale` option, or D ** -0.5)
def _ref_full(attn, q, k, v, causal, kpm):
    return ref_full(q, k, v, causal, kpm, scale=attn._scale(q))


def _ref_sliding_window(attn, q, k, v, causal, kpm):
    return ref_sliding_window(q, k, v, attn.window, attn.global_tokens, causal, kpm, scale=attn._scale(q))


def ref_hedgehog(x, weight, bias):
    """Hedgehog's map from its paper: z = x W_h + b_h, φ(x) = [softmax(z), softmax(−z)] over the features."""
    z = torch.einsum("bhnd,hdf->bhnf", x.double(), weight.double()) + bias.double()[None, :, None]
    return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)


def rope_undone(x, positions, theta):
    """RoPE undone, from its definition: each pair (x_i, x_{i+D/2}) is a complex number that RoPE turned by
    p θ^(−2i/D) at position p; turned back by the conjugate (float64)."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    angle = positions.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = z * torch.polar(torch.ones_like(angle), -angle)
    return torch.cat([z.real, z.imag], -1)


def _hedgehog_qk(attn, q, k, causal=True):
    """q and k through the variant's learned maps (queries times the scale first, as the variants take them);
    with feature_inputs="pre_rope", rotated back first (keys at 0 .. Nk − 1, causal queries the last Nq)."""
    if getattr(attn, "feature_inputs", "post_rope") == "pre_rope":
        n_q, n_k = q.shape[-2], k.shape[-2]
        start = n_k - n_q if causal else 0
        q = rope_undone(q, torch.arange(start, start + n_q), attn.rope_theta)
        k = rope_undone(k, torch.arange(n_k), attn.rope_theta)
    return ref_hedgehog(q, attn.q_features.weight, attn.q_features.bias), ref_hedgehog(
        k, attn.k_features.weight, attn.k_features.bias
    )


def _ref_linear(attn, q, k, v, causal, kpm):
    if attn.feature_map == "hedgehog":  # the kernel φ(q)·φ(k) of the learned maps, rows normalised (+ eps)
        factor = 1.0 if attn.scale is None or not attn.query_scaled else attn.scale
        fq, fk = _hedgehog_qk(attn, q.double() * factor, k, causal)
        a = (fq @ fk.transpose(-1, -2)) * causal_and_padding(q.shape[-2], k.shape[-2], causal, kpm)
        return (a @ v.double()) / (a.sum(-1, keepdim=True) + attn.eps)
    d = attn.feature_dim or q.shape[-1]  # the dims of q and k that enter φ
    q, k = q[..., :d], k[..., :d]
    return ref_linear(
        q if attn.scale is None else q * attn.scale,
        k,
        v,
        causal,
        kpm,
        eps=attn.eps,
        feature_map=attn.feature_map,
        max_len=attn.max_len,
    )


def _ref_bilinear(attn, q, k, v, causal, kpm):
    return ref_full(
        torch.einsum("bhid,hde->bhie", q.double(), attn.weight.double()), k, v, causal, kpm, scale=attn._scale(q)
    )


def _ref_linformer(attn, q, k, v, causal, kpm):
    """softmax(Q (E K)ᵀ · scale) (F V), padded keys zeroed first (E, F: their first Nk columns)."""
    assert not causal, "linformer is not causal"
    n = k.shape[-2]
    k, v = k.double(), v.double()
    if kpm is not None:
        k, v = k * kpm[:, None, :, None], v * kpm[:, None, :, None]
    kp = torch.einsum("hrn,bhnd->bhrd", attn.e[:, :, :n].double(), k)
    vp = torch.einsum("hrn,bhnd->bhrd", attn.f[:, :, :n].double(), v)
    out = ref_attention(q, kp, vp, None, attn._scale(q))
    return out if kpm is None else out * kpm.any(-1)[:, None, None, None]


def ref_nystrom(q, k, v, landmarks, iterations, scale=None, kpm=None):
    """Nyströmformer from the paper, every matrix stored: landmarks = means of m segments (segment l:
    positions [l N / m, (l+1) N / m) rounded down; padded positions left out, of queries too when
    Nq = Nk), pinv by the paper's iteration from Z0 = Aᵀ / (‖A‖₁ ‖A‖∞)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, h, n_q, _ = q.shape
    n_k, m = k.shape[-2], landmarks

    def means(x, valid):
        n = x.shape[-2]
        out = torch.zeros(b, h, m, x.shape[-1], dtype=torch.float64)
        ok = torch.zeros(b, m, dtype=torch.bool)
        for l in range(m):
            lo, hi = l * n // m, (l + 1) * n // m
            for e in range(b):
                rows = [i for i in range(lo, hi) if valid is None or valid[e, i]]
                if rows:
                    out[e, :, l] = x[e, :, rows].mean(1)
                    ok[e, l] = True
        return out, ok

    qm, _ = means(q, kpm if kpm is not None and n_q == n_k else None)
    km, k_ok = means(k, kpm)

    def softmax(s, allowed):
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        return torch.nan_to_num(p, nan=0.0)

    real = torch.ones(b, n_k, dtype=torch.bool) if kpm is None else kpm
    left = softmax(q @ km.transpose(-1, -2) * scale, k_ok[:, None, None, :])
    a = softmax(qm @ km.transpose(-1, -2) * scale, k_ok[:, None, None, :])
    right = softmax(qm @ k.transpose(-1, -2) * scale, real[:, None, None, :])
    eye = torch.eye(m, dtype=torch.float64)
    norm = a.abs().sum(-2).amax(-1) * a.abs().sum(-1).amax(-1)
    z = a.transpose(-1, -2) / torch.where(norm > 0, norm, 1.0)[..., None, None]  # pinv(0) = 0
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return left @ z @ right @ v


def _ref_nystrom(attn, q, k, v, causal, kpm):
    assert not causal, "nystrom is not causal"
    return ref_nystrom(q, k, v, attn.landmarks, attn.pinv_iterations, attn._scale(q), kpm)


def _ref_additive(attn, q, k, v, causal, kpm):
    """Bahdanau: score(i, j) = scale · v_h · tanh(q_i W_q + k_j W_k), every pair stored, then softmax."""
    q, k = q.double(), k.double()
    hq = torch.einsum("bhid,hda->bhia", q, attn.w_q.double())
    hk = torch.einsum("bhjd,hda->bhja", k, attn.w_k.double())
    scores = torch.einsum("bhija,ha->bhij", torch.tanh(hq[:, :, :, None] + hk[:, :, None]), attn.v.double())
    scale = 1.0 if attn.scale is None else attn.scale
    p = torch.softmax(
        (scores * scale).masked_fill(~causal_and_padding(q.shape[-2], k.shape[-2], causal, kpm), float("-inf")), -1
    )
    return torch.nan_to_num(p, nan=0.0) @ v.double()


def _ref_performer(attn, q, k, v, causal, kpm):
    return ref_performer(q, k, v, attn.projection, attn.scale, causal, kpm)


def _ref_memory_compressed(attn, q, k, v, causal, kpm):
    return ref_memory_compressed(q, k, v, attn, causal, kpm)


def ref_recurrence(q, k, v, scale, log_decay=None, beta=None, kpm=None):
    """The textbook recurrence, one position after another, in float64; the queries are the last Nq positions.

    gated (beta None):  S_t = diag(exp(log_decay_t)) S_{t-1} + k_t v_tᵀ
    delta rule:         S_t = (I − β_t k_t k_tᵀ) diag(exp(log_decay_t)) S_{t-1} + β_t k_t v_tᵀ   (log_decay None: 0)
    o_t = scale · q_tᵀ S_t; a padded position (kpm False) leaves the state as it was.
    """
    q, k, v = q.double(), k.double(), v.double()
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    s = torch.zeros(b, h, d, v.shape[-1], dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    outs = []
    for t in range(n_k):
        kt, vt = k[:, :, t], v[:, :, t]  # (B, H, D), (B, H, Dv)
        a = torch.ones(b, h, 1, 1, dtype=torch.float64) if log_decay is None else log_decay[:, :, t].double().exp()
        a = a if a.dim() == 4 else (a[..., None, None] if a.dim() == 2 else a[..., None])  # scalar or per key dim
        write = torch.einsum("bhd,bhe->bhde", kt, vt)
        if beta is None:
            new = a * s + write
        else:
            bt = beta[:, :, t].double()[..., None, None]
            new = torch.matmul(eye - bt * torch.einsum("bhd,bhe->bhde", kt, kt), a * s) + bt * write
        s = new if kpm is None else torch.where(kpm[:, t, None, None, None], new, s)
        i = t - (n_k - n_q)
        if i >= 0:
            outs.append(scale * torch.einsum("bhd,bhde->bhe", q[:, :, i].double(), s))
    return torch.stack(outs, dim=2)


def _scale_of(attn, q):
    return q.shape[-1] ** -0.5 if attn.scale is None else attn.scale


def _ssd_decay(k, decay):
    """Mamba-2's decay from its parameters: (log a = −exp(A_log) softplus(k·w + b), Δ)."""
    dt = F.softplus(torch.einsum("bhld,hd->bhl", k, decay.w_dt.double()) + decay.b_dt.double()[:, None])
    return -decay.a_log.double().exp()[:, None] * dt, dt


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def _recurrence_qk(attn, q, k, scale):
    """(q, k, the factor of q in o = factor · qᵀ S) as the recurrence takes them: through the learned feature maps
    where the variant has them, q times the scale first where it is a factor of q (then the factor is 1)."""
    if attn.feature_map != "hedgehog":
        return q.double(), k.double(), scale
    if attn.spec.scale_is_query_factor:  # (φ_q of q times the scale, or of q itself: query_scaled=False)
        return (*_hedgehog_qk(attn, q.double() * (scale if attn.query_scaled else 1.0), k), 1.0)
    return (*_hedgehog_qk(attn, q, k), scale)


# the recurrences' gates act on the keys: per K/V head (grouped-query), then each state read by its query heads
def _ref_retention(attn, q, k, v, causal, kpm):
    h = k.shape[1]  # the K/V heads, or the query heads where a feature map has K repeated to them
    kv_heads = attn.num_kv_heads or h
    q, k, scale = _recurrence_qk(attn, q, k, _scale_of(attn, q))
    gamma = 1 - 2.0 ** (-5 - torch.arange(kv_heads, dtype=torch.float64))  # RetNet's decay, one per K/V head
    gamma = gamma.repeat_interleave(h // kv_heads)
    log_decay = gamma.log()[None, :, None].expand(k.shape[0], h, k.shape[2])
    k, v, log_decay = per_query_head(q, k, v, log_decay)
    return ref_recurrence(q, k, v, scale, log_decay, kpm=kpm)


def _ref_mamba2(attn, q, k, v, causal, kpm):
    q, k, scale = _recurrence_qk(attn, q, k, _scale_of(attn, q))
    log_decay, dt = _ssd_decay(k, attn.dt)
    k, v, log_decay = per_query_head(q, k, v.double() * dt[..., None], log_decay)
    return ref_recurrence(q, k, v, scale, log_decay, kpm=kpm)


def _ref_gla(attn, q, k, v, causal, kpm):
    q, k, scale = _recurrence_qk(attn, q, k, _scale_of(attn, q))
    gate = torch.sigmoid(torch.einsum("bhld,hde->bhle", k, attn.w_alpha.double()) + attn.b_alpha.double()[:, None])
    log_decay = (gate ** (1 / 16)).log().clamp_min(-5.0)  # α = σ(·)^(1/16), its log floored at −5 (gla.py)
    k, v, log_decay = per_query_head(q, k, v, log_decay)
    return ref_recurrence(q, k, v, scale, log_decay, kpm=kpm)


def _beta(k, gate):
    return torch.sigmoid(torch.einsum("bhld,hd->bhl", k.double(), gate.w.double()) + gate.b.double()[:, None])


def _ref_deltanet(attn, q, k, v, causal, kpm):
    q, k, scale = _recurrence_qk(attn, q, k, _scale_of(attn, q))
    k, v, beta = per_query_head(q, _unit(k), v, _beta(k, attn.beta))
    return ref_recurrence(_unit(q), k, v, scale, beta=beta, kpm=kpm)


def _ref_gated_deltanet(attn, q, k, v, causal, kpm):
    q, k, scale = _recurrence_qk(attn, q, k, _scale_of(attn, q))
    log_decay, _ = _ssd_decay(k, attn.decay)
    k, v, log_decay, beta = per_query_head(q, _unit(k), v, log_decay, _beta(k, attn.beta))
    return ref_recurrence(_unit(q), k, v, scale, log_decay, beta, kpm)


def _ref_kda(attn, q, k, v, causal, kpm):
    """Kimi Delta Attention: the delta rule after a decay per key channel, log α = max(−exp(A_log) softplus(k W +
    b), −5), from its parameters."""
    q, k, scale = _recurrence_qk(attn, q, k, _scale_of(attn, q))
    d = attn.decay
    dt = F.softplus(torch.einsum("bhld,hde->bhle", k, d.w.double()) + d.b.double()[:, None])
    log_decay = (-d.a_log.double().exp()[:, None, None] * dt).clamp_min(-5.0)
    k, v, log_decay, beta = per_query_head(q, _unit(k), v, log_decay, _beta(k, attn.beta))
    return ref_recurrence(_unit(q), k, v, scale, log_decay, beta, kpm)


def ref_moba(q, k, v, block, top_k, kpm=None, scale=None):
    """MoBA by its definition, query by query in float64: the top_k earlier blocks by q · mean(real keys of the
    block) (all of them where fewer exist; blocks without a real key never chosen), plus the own block up to the
    query; softmax over those keys (real ones only)."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    real = torch.ones(b, n_k, dtype=torch.bool) if kpm is None else kpm
    out = torch.zeros(b, h, n_q, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n_q):
                pos = n_k - n_q + i
                own = pos // block
                gates = {}
                for j in range(own):
                    members = [s for s in range(j * block, (j + 1) * block) if real[bi, s]]
                    if members:
                        gates[j] = float(q[bi, hi, i].detach() @ k[bi, hi, members].detach().mean(0))
                chosen = sorted(gates, key=gates.get, reverse=True)[:top_k]
                keys = [s for j in chosen for s in range(j * block, (j + 1) * block)] + list(
                    range(own * block, pos + 1)
                )
                keys = [s for s in keys if real[bi, s]]
                if keys:
                    w = torch.softmax(k[bi, hi, keys] @ q[bi, hi, i] * scale, dim=0)
                    out[bi, hi, i] = w @ v[bi, hi, keys]
    return out


def _ref_moba(attn, q, k, v, causal, kpm):
    return ref_moba(q, k, v, attn.block, attn.top_k, kpm, attn.scale)


def _ref_window_linear(attn, q, k, v, causal, kpm):
    """LoLCATs' hybrid from its definition, every pair stored: softmax weights exp(s − m) (m the window's row max)
    times σ(window_factor) on the keys |i − j| <= w up to the query, Hedgehog kernel values φ(q·scale)·φ(k) on the
    older ones, one normalizer over both; a row that sees no key gives 0."""
    assert causal, "window_linear is causal only"
    q, k, v = q.double(), k.double(), v.double()
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = attn._scale(q)
    i = torch.arange(n_k - n_q, n_k)[:, None]
    j = torch.arange(n_k)[None, :]
    real = torch.ones(q.shape[0], n_k, dtype=torch.bool) if kpm is None else kpm
    window = ((j <= i) & (i - j <= attn.window))[None, None] & real[:, None, None, :]
    older = (i - j > attn.window)[None, None] & real[:, None, None, :]
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~window, float("-inf"))
    top = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    fq, fk = _hedgehog_qk(attn, q * (scale if attn.query_scaled else 1.0), k)
    lin = (fq @ fk.transpose(-1, -2)) * older
    f = torch.sigmoid(attn.window_factor.double())[:, None, None]
    weights = f * e + lin
    den = weights.sum(-1, keepdim=True)
    return (weights @ v) / torch.where(den > 0, den, torch.ones_like(den))


def _ref_forgetting(attn, q, k, v, causal, kpm):
    """The Forgetting Transformer by its definition, row by row in float64: s_ij = scale q_i·k_j + Σ_{l=j+1..i}
    log f_l with f_l = σ(k_l·w + b) per K/V head (0 at a padded position: it forgets nothing), softmax over the
    real keys j <= i; a row with none gives 0."""
    assert causal, "forgetting is causal only"
    q, k, v = q.double(), k.double(), v.double()
    n_q, n_k = q.shape[-2], k.shape[-2]
    real = torch.ones(q.shape[0], n_k, dtype=torch.bool) if kpm is None else kpm
    log_f = (
        torch.nn.functional.logsigmoid(
            torch.einsum("bhld,hd->bhl", k, attn.gate.w.double()) + attn.gate.b.double()[:, None]
        )
        * real[:, None, :].double()
    )
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            g = h // group
            for row in range(n_q):
                i = n_k - n_q + row
                keys = [j for j in range(i + 1) if real[b, j]]
                if not keys:
                    continue
                s = torch.stack(
                    [q[b, h, row] @ k[b, g, j] * _scale_of(attn, q) + log_f[b, g, j + 1 : i + 1].sum() for j in keys]
                )
                out[b, h, row] = torch.softmax(s, 0) @ v[b, g, keys]
    return out


def _ref_dsa(attn, q, k, v, causal, kpm):
    """DeepSeek Sparse Attention by its definition, query by query in float64: the lightning indexer's I_ts =
    Σ_j w_tj ReLU(q̄_t W_q,j · k_s W_k) with w_tj = q̄_t·u_j + w0_j (q̄: the mean of the K/V head's queries), the
    top_k real keys s <= t by I (ties to the earlier key), softmax over those."""
    assert causal, "dsa is causal only"
    q, k, v = q.double(), k.double(), v.double()
    qd, kd = q.detach(), k.detach()  # (the selection is discrete: no gradient through the indexer)
    ix = attn.indexer
    n_q, n_k = q.shape[-2], k.shape[-2]
    groups = q.shape[1] // k.shape[1]
    real = torch.ones(q.shape[0], n_k, dtype=torch.bool) if kpm is None else kpm
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        for g in range(k.shape[1]):
            for row in range(n_q):
                t = n_k - n_q + row
                qm = qd[b, g * groups : (g + 1) * groups, row].mean(0)
                score = {}
                for s in range(t + 1):
                    if real[b, s]:
                        ks = kd[b, g, s] @ ix.w_k[g].detach().double()
                        score[s] = sum(
                            float(qm @ ix.u[g, j].detach().double() + ix.w0[g, j].detach())
                            * max(0.0, float((qm @ ix.w_q[g, j].detach().double()) @ ks))
                            for j in range(ix.w_q.shape[1])
                        )
                chosen = sorted(score, key=lambda s: (-score[s], s))[: attn.top_k]
                if not chosen:
                    continue
                for h in range(g * groups, (g + 1) * groups):
                    w = torch.softmax(k[b, g, chosen] @ q[b, h, row] * _scale_of(attn, q), 0)
                    out[b, h, row] = w @ v[b, g, chosen]
    return out


def _ref_mla(attn, q, k, v, causal, kpm):
    """Multi-head latent attention by its definition in float64: each position's latent c = [k̂, v] W_down (k̂: every
    K/V head's key without its first rope_dim / 2 rotary pairs), keys [kept dims, (c W_uk)_h] and values (c W_uv)_h,
    then exact softmax."""
    q, k, v = q.double(), k.double(), v.double()
    b, kv, n, d = k.shape
    half = attn.rope_dim // 2
    kept = list(range(half)) + [d // 2 + i for i in range(half)]
    rest = [i for i in range(d) if i not in kept]
    x = torch.cat([k[..., rest].permute(0, 2, 1, 3).reshape(b, n, -1), v.permute(0, 2, 1, 3).reshape(b, n, -1)], -1)
    c = x @ attn.down.double()
    keys = k.clone()
    keys[..., rest] = (c @ attn.up_k.double()).view(b, n, kv, len(rest)).permute(0, 2, 1, 3)
    values = (c @ attn.up_v.double()).view(b, n, kv, d).permute(0, 2, 1, 3)
    return _ref_full(attn, q, keys, values, causal, kpm)


def _ref_rwkv7(attn, q, k, v, causal, kpm):
    """RWKV-7 by its equations, position by position in float64: w = exp(−e^−½ σ(k W_w + b_w)), a = σ(k W_a + b_a),
    κ̂ = (k ⊙ ξ) / ‖k ⊙ ξ‖; S_t = (diag(w_t) − (a_t ⊙ κ̂_t) κ̂_tᵀ) S_{t-1} + k_t v_tᵀ per K/V head (a padded position
    leaves S as it was); o_t = scale · q_tᵀ S_t for each query head of the group."""
    g = attn.gates
    q, k, v = q.double(), k.double(), v.double()
    b, kv, n_k, d = k.shape
    n_q, groups = q.shape[2], q.shape[1] // kv
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(kv):
            s = torch.zeros(d, v.shape[-1], dtype=torch.float64)
            for t in range(n_k):
                x = k[bi, h, t]
                if kpm is None or kpm[bi, t]:
                    w = torch.exp(-math.exp(-0.5) * torch.sigmoid(x @ g.w_w[h].double() + g.b_w[h].double()))
                    a = torch.sigmoid(x @ g.w_a[h].double() + g.b_a[h].double())
                    kk = x * g.xi[h].double()
                    kk = kk / kk.norm().clamp_min(1e-6)
                    s = (torch.diag(w) - torch.outer(a * kk, kk)) @ s + torch.outer(x, v[bi, h, t])
                row = t - (n_k - n_q)
                if row >= 0:
                    for m in range(h * groups, (h + 1) * groups):
                        out[bi, m, row] = _scale_of(attn, q) * q[bi, m, row] @ s
    return out


def _ref_log_linear(attn, q, k, v, causal, kpm):
    """Log-linear Mamba-2 by its definition, query by query in float64: o_t = Σ_{s<=t} λ_t^ℓ a_ts (scale q_t·k_s)
    Δ_s v_s with ℓ = bit_length(t XOR s), λ = softplus(scale q W_λ + b_λ) per query head, Mamba-2's a and Δ per K/V
    head (a padded position: no decay, no write)."""
    assert causal, "log_linear is causal only"
    q, k, v = q.double(), k.double(), v.double()
    n_q, n_k = q.shape[-2], k.shape[-2]
    real = torch.ones(q.shape[0], n_k, dtype=torch.bool) if kpm is None else kpm
    log_a, dt = _ssd_decay(k, attn.dt)
    log_a, dt = log_a * real[:, None].double(), dt * real[:, None].double()
    lam = F.softplus(
        torch.einsum("bhnd,hdl->bhnl", q * _scale_of(attn, q), attn.w_level.double()) + attn.b_level.double()[:, None]
    )
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    for h in range(q.shape[1]):
        g = h // groups
        for row in range(n_q):
            t = n_k - n_q + row
            for s in range(t + 1):
                level = (t ^ s).bit_length()
                decay = torch.exp(log_a[:, g, s + 1 : t + 1].sum(-1))
                w = lam[:, h, row, level] * decay * (q[:, h, row] * k[:, g, s]).sum(-1) * _scale_of(attn, q)
                out[:, h, row] += (w * dt[:, g, s])[:, None] * v[:, g, s]
    return out


# the function each reference computes, keyed by the variant that defines it; a variant whose spec says
# another computes the same function (`same_function_as`) is checked against that one's reference
INDEPENDENT_REFERENCES = {
    "full": _ref_full,
    "sliding_window": _ref_sliding_window,
    "linear": _ref_linear,
    "memory_compressed": _ref_memory_compressed,
    "performer": _ref_performer,
    "bilinear": _ref_bilinear,
    "linformer": _ref_linformer,
    "nystrom": _ref_nystrom,
    "additive": _ref_additive,
    "retention": _ref_retention,
    "mamba2": _ref_mamba2,
    "gla": _ref_gla,
    "deltanet": _ref_deltanet,
    "gated_deltanet": _ref_gated_deltanet,
    "moba": _ref_moba,
    "window_linear": _ref_window_linear,
    "forgetting": _ref_forgetting,
    "kda": _ref_kda,
    "dsa": _ref_dsa,
    "mla": _ref_mla,
    "rwkv7": _ref_rwkv7,
    "log_linear": _ref_log_linear,
}


def reference_key(name: str) -> str:
    """The variant whose function `name` computes (itself, or its spec's `same_function_as`, followed)."""
    seen = [name]
    while (target := variants.variant_class(seen[-1]).spec.same_function_as) is not None and target not in seen:
        seen.append(target)
    return seen[-1]


def independent_reference(name, attn, q, k, v, causal=False, kpm=None):
    """The tests' own float64 definition of variant `name` (built as `attn`) on q, k, v."""
    key = reference_key(name)
    if key not in INDEPENDENT_REFERENCES:
        pytest.fail(
            f"{name} has no independent reference in tests/conftest.py: write its dense definition there "
            f"(from the paper, not from the variant's code) and add it to INDEPENDENT_REFERENCES as {key!r}"
        )
    if attn.repeats_kv_reason():  # grouped-query inputs repeated to the query heads first, as the variant says it does
        k, v = per_query_head(q, k, v)
    return INDEPENDENT_REFERENCES[key](attn, q, k, v, causal, kpm)


def shipped() -> list[str]:
    """The variants of the package (each a file of `variants/methods/`), not the test-only ones some tests register."""
    return [
        name for name in variants.available() if variants.variant_class(name).__module__.startswith("variants.methods.")
    ]


def registry_cases(
    device: str = "cpu", backward: bool = True, shapes: bool = True, causal: bool = False, non_causal: bool = False
) -> list:
    """pytest params (name, options) for every variant of the package (a file of `variants/methods/`; not
    the test-only variants some tests register) that runs on `device` (with a backward there when
    `backward`; causal when `causal`; non-causal when `non_causal`), one per option set of its spec's `examples`; id: the name and the options."""
    cases = []
    for name in shipped():
        cls = variants.variant_class(name)
        if cls.unavailable_reason(device) or (backward and cls.backward_unsupported_reason(device)):
            continue
        if causal and not cls.spec.supports_causal:
            continue
        if non_causal and not cls.spec.supports_non_causal:
            continue
        for options in cls.spec.example_options():
            cases.append(pytest.param(name, options, id="-".join([name, *(f"{k}{v}" for k, v in options.items())])))
    return cases


def skip_unless_causal(name: str, causal: bool) -> None:
    """Skip a case of a mode the method does not compute: causal for linformer and nystrom, non-causal for the
    recurrences and moba (their errors are tested apart)."""
    reason = variants.variant_class(name).mode_unsupported_reason(causal)
    if reason:
        pytest.skip(reason)


def natural_causal(name: str) -> bool:
    """The mode a case of `name` runs in when a test does not care: non-causal unless the method is causal only."""
    return not variants.variant_class(name).spec.supports_non_causal


def build_case(name: str, options: dict, heads: int = 2, head_dim: int = 8, dtype=torch.float64):
    """The variant with its example options and the shape hints of the inputs it will see (variants with
    per-head parameters need them; every variant checks them)."""
    return variants.build(name, **{"num_heads": heads, "head_dim": head_dim, **options}).to(dtype)


def assert_close_with_grads(out, ref, inputs, atol=1e-9, rtol=1e-7, seed=3):
    """Outputs equal, and the gradients of a random projection of them equal, for every input."""
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    inputs = [t for t in inputs if t.requires_grad]
    got = torch.autograd.grad(out, inputs, grad_out.to(out.dtype), retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(ref, inputs, grad_out.to(ref.dtype), allow_unused=True)
    for i, (a, b) in enumerate(zip(got, want)):
        a = torch.zeros_like(inputs[i]) if a is None else a
        b = torch.zeros_like(inputs[i]) if b is None else b
        torch.testing.assert_close(
            a.double(), b.double(), atol=atol * 10, rtol=rtol * 10, msg=lambda m: f"grad of input {i}: {m}"
        )


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from torch's seed 0 (the thread count is left as torch set it)."""
    torch.manual_seed(0)
    yield


def case_id(**kw) -> str:
    """Readable parametrize ids: N257-w64-causal."""
    parts = []
    for key, val in kw.items():
        if isinstance(val, bool):
            if val:
                parts.append(key)
        else:
            parts.append(f"{key}{val}")
    return "-".join(parts) or "base"
