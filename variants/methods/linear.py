"""Linear attention: Katharopoulos et al. 2020, "Transformers are RNNs", with the feature maps the field compares.

Softmax's exp(q·k) is replaced by a kernel φ(q)·φ(k) of features φ: (B, H, N, D) -> (B, H, N, F), so
the sums reassociate:

    out_i = φ(q_i)ᵀ (Σ_j φ(k_j) v_jᵀ) / (φ(q_i)ᵀ Σ_j φ(k_j) + eps)

The feature maps (`feature_map`), each a small class below (`FeatureMap` lists them with their formulas):
elu (elu + 1, the default), relu, taylor (Based's 2nd-order Taylor expansion of exp, on a reduced head
dim), cosformer (ReLU features re-weighted by distance) and hedgehog (learned per head, LoLCATs' map).
`performer` (performer.py) is this same scan with positive random features. How the scan is computed,
forward and backward: `FeatureMapAttention`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._base import AttentionVariant, VariantSpec, dense_mask, register
from .._utils import pad_to_multiple, spans

GROUP_FEATURES = 512 * 256  # positions x features computed at once (512 positions up to F = 256)


# -- feature maps ------------------------------------------------------------------------------


def elu_feature_map(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1 = exp(min(x, 0)) + max(x, 0), positive everywhere.

    Written with exp and clamp, which run several times faster on CPU than torch's elu kernel;
    the value and the gradient (1 at x = 0 as well) are elu's.
    """
    return x.clamp_max(0).exp_() + torch.relu(x)  # relu, not clamp_min: its gradient at 0 is 0


def elu_feature_map_grad(x: Tensor) -> Tensor:
    """φ'(x): 1 for x > 0, exp(x) for x <= 0 (elu's gradient, 1 at x = 0 as well)."""
    return x.clamp_max(0).exp_()


class FeatureMap:
    """φ of a kernel φ(q)·φ(k): what the scan needs of it.

    `apply(x, start, consts, query)` maps rows x (B, H, L, D) — positions start .. start + L - 1 —
    to features (B, H, L, F); `consts` are per-call constants from `setup` (no gradient flows
    through them); `query` says whether x are queries or keys (a map may treat them apart).

    The feature maps (`feature_map`), each a small class below:
      elu        φ(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020), F = D; the default.
      relu       φ(x) = max(x, 0) (Zoology's and cosFormer's baseline), F = D.
      taylor     the 2nd-order Taylor expansion of exp(q·k/√D) (Based, Arora et al. 2024):
                 φ(x) = [1, x', x' ⊗ x' / √2] with x' = x / D^¼, so φ(q)·φ(k) = 1 + s + s²/2, s = q·k/√D;
                 F = 1 + D + D² — used on a reduced head dim (Based: 16), not on D = 64 (F = 4161).
      cosformer  ReLU features re-weighted by position (Qin et al. 2022, "cosFormer"):
                 φ(x_i) = [relu(x_i) cos(π i / 2M), relu(x_i) sin(π i / 2M)], F = 2D, so
                 φ(q_i)·φ(k_j) = relu(q_i)·relu(k_j) cos(π (i − j) / 2M): nearby tokens weigh more.
      hedgehog   learned (Zhang et al. 2024, "The Hedgehog & the Porcupine"; LoLCATs' map): per head
                 φ(x) = [softmax(x W + b), softmax(−x W − b)] over F' features, F = 2F', with separate
                 W, b for queries and keys, trained to imitate softmax attention (`Hedgehog` below).
    """

    name = ""

    def dim(self, d: int) -> int:
        """F, the number of features of a D-dim row."""
        return d

    def setup(self, q: Tensor, k: Tensor, keep: Tensor | None) -> dict:
        """Per-call constants (positions' scale, a stabilizer...), computed once before the scan (q: for its
        shape; it arrives without the factor the scan multiplies each group of it by)."""
        return {}

    def apply(self, x: Tensor, start: int, consts: dict, query: bool) -> Tensor:
        raise NotImplementedError

    def vjp(self, x: Tensor, grad: Tensor, start: int, consts: dict, query: bool) -> Tensor:
        """dL/dx given dL/dφ(x): by autograd on `apply` unless the map writes it out."""
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(self.apply(x, start, consts, query), x, grad)
        return dx


class EluFeatures(FeatureMap):
    name = "elu"

    def apply(self, x, start, consts, query):
        return elu_feature_map(x)

    def vjp(self, x, grad, start, consts, query):
        return grad * elu_feature_map_grad(x)


class ReluFeatures(FeatureMap):
    name = "relu"

    def apply(self, x, start, consts, query):
        return torch.relu(x)

    def vjp(self, x, grad, start, consts, query):
        return grad * (x > 0).to(grad.dtype)


class TaylorFeatures(FeatureMap):
    """[1, x', vec(x' x'ᵀ) / √2], x' = x / D^¼: φ(q)·φ(k) = 1 + s + s²/2 with s = q·k / √D."""

    name = "taylor"

    def dim(self, d):
        return 1 + d + d * d

    def apply(self, x, start, consts, query):
        y = x * x.shape[-1] ** -0.25
        outer = (y[..., :, None] * y[..., None, :]).flatten(-2) * 0.5**0.5  # (B, H, L, D²)
        return torch.cat([torch.ones_like(y[..., :1]), y, outer], dim=-1)

    def vjp(self, x, grad, start, consts, query):
        d = x.shape[-1]
        c = d**-0.25
        y = x * c
        g2 = grad[..., 1 + d :].unflatten(-1, (d, d))  # (B, H, L, D, D)
        dy = grad[..., 1 : 1 + d] + torch.matmul(g2 + g2.transpose(-1, -2), y[..., None])[..., 0] * 0.5**0.5
        return dy * c


class CosformerFeatures(FeatureMap):
    """[relu(x_i) cos(π i / 2M), relu(x_i) sin(π i / 2M)] for the row at position i."""

    name = "cosformer"

    def __init__(self, max_len: int | None):
        self.max_len = max_len

    def dim(self, d):
        return 2 * d

    def setup(self, q, k, keep):
        m = self.max_len if self.max_len is not None else max(q.shape[-2], k.shape[-2])
        return {"angle": math.pi / (2 * m)}

    def _cos_sin(self, x, start, consts):
        i = torch.arange(start, start + x.shape[-2], device=x.device, dtype=x.dtype)[:, None] * consts["angle"]
        return torch.cos(i), torch.sin(i)  # (L, 1) each

    def apply(self, x, start, consts, query):
        cos, sin = self._cos_sin(x, start, consts)
        r = torch.relu(x)
        return torch.cat([r * cos, r * sin], dim=-1)

    def vjp(self, x, grad, start, consts, query):
        cos, sin = self._cos_sin(x, start, consts)
        d = x.shape[-1]
        return (grad[..., :d] * cos + grad[..., d:] * sin) * (x > 0).to(grad.dtype)


FEATURE_MAPS = {"elu": EluFeatures, "relu": ReluFeatures, "taylor": TaylorFeatures, "cosformer": CosformerFeatures}


class GivenFeatures(FeatureMap):
    """The rows are the features already (a learned map computed them, under autograd, before the scan)."""

    name = "given"

    def apply(self, x, start, consts, query):
        return x

    def vjp(self, x, grad, start, consts, query):
        return grad


class Hedgehog(nn.Module):
    """Hedgehog's feature map, one per head: φ(x) = [softmax(x W_h + b_h), softmax(−x W_h − b_h)] (B, H, N, 2F).

    Both halves are positive and sum to 1, so φ(q)·φ(k) lies in (0, 2]: a kernel that is large where x W
    points the same way for q and k, as exp(q·k) is. init="identity": W starts as the identity (D x F: the
    first F dims, or D dims and zeros), b at zero — φ(x) = [softmax(x), softmax(−x)] — a stable start that
    attention transfer then trains to imitate the softmax. init="kaiming" (LoLCATs' code, Zhang et al. 2025):
    W kaiming-uniform as torch draws it for an (H, D, F) tensor, and no bias (b is a buffer of zeros).
    """

    def __init__(self, heads: int, head_dim: int, features: int, init: str = "identity"):
        super().__init__()
        if init == "kaiming":
            self.weight = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(heads, head_dim, features)))
            self.register_buffer("bias", torch.zeros(heads, features))  # (not trained: no bias)
        else:
            self.weight = nn.Parameter(torch.eye(head_dim, features).repeat(heads, 1, 1))  # (H, D, F)
            self.bias = nn.Parameter(torch.zeros(heads, features))  # (H, F)

    def forward(self, x: Tensor) -> Tensor:
        z = torch.matmul(x, self.weight.to(x.dtype)) + self.bias.to(x.dtype)[:, None]  # (B, H, N, F)
        return torch.cat([z.softmax(-1), (-z).softmax(-1)], dim=-1)


LEARNED_MAPS = ("hedgehog",)  # feature maps with parameters (per head: they need num_heads and head_dim)
FEATURE_INPUTS = ("post_rope", "pre_rope")  # what of a rotary model's q, k a learned map reads (option feature_inputs)
FEATURE_INITS = ("identity", "kaiming")  # how a learned map starts (option feature_init)


def unrotated(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x (B, H, N, D) that RoPE rotated at `positions` ((N,) or (B, N)), rotated back: R_{−p} x. RoPE (transformers'
    convention) turns each pair (x_i, x_{i+D/2}) by p θ^(−2i/D), x cos + rotate_half(x) sin; the inverse is
    x cos − rotate_half(x) sin. The angles are computed as transformers computes them (float32; float64 inputs
    get float64 angles), so the model's rotation is undone to rounding."""
    d = x.shape[-1]
    exact = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=x.device).to(exact) / d))
    angles = positions.to(exact)[..., None] * inv  # (N, D/2) or (B, N, D/2)
    angles = torch.cat([angles, angles], dim=-1)
    if angles.dim() == 3:
        angles = angles[:, None]  # (B, 1, N, D): every head
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * angles.cos().to(x.dtype) - half * angles.sin().to(x.dtype)


class MapInputs:
    """The options of a variant with a learned feature map (window_linear, linear and the recurrences with
    feature_map="hedgehog") saying what the map reads and how it starts; each default is this project's first
    form, the other value LoLCATs' code or a departure from it:

    - feature_inputs: "post_rope" (LoLCATs'): φ reads q and k as the model rotated them, so φ(q_t)·φ(k_s) depends
      on the absolute positions t and s. "pre_rope" (a departure): rotated back by their positions first, so the
      kernel depends on the content only; softmax parts keep the rotated q, k. The variant counts positions
      0 .. N − 1 in a call (queries the last Nq) and state.length + i in a step; `position_offset` (0, or (B, 1)
      set by variants.hf each call from the model's position ids) is added to them. rope_theta: RoPE's base.
    - feature_init: "identity" (W = I, b = 0) or "kaiming" (LoLCATs': W kaiming-uniform, no bias): `Hedgehog`.
    - query_scaled: True: φ_q reads q times the scale; False (LoLCATs'): q as it is.
    """

    def _init_map_inputs(
        self, feature_map: str | None, feature_inputs: str, rope_theta: float, feature_init: str, query_scaled: bool
    ) -> None:
        name = self.spec.name
        if feature_inputs not in FEATURE_INPUTS:
            raise ValueError(
                f"{name}: option feature_inputs={feature_inputs!r} is invalid; allowed: 'post_rope' (the learned "
                f"map reads q, k as RoPE rotated them: LoLCATs') or 'pre_rope' (rotated back first)"
            )
        if feature_init not in FEATURE_INITS:
            raise ValueError(
                f"{name}: option feature_init={feature_init!r} is invalid; allowed: 'identity' (W = I, b = 0) or "
                f"'kaiming' (LoLCATs': kaiming-uniform W, no bias)"
            )
        if not isinstance(query_scaled, bool):
            raise ValueError(f"{name}: option query_scaled={query_scaled!r} is invalid; expected True or False")
        changed = [
            f"{k}={v!r}"
            for k, v, d in (
                ("feature_inputs", feature_inputs, "post_rope"),
                ("feature_init", feature_init, "identity"),
                ("query_scaled", query_scaled, True),
            )
            if v != d
        ]
        if changed and feature_map not in LEARNED_MAPS:
            raise ValueError(
                f"{name}: option {changed[0]} is for a learned feature map (feature_map='hedgehog'), "
                f"got feature_map={feature_map!r}"
            )
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not 1 < rope_theta < math.inf:
            raise ValueError(
                f"{name}: option rope_theta={rope_theta!r} is invalid; expected a number > 1 (RoPE's base)"
            )
        if feature_inputs == "pre_rope" and self.head_dim is not None and self.head_dim % 2:
            raise ValueError(
                f"{name}: option feature_inputs='pre_rope' needs an even head_dim (RoPE turns pairs of dims), "
                f"got head_dim={self.head_dim}"
            )
        self.feature_inputs, self.rope_theta = feature_inputs, float(rope_theta)
        self.feature_init, self.query_scaled = feature_init, query_scaled
        self.position_offset: Tensor | int = 0

    def _map_query(self, q: Tensor, start: int) -> Tensor:
        """q (B, H, N, D) at positions start .. as φ_q reads it: rotated back (pre_rope), times the scale (query_scaled)."""
        q = self._pre_rope(q, start)
        return q * float(self._scale(q)) if self.query_scaled else q

    def _pre_rope(self, x: Tensor, start: int) -> Tensor:
        """x (B, H, N, D) at the variant's positions start .. start + N − 1 as φ reads it: rotated back where
        feature_inputs is "pre_rope", else as it is."""
        if self.feature_inputs != "pre_rope":
            return x
        positions = torch.arange(start, start + x.shape[-2], device=x.device) + self.position_offset
        return unrotated(x, positions, self.rope_theta)


def learned_feature_maps(
    owner: str,
    feature_map: str | None,
    heads: int | None,
    head_dim: int | None,
    feature_dim: int | None,
    init: str = "identity",
) -> tuple[nn.Module, nn.Module] | None:
    """(φ of the queries, φ of the keys) for a learned map, or None for feature_map=None; the ValueError names
    the option (every variant that takes a learned map on q and k builds it here)."""
    if feature_map is None:
        return None
    if feature_map not in LEARNED_MAPS:
        raise ValueError(
            f"{owner}: option feature_map={feature_map!r} is invalid; allowed: None, "
            + ", ".join(repr(name) for name in LEARNED_MAPS)
        )
    if heads is None or head_dim is None:
        raise ValueError(
            f"{owner}: feature_map={feature_map!r} needs options num_heads and head_dim (its maps are "
            f"learned per head), got num_heads={heads}, head_dim={head_dim}"
        )
    features = head_dim if feature_dim is None else feature_dim
    if not isinstance(features, int) or isinstance(features, bool) or features < 1:
        raise ValueError(
            f"{owner}: option feature_dim={feature_dim!r} is invalid; expected an int >= 1 (F' of "
            f"{feature_map}: 2F' features a row) or None (= head_dim)"
        )
    return Hedgehog(heads, head_dim, features, init), Hedgehog(heads, head_dim, features, init)


# -- the scan ----------------------------------------------------------------------------------


def group_positions(features: int, chunk: int = 1) -> int:
    """Positions computed at once: about GROUP_FEATURES / F, a multiple of the chunk (at least one chunk)."""
    size = max(1, min(512, GROUP_FEATURES // features))
    return max(chunk, size // chunk * chunk)


def _ones_column(v: Tensor) -> Tensor:
    """[v, 1]: a value column of ones turns the numerator's sums into the normalizer's."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


MAX_EPS = 1.0  # the largest eps: beyond it the normalizer, not the keys, sets the outputs' size


def _write_ratio(out: Tensor, den: Tensor, num: Tensor, eps: float) -> None:
    """Into the views out (B, H, L, Dv) and den (B, H, L, 1), from [numerator, denominator] (B, H, L, Dv + 1):
    den = denominator + eps, never below the smallest normal number (a row that sees no key, numerator 0,
    reads 0 even with eps = 0), out = numerator / den. Written in place: no second N x Dv buffer."""
    den.copy_((num[..., -1:] + eps).clamp_min_(torch.finfo(num.dtype).tiny))
    out.copy_(num[..., :-1]).div_(den)


def _query_group(q: Tensor, sl: slice, factor: float) -> Tensor:
    """Rows `sl` of q times the factor q enters φ with (multiplied per group: no scaled copy of all of q)."""
    return q[:, :, sl] if factor == 1.0 else q[:, :, sl] * factor


def _key_features(fmap: FeatureMap, k: Tensor, keep: Tensor | None, sl: slice, consts: dict) -> Tensor:
    kf = fmap.apply(k[:, :, sl], sl.start, consts, False)
    return kf if keep is None else kf * keep[:, :, sl]  # padded keys contribute to neither sum


def _states_before(kc: Tensor, vc: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """(state before each chunk (B, H, c, F, E), state after the last chunk) of chunked φ(k) (B, H, c, C, F)
    and values (B, H, c, C, E), given `state` (B, H, F, E), the sums over everything before them."""
    chunk_state = torch.matmul(kc.transpose(-1, -2), vc)  # (B, H, c, F, E)
    c = kc.shape[2]
    earlier = torch.ones(c, c, dtype=kc.dtype, device=kc.device).tril_(-1)  # earlier[t, u] = 1 if chunk u < t
    # exclusive prefix sums over chunks as one small matmul (much faster on CPU than cumsum along dim 2)
    state_before = torch.matmul(earlier, chunk_state.flatten(3)).view_as(chunk_state).add_(state[:, :, None])
    return state_before, state_before[:, :, -1] + chunk_state[:, :, -1]


def _causal_group(q: Tensor, k: Tensor, v: Tensor, state: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Causal linear attention over one group of whole chunks, given the sums over all earlier positions.

    q, k: (B, H, L, F) features φ(q), φ(k); v: (B, H, L, E) values with a ones column last (E = Dv + 1);
    state: (B, H, F, E) = Σ_{j before} φ(k_j) [v_j, 1]ᵀ. Returns ([numerator, denominator] (B, H, L, E),
    the state after this group).
    """
    qc, kc, vc = (t.unflatten(2, (-1, chunk)) for t in (q, k, v))  # (B, H, c, C, ·)
    scores = torch.matmul(qc, kc.transpose(-1, -2)).tril_()  # inside a chunk: masked C x C products
    state_before, after = _states_before(kc, vc, state)  # across chunks: the sums over everything before
    num = torch.matmul(scores, vc) + torch.matmul(qc, state_before)
    return num.flatten(2, 3), after


class _NonCausalScan(torch.autograd.Function):
    """out = φ(q) S / (φ(q) z + eps), S = Σ φ(k_j) v_jᵀ, z = Σ φ(k_j), in groups of positions.

    Nothing of size N·F is stored for the backward beyond the inputs and the output: the features
    are recomputed group by group (as FlashAttention recomputes its weights), so forward+backward
    holds O(group + F·Dv) besides the inputs, the output and the gradients.
    """

    @staticmethod
    def forward(ctx, q, k, v, keep, fmap, consts, q_factor, eps):
        b, h, n_k, d = k.shape
        size = group_positions(fmap.dim(d))
        state = k.new_zeros(b, h, fmap.dim(d), v.shape[-1] + 1)  # [Σ φ(k) vᵀ, Σ φ(k)]
        for sl in spans(n_k, size):
            state += torch.matmul(_key_features(fmap, k, keep, sl, consts).transpose(-1, -2), _ones_column(v[:, :, sl]))
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        den = q.new_empty(*q.shape[:-1], 1)
        for sl in spans(q.shape[-2], size):
            num = torch.matmul(fmap.apply(_query_group(q, sl, q_factor), sl.start, consts, True), state)
            _write_ratio(out[:, :, sl], den[:, :, sl], num, eps)
        ctx.save_for_backward(q, k, v, keep, state, out, den)
        ctx.fmap, ctx.consts, ctx.size, ctx.q_factor = fmap, consts, size, q_factor
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep, state, out, den = ctx.saved_tensors
        fmap, consts, q_factor = ctx.fmap, ctx.consts, ctx.q_factor
        dq = torch.empty_like(q) if ctx.needs_input_grad[0] else None
        dstate = torch.zeros_like(state)
        for sl in spans(q.shape[-2], ctx.size):
            qg = _query_group(q, sl, q_factor)
            d_num = _d_num_den(grad_out[:, :, sl], out[:, :, sl], den[:, :, sl])  # (L, Dv + 1)
            if dq is not None:
                dq[:, :, sl] = fmap.vjp(qg, torch.matmul(d_num, state.transpose(-1, -2)), sl.start, consts, True).mul_(
                    q_factor
                )
            dstate += torch.matmul(fmap.apply(qg, sl.start, consts, True).transpose(-1, -2), d_num)
        dk = torch.empty_like(k) if ctx.needs_input_grad[1] else None
        dv = torch.empty_like(v) if ctx.needs_input_grad[2] else None
        for sl in spans(k.shape[-2], ctx.size):
            if dk is not None:
                dkf = torch.matmul(_ones_column(v[:, :, sl]), dstate.transpose(-1, -2))
                if keep is not None:
                    dkf = dkf * keep[:, :, sl]
                dk[:, :, sl] = fmap.vjp(k[:, :, sl], dkf, sl.start, consts, False)
            if dv is not None:
                dv[:, :, sl] = torch.matmul(_key_features(fmap, k, keep, sl, consts), dstate[..., :-1])
        return dq, dk, dv, None, None, None, None, None


def _d_num_den(grad_out: Tensor, out: Tensor, den: Tensor) -> Tensor:
    """Gradient of the loss w.r.t. [numerator, denominator] of out = num / den: [dO / den, -(dO·O) / den];
    0 on rows that see no key (den held at the smallest normal number: their output is 0 whatever the keys)."""
    d_num = torch.cat([grad_out, -(grad_out * out).sum(-1, keepdim=True)], dim=-1).div_(den)
    return d_num.masked_fill_(den <= torch.finfo(den.dtype).tiny, 0.0)


class _CausalScan(torch.autograd.Function):
    """Causal linear attention, chunk-wise within groups of positions, the running state carried across
    groups. The backward runs the groups in reverse, carrying the gradient of the state, and recomputes
    the features of each group; it keeps only the state before each group (N / group of F x (Dv+1))
    and the normalizer, besides the inputs and the output."""

    @staticmethod
    def forward(ctx, q, k, v, keep, fmap, consts, q_factor, chunk, eps):
        b, h, n, d = q.shape
        size = group_positions(fmap.dim(d), chunk)
        state = q.new_zeros(b, h, fmap.dim(d), v.shape[-1] + 1)
        out = q.new_empty(b, h, n, v.shape[-1])
        den = q.new_empty(b, h, n, 1)
        states = []
        for sl in spans(n, size):
            states.append(state)
            kf = _key_features(fmap, k, keep, sl, consts)
            qf = fmap.apply(_query_group(q, sl, q_factor), sl.start, consts, True)
            num, state = _causal_group(qf, kf, _ones_column(v[:, :, sl]), state, chunk)
            _write_ratio(out[:, :, sl], den[:, :, sl], num, eps)
        ctx.save_for_backward(q, k, v, keep, out, den, torch.stack(states))
        ctx.fmap, ctx.consts, ctx.chunk, ctx.size, ctx.q_factor = fmap, consts, chunk, size, q_factor
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep, out, den, states = ctx.saved_tensors
        fmap, consts, chunk, q_factor = ctx.fmap, ctx.consts, ctx.chunk, ctx.q_factor
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dstate_later = torch.zeros_like(states[0])  # Σ over later groups of φ(q_i)ᵀ [dnum_i, dden_i]
        for index, sl in reversed(list(enumerate(spans(q.shape[-2], ctx.size)))):
            qg, kg = _query_group(q, sl, q_factor), k[:, :, sl]
            qf, kf = fmap.apply(qg, sl.start, consts, True), _key_features(fmap, k, keep, sl, consts)
            vg = _ones_column(v[:, :, sl])
            d_num = _d_num_den(grad_out[:, :, sl], out[:, :, sl], den[:, :, sl])
            qc, kc, vc, dc = (t.unflatten(2, (-1, chunk)) for t in (qf, kf, vg, d_num))  # (B, H, c, C, ·)
            c = qc.shape[2]
            state_before, _ = _states_before(kc, vc, states[index])  # (B, H, c, F, E)
            q_sums = torch.matmul(qc.transpose(-1, -2), dc)  # (B, H, c, F, E): each chunk's Σ φ(q) dN
            later = torch.ones(c, c, dtype=q.dtype, device=q.device).triu_(1)  # later[t, u] = 1 if chunk u > t
            dstate_after = torch.matmul(later, q_sums.flatten(3)).view_as(q_sums).add_(dstate_later[:, :, None])
            dv_scores = torch.matmul(dc, vc.transpose(-1, -2)).tril_()  # (B, H, c, C, C): dN_i · V_j, j <= i
            dqf = torch.matmul(dv_scores, kc) + torch.matmul(dc, state_before.transpose(-1, -2))
            dkf = torch.matmul(dv_scores.transpose(-1, -2), qc) + torch.matmul(vc, dstate_after.transpose(-1, -2))
            scores_t = torch.matmul(kc, qc.transpose(-1, -2)).triu_()  # (B, H, c, C, C): φ(q_i)·φ(k_j), i >= j
            dvg = torch.matmul(scores_t, dc) + torch.matmul(kc, dstate_after)
            dstate_later = dstate_later + q_sums.sum(2)
            if keep is not None:
                dkf = dkf * keep[:, :, sl].unflatten(2, (-1, chunk))
            dq[:, :, sl] = fmap.vjp(qg, dqf.flatten(2, 3), sl.start, consts, True).mul_(q_factor)
            dk[:, :, sl] = fmap.vjp(kg, dkf.flatten(2, 3), sl.start, consts, False)
            dv[:, :, sl] = dvg.flatten(2, 3)[..., :-1]
        return dq, dk, dv, None, None, None, None, None, None


class FeatureMapAttention(AttentionVariant):
    """The scan, for any `FeatureMap`: subclasses give `feature_map_for(d)`; not registered itself.

    The `scale` option defaults to none here (φ of q itself, as in the paper); given, it multiplies q
    before φ. Non-causal: one F x Dv state S = Σ_j φ(k_j) v_jᵀ and one normalizer z = Σ_j φ(k_j):
    O(N·F·Dv) time. Causal: the sums run over j <= i (with Nq < Nk, over the keys up to the query's
    position Nk - Nq + i). Computed chunk by chunk: within a chunk of C positions a masked C x C
    product, across chunks the running state (S, z) of everything before — never a per-position
    (N, F, Dv) prefix sum. Chunks are taken in groups sized to a memory bound, the state carried from
    group to group, so peak memory stays O(group + N·Dv) whatever N.

    Backward (`_NonCausalScan`, `_CausalScan`): written out, group by group, recomputing the features
    instead of storing them (as FlashAttention recomputes its weights); the causal one runs the groups
    in reverse with the gradient of the state. The normalizer is carried as a column of ones appended
    to v, so one set of sums serves numerator and denominator. Each feature map gives its own
    vector-Jacobian product (`vjp`); one without falls back to autograd on its `apply`.
    """

    def __init__(self, *, chunk_size: int = 64, eps: float = 1e-6, **base):
        """
        Args:
            chunk_size: C, positions per chunk of the causal computation (exact within a chunk, a running
                F x Dv state across chunks). A tuning knob: the result does not depend on it.
            eps: added to the normalizer φ(q)·Σφ(k) (keeps rows with no visible key finite).
        """
        super().__init__(**base)
        self._check_int("chunk_size", chunk_size, 1)
        if not (
            isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and 0 <= eps <= MAX_EPS
        ):
            raise ValueError(
                f"{self.spec.name}: option eps={eps!r} is invalid; expected a number in [0, {MAX_EPS}] (it is "
                f"added to the normalizer, about the number of visible keys: a large eps scales every output "
                f"towards 0)"
            )
        self.chunk_size, self.eps = chunk_size, float(eps)

    def feature_map_for(self, q: Tensor) -> FeatureMap:
        raise NotImplementedError

    def _feature_inputs(self, x: Tensor, query: bool, start: int = 0) -> Tensor:
        """What of q (query=True) or k, at positions start .. start + N − 1, enters φ: all of it unless a subclass
        says fewer dims, or maps it by a learned map first (whose features the scan then takes as they are)."""
        return x

    def default_scale(self, d: int) -> float:
        """scale=None: q enters φ as it is (the paper's)."""
        return 1.0

    def _query_factor(self, q: Tensor) -> float:
        """What q is multiplied by before φ: its scale (1 unless given)."""
        return float(self._scale(q))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        if q.dtype in (torch.float16, torch.bfloat16):
            # the normalizer φ(q)·Σφ(k) grows like N·D (about 86·N at D = 64 for elu): in float16 it passes
            # 65504 from N ≈ 760, and a bfloat16 running state loses the sum's low bits group after
            # group. The sums are kept in float32, the output returned in the input's dtype.
            out = self._attend(q.float(), k.float(), v.float(), causal, key_padding_mask)
            return out.to(q.dtype)
        if torch.is_autocast_enabled(q.device.type):  # the scan's sums stay in the inputs' dtype, forward and backward
            with torch.autocast(q.device.type, enabled=False):
                return self._attend(q, k, v, causal, key_padding_mask)
        n_q, n_k = q.shape[-2], k.shape[-2]
        q, k = self._feature_inputs(q, True, n_k - n_q if causal else 0), self._feature_inputs(k, False)
        factor = self._query_factor(q)
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :, None].to(k.dtype)  # (B, 1, Nk, 1)
        if causal and n_q < n_k:  # the queries are the last Nq positions: zero rows put them there, and are cut after.
            # The prefix sums over the first Nk - Nq keys are the running state of the scan: O(Nk F Dv), as
            # building that state from the keys costs anyway (a KV cache keeps keys, not the state)
            return self._causal(torch.nn.functional.pad(q, (0, 0, n_k - n_q, 0)), k, v, keep, factor)[:, :, -n_q:]
        fmap = self.feature_map_for(q)
        if not causal:
            return _NonCausalScan.apply(q, k, v, keep, fmap, fmap.setup(q, k, keep), factor, self.eps)
        return self._causal(q, k, v, keep, factor)

    def _causal(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, factor: float) -> Tensor:
        fmap = self.feature_map_for(q)
        consts = fmap.setup(q, k, keep)
        n = q.shape[-2]
        chunk = min(self.chunk_size, n)
        q, _ = pad_to_multiple(q, chunk)
        k, _ = pad_to_multiple(k, chunk)
        v, _ = pad_to_multiple(v, chunk)
        if keep is None and q.shape[-2] != n:
            keep = torch.ones(1, 1, n, 1, dtype=k.dtype, device=k.device)
        if keep is not None:
            keep, _ = pad_to_multiple(keep, chunk)  # the padding added here is masked like any padded key
        return _CausalScan.apply(q, k, v, keep, fmap, consts, factor, chunk, self.eps)[:, :, :n]

    def kernel(self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None) -> Tensor:
        """The explicit (B, H, Nq, Nk) kernel matrix A = φ(q) φ(k)ᵀ, masked (O(N²): for checks at small N)."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        q, k = self._feature_inputs(q, True, n_k - n_q if causal else 0), self._feature_inputs(k, False)
        factor = self._query_factor(q)
        q = q if factor == 1.0 else q * factor
        keep = None if key_padding_mask is None else key_padding_mask[:, None, :, None].to(k.dtype)
        fmap = self.feature_map_for(q)
        consts = fmap.setup(q, k, keep)
        start = n_k - n_q if causal else 0  # the queries' positions
        a = torch.matmul(fmap.apply(q, start, consts, True), fmap.apply(k, 0, consts, False).transpose(-1, -2))
        allowed = dense_mask(n_q, n_k, causal, key_padding_mask, q.device)
        return a if allowed is None else a * allowed

    def reference(self, q, k, v, *, causal=False, key_padding_mask=None):
        """The explicit O(N²) form: A = φ(Q)φ(K)ᵀ (masked), rows normalized by their sums (+ eps), times V."""
        k, v = self._grouped_kv(q, k, v)  # grouped K/V: repeated to the query heads, as the forward repeats them
        a = self.kernel(q, k, causal=causal, key_padding_mask=key_padding_mask)
        return torch.matmul(a, v) / (a.sum(-1, keepdim=True) + self.eps).clamp_min(torch.finfo(a.dtype).tiny)

    def _features(self, d: int) -> int:
        """F for a head dim D."""
        raise NotImplementedError

    # -- decoding: the running sums, constant in N ------------------------------------------------
    state_kind = "recurrent"
    step_positions = 256  # (a step forms its t x t products)

    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        f = self._features(head_dim)
        sums = (
            torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        )  # (the forward's sums are float32 too)
        return {"S": torch.zeros(batch, heads, f, value_dim + 1, dtype=sums, device=device)}  # Σ_j φ(k_j) [v_j, 1]ᵀ

    def _decode_features(
        self, q: Tensor, k: Tensor, state, keep: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None, dict]:
        """(φ(q), φ(k)) of the new positions (q already multiplied by its factor), the factor the earlier
        sums take first (None: 1), and state tensors to replace (performer: its running stabilizer).
        keep: (B, 1, t, 1) of the new positions, None when none is padding."""
        fmap = self.feature_map_for(q)
        consts = fmap.setup(q, k, keep)
        return fmap.apply(q, state.length, consts, True), fmap.apply(k, state.length, consts, False), None, {}

    def _prefill(self, q, k, v, state, keep):
        for sl in spans(q.shape[2], self.step_positions):  # step's state, in steps of step_positions
            state = self._step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state, None if keep is None else keep[:, sl])[1]
        return state

    def _step(self, q, k, v, state, keep):
        """o_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps) with S, z the sums over positions <= t: the t new positions
        against each other (a causal t x t product) and against the sums over everything before. A padded
        position adds nothing to the sums."""
        sums = state.tensors["S"]
        dtype = q.dtype
        q, k, v = (x.to(sums.dtype) for x in (q, k, v))
        q, k = self._feature_inputs(q, True, state.length), self._feature_inputs(k, False, state.length)
        factor = self._query_factor(q)
        keep = None if keep is None else keep[:, None, :, None].to(sums.dtype)  # (B, 1, t, 1)
        phi_q, phi_k, rescale, extra = self._decode_features(q if factor == 1.0 else q * factor, k, state, keep)
        if keep is not None:
            phi_k = phi_k * keep
        if rescale is not None:
            sums = sums * rescale
        ve = _ones_column(v)
        kv_heads = phi_k.shape[1]
        if kv_heads == phi_q.shape[1]:
            num = torch.matmul(torch.matmul(phi_q, phi_k.transpose(-1, -2)).tril_(), ve) + torch.matmul(phi_q, sums)
        else:  # grouped-query: a K/V head's sums serve its G query heads, (B, Hkv, G, t, ·) against (B, Hkv, 1, ·, ·)
            phi_g, k_g, ve_g = phi_q.unflatten(1, (kv_heads, -1)), phi_k[:, :, None], ve[:, :, None]
            num = torch.matmul(torch.matmul(phi_g, k_g.transpose(-1, -2)).tril_(), ve_g) + torch.matmul(
                phi_g, sums[:, :, None]
            )
            num = num.flatten(1, 2)
        out = num[..., :-1] / (num[..., -1:] + self.eps).clamp_min(torch.finfo(num.dtype).tiny)
        sums = sums + torch.matmul(phi_k.transpose(-1, -2), ve)
        return out.to(dtype), state.advanced(q.shape[2], S=sums, **extra)

    def flops(self, n_q: int, n_k: int, d: int, dv: int, causal: bool) -> float:
        # the recurrent form's useful work: build the state (2 N F Dv) and read it out (2 N F Dv), normalizers
        f = self._features(d)
        return 2.0 * n_k * f * dv + 2.0 * n_q * f * dv + 2.0 * (n_k + n_q) * f

    def memory_estimate(self, batch, heads, n_q, n_k, d, dv, element_size, causal, backward):
        f = self._features(d)
        size = group_positions(f, self.chunk_size)
        group = batch * heads * size * (f + dv + 1) * 4 * (8 if causal else 4)  # a group's features and products
        states = batch * heads * math.ceil(n_k / size) * f * (dv + 1) * 4 if causal else 0  # kept for the backward
        return int(
            group + states + super().memory_estimate(batch, heads, n_q, n_k, d, dv, element_size, causal, backward)
        )


@register
class LinearAttention(MapInputs, FeatureMapAttention):
    spec = VariantSpec(
        position_study=True,
        name="linear",
        kind="kernel",
        family="kernel feature maps",
        lm_defaults=((),),
        repeats_kv="its scans and their written-out backward run one K/V head per query head",
        summary="linear attention, phi(q)·phi(k) for softmax (elu+1, relu, taylor, cosformer, learned hedgehog); causal chunk-wise with a running F x Dv state",
        style=("#d62728", "v"),
        reference="Katharopoulos et al. 2020, 'Transformers are RNNs'; Arora et al. 2024 (Based: taylor); Qin et al. 2022 (cosFormer)",
        time_complexity="O(N F Dv) (+ O(N C F) causal)",
        memory_complexity="O(N Dv) + one group of chunks",
        subquadratic=True,
        notes="F features a row: D (elu, relu), 2D (cosformer), 1 + D + D^2 (taylor), 2 feature_dim (hedgehog, learned per head: "
        "needs num_heads and head_dim); cosformer: M = max(Nq, Nk) unless "
        "max_len is given (give it for decoding: a prefix's outputs then do not change with N)",
        function_options=(
            "feature_map",
            "max_len",
            "feature_dim",
            "feature_inputs",
            "rope_theta",
            "feature_init",
            "query_scaled",
        ),
        examples=(
            (("chunk_size", 4),),
            (("feature_map", "relu"),),
            (("feature_map", "taylor"), ("chunk_size", 4)),
            (("feature_map", "taylor"), ("feature_dim", 3)),
            (("feature_map", "cosformer"), ("chunk_size", 4), ("max_len", 64)),
            (("feature_map", "hedgehog"), ("chunk_size", 4)),
            (("feature_map", "hedgehog"), ("feature_dim", 3)),
            (("feature_map", "hedgehog"), ("feature_inputs", "pre_rope"), ("chunk_size", 4)),
            (("feature_map", "hedgehog"), ("feature_init", "kaiming"), ("query_scaled", False)),
        ),
    )

    def __init__(
        self,
        *,
        feature_map: str = "elu",
        max_len: int | None = None,
        feature_dim: int | None = None,
        feature_inputs: str = "post_rope",
        rope_theta: float = 10000.0,
        feature_init: str = "identity",
        query_scaled: bool = True,
        **base,
    ):
        """
        Args:
            feature_map: φ applied to queries and keys: "elu" (elu(x) + 1, Katharopoulos et al.), "relu",
                "taylor" (1 + x + x⊗x/2 of x / D^¼, Based: F = 1 + D + D², for a small head dim),
                "cosformer" (relu with cos/sin re-weighting by position, F = 2D) or "hedgehog" (learned per
                head, [softmax(x W + b), softmax(−x W − b)], F = 2 feature_dim; needs num_heads and head_dim).
            max_len: cosformer only: M of its re-weighting cos(π (i − j) / 2M); None: max(Nq, Nk) of each call
                (the paper's). Positions must stay below it.
            feature_dim: taylor, elu, relu, cosformer: d', only the first d' dims of q and k enter φ (None: all
                D). Based runs taylor on d' = 16 (its q, k projections are that narrow; the values keep their
                width): F = 1 + d' + d'². hedgehog: F', the width of x W (None: D).
            feature_inputs: hedgehog only (`MapInputs`): "post_rope" (φ reads q, k as RoPE rotated them: LoLCATs')
                or "pre_rope" (rotated back by their positions first: a position-free kernel).
            rope_theta: the base θ of the rotation pre_rope undoes (variants.hf takes the model's).
            feature_init: hedgehog only: "identity" (W = I, b = 0) or "kaiming" (LoLCATs': kaiming-uniform W, no bias).
            query_scaled: hedgehog only: φ_q reads q times the scale (True) or q itself (False, LoLCATs').
            scale: factor applied to q before φ; None (the default) leaves q as it is, as in the paper.
        """
        super().__init__(**base)
        self._init_map_inputs(feature_map, feature_inputs, rope_theta, feature_init, query_scaled)
        if feature_map not in FEATURE_MAPS and feature_map not in LEARNED_MAPS:
            raise ValueError(
                f"linear: option feature_map={feature_map!r} is invalid; allowed: "
                + ", ".join(repr(name) for name in (*FEATURE_MAPS, *LEARNED_MAPS))
            )
        self._check_int("max_len", max_len, 1, allow_none=True)
        if max_len is not None and feature_map != "cosformer":
            raise ValueError(
                f"linear: option max_len={max_len!r} is for feature_map='cosformer' only, got feature_map={feature_map!r}"
            )
        self._check_int("feature_dim", feature_dim, 1, allow_none=True)
        learned = feature_map in LEARNED_MAPS
        if feature_dim is not None and self.head_dim is not None and feature_dim > self.head_dim and not learned:
            raise ValueError(
                f"linear: option feature_dim={feature_dim} is invalid; expected an int <= head_dim={self.head_dim}"
            )
        self.feature_map, self.max_len, self.feature_dim = feature_map, max_len, feature_dim
        if learned:  # φ of q and of k, trained (attention transfer): computed before the scan, under autograd
            self.q_features, self.k_features = learned_feature_maps(
                "linear", feature_map, self.num_heads, self.head_dim, feature_dim, feature_init
            )
            self._map = GivenFeatures()
        else:
            self._map = CosformerFeatures(max_len) if feature_map == "cosformer" else FEATURE_MAPS[feature_map]()

    def length_unsupported_reason(self, n_q: int, n_k: int) -> str | None:
        if self.max_len is not None and max(n_q, n_k) > self.max_len:
            return f"positions up to {max(n_q, n_k)} pass cosformer's max_len={self.max_len}"
        return None

    def feature_map_for(self, q: Tensor) -> FeatureMap:
        return self._map

    def _learned(self) -> bool:
        return self.feature_map in LEARNED_MAPS

    def _features(self, d: int) -> int:
        if self._learned():
            return 2 * self.q_features.bias.shape[-1]
        return self._map.dim(d if self.feature_dim is None else min(d, self.feature_dim))

    def _query_factor(self, q: Tensor) -> float:
        return 1.0 if self._learned() else super()._query_factor(q)  # (a learned map took q times its scale)

    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        if self.feature_map == "cosformer" and self.max_len is None:
            raise ValueError(
                "linear: feature_map='cosformer' decodes only with max_len given (M of its re-weighting "
                "cos(π (i − j) / 2M); without it M is each call's length, which a decoder does not know yet)"
            )
        if self.feature_dim is not None and self.feature_dim > head_dim and not self._learned():
            raise ValueError(f"linear: feature_dim={self.feature_dim} > the state's head_dim={head_dim}")
        return super()._empty_state(batch, heads, head_dim, value_dim, dtype, device)

    def state_repeats_kv_reason(self) -> str:
        # the running sums Σ φ(k_j) [v_j, 1]ᵀ need k and v only: one per K/V head, unless φ is learned per query head
        return "its key feature map is learned per query head, so its sums are too" if self._learned() else ""

    def _feature_inputs(self, x: Tensor, query: bool, start: int = 0) -> Tensor:
        if self._learned():
            return self.q_features(self._map_query(x, start)) if query else self.k_features(self._pre_rope(x, start))
        if self.feature_dim is not None and self.feature_dim > x.shape[-1]:
            raise ValueError(f"linear: feature_dim={self.feature_dim} > the inputs' head dim D={x.shape[-1]}")
        return x if self.feature_dim is None else x[..., : self.feature_dim]

    def extra_repr(self) -> str:
        return f"feature_map={self.feature_map!r}, chunk_size={self.chunk_size}"
