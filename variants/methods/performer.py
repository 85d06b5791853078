"""Performer (FAVOR+): Choromanski et al. 2021, "Rethinking Attention with Performers".

Softmax's kernel exp(q·k) is estimated without bias by positive random features:

    φ(x) = exp(W x − ‖x‖² / 2) / √m,   W: (m, D) rows w_r ~ N(0, I_D), drawn orthogonal in blocks
    E[φ(a)·φ(b)] = exp(a·b)

With a = q · scale · D^¼ and b = k · D^-¼ (scale = D^-½ by default, so a = q / D^¼ as in the
paper), φ(a)·φ(b) estimates exp(scale · q·k), and the output is linear attention's (linear.py:
the same scan, causal chunk-wise) with these features: m = `features` random directions, error
shrinking like 1/√m. Time O(N·m·Dv), memory O(N·Dv) + one group of features.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._base import VariantSpec, register
from .._utils import pad_to_multiple, spans
from ._recurrence import GROUP_POSITIONS, _GroupedScan, _scan_groups, gated_chunks
from .linear import FeatureMap, FeatureMapAttention, _ones_column


def orthogonal_gaussian(m: int, d: int, seed: int) -> Tensor:
    """(m, D) float64 rows: blocks of D orthonormal directions (QR of a Gaussian matrix), each row
    scaled by the norm of an independent Gaussian vector, so every row is marginally N(0, I_D)."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(math.ceil(m / d)):
        q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r))  # signs fixed so Q is uniform (Haar): LAPACK's are not
        blocks.append(q.T)  # rows orthonormal, each uniform on the sphere
    directions = torch.cat(blocks)[:m]
    norms = torch.randn(m, d, generator=g, dtype=torch.float64).norm(dim=1, keepdim=True)
    return directions * norms


def running_max(x: Tensor) -> Tensor:
    """The running max along the last dim, by log2(N) maxima of shifted copies (ONNX has no cummax)."""
    shift = 1
    while shift < x.shape[-1]:
        x = torch.maximum(x, torch.nn.functional.pad(x[..., :-shift], (shift, 0), value=-math.inf))
        shift *= 2
    return x


def _ratio(num: Tensor) -> Tensor:
    """numerator / denominator of [numerator, denominator] (…, Dv + 1): a row that sees no key gives 0 (no NaN
    gradient either)."""
    den = num[..., -1:]
    return num[..., :-1] / torch.where(den > 0, den, torch.ones_like(den))


class PositiveRandomFeatures(FeatureMap):
    """φ(x) = exp(W x' − ‖x'‖²/2 − c) / √m with x' = x / D^¼ (q arrives already multiplied by
    scale · √D by `Performer`); c: see the module docstring."""

    name = "favor+"

    def __init__(self, projection: Tensor):
        self.projection = projection  # (m, D)

    def dim(self, d):
        return self.projection.shape[0]

    def logits(self, x: Tensor) -> Tensor:
        """W x' − ‖x'‖²/2 (B, H, L, m), x' = x / D^¼."""
        x = x * x.shape[-1] ** -0.25
        w = self.projection.to(x.dtype)
        return torch.matmul(x, w.T) - x.square().sum(-1, keepdim=True) / 2

    def setup(self, q, k, keep):
        with torch.no_grad():
            key_max = torch.full(k.shape[:2], -math.inf, dtype=k.dtype, device=k.device)
            for sl in spans(k.shape[-2], 512):
                logits = self.logits(k[:, :, sl])
                if keep is not None:
                    logits = logits.masked_fill(keep[:, :, sl] == 0, -math.inf)
                key_max = torch.maximum(key_max, logits.amax(dim=(-1, -2)))
            key_max = torch.where(torch.isfinite(key_max), key_max, torch.zeros_like(key_max))  # every key padded
        return {"key_max": key_max[:, :, None, None]}  # (B, H, 1, 1)

    def _stabilizer(self, logits: Tensor, consts: dict, query: bool) -> Tensor:
        return logits.detach().amax(-1, keepdim=True) if query else consts["key_max"]

    def apply(self, x, start, consts, query):
        logits = self.logits(x)
        return (logits - self._stabilizer(logits, consts, query)).exp_() * self.projection.shape[0] ** -0.5

    def vjp(self, x, grad, start, consts, query):
        # φ_r = exp(w_r·x' − ‖x'‖²/2 − c)/√m: dL/dx' = Σ_r g_r φ_r (w_r − x'), x' = x / D^¼
        c = x.shape[-1] ** -0.25
        gf = grad * self.apply(x, start, consts, query)
        dx = torch.matmul(gf, self.projection.to(x.dtype)) - x * c * gf.sum(-1, keepdim=True)
        return dx * c


@register
class Performer(FeatureMapAttention):
    """Numerics: exp(w·x) overflows for long x, so each row's features are computed as
    exp(w·x − ‖x‖²/2 − c) with c a constant the ratio does not see: per query row its own max over
    features; for keys, bidirectionally one max over every (real) key and feature per batch and head —
    as the paper's implementation does — and causally the running max c_t over the keys up to each
    position, the keys' features exp(l_s − c_s) carried to position t by exp(c_s − c_t) <= 1: the scan
    of a gated recurrence with log decay c_{t−1} − c_t (_recurrence.py). So every query's stabilizer is
    the largest logit of the keys it sees, in both modes (a single max over all N keys let float32 lose
    the early queries' keys: 10% error at 8 x randn). All cancel between numerator and denominator
    exactly (eps = 0 here; a row with no visible key reads 0), so no future key changes a causal
    output. (With eps > 0 the causal scan keeps the single max: eps is added after it.)

    The random matrix is a buffer drawn from `seed` (saved with the model's state). It stays fixed: a
    training loop that wants fresh features (performer-pytorch redraws every 1000 steps) calls
    `attn.redraw()`, which draws the next seed's matrix.
    """

    spec = VariantSpec(
        name="performer",
        kind="kernel",
        family="random features",
        repeats_kv="it runs linear attention's scans, one K/V head per query head",
        summary="FAVOR+: softmax estimated by m positive orthogonal random features, linear attention's scan",
        style=("#ff7f0e", "<"),
        reference="Choromanski et al. 2021, 'Rethinking Attention with Performers'",
        time_complexity="O(N m Dv) (+ O(N C m) causal)",
        memory_complexity="O(N Dv) + one group of features",
        subquadratic=True,
        function_options=("features", "seed"),
        examples=((("features", 16), ("chunk_size", 4)), (("features", 12), ("seed", 3))),
    )

    def __init__(self, *, features: int = 256, seed: int = 0, eps: float = 0.0, **base):
        """
        Args:
            features: m, random features per head (the estimate's error shrinks like 1/√m).
            seed: seed of the random matrix (fixed until `redraw()`); the same seed draws the same matrix.
            eps: added to the normalizer; 0 (the default) keeps the stabilizers out of the result exactly.
            scale: factor of q·k in the softmax estimated; None means D ** -0.5.
        """
        super().__init__(eps=eps, **base)
        self._check_int("features", features, 1)
        self._check_int("seed", seed, 0)
        self.features_count, self.seed = features, seed
        self.register_buffer("projection", torch.empty(0), persistent=True)
        if self.head_dim is not None:
            self._draw(self.head_dim)

    @classmethod
    def training_options(cls, window: int, head_dim: int) -> dict:
        """m = d log2 d features at a small head dim (64 at d = 16): its default 256 is 16 d there, and made a
        training step at L = 256 take 9 x linear's (1.5 s; measured when the long preset was set, d18c4e2)."""
        return {"features": max(1, round(head_dim * math.log2(head_dim)))} if head_dim > 1 else {}

    def _draw(self, d: int) -> None:
        """The (m, D) matrix of `seed`, in the buffer's dtype and on its device (shapes only on meta)."""
        old = self.projection
        if old.device.type == "meta":
            self.projection = torch.empty(self.features_count, d, dtype=old.dtype, device="meta")
        else:
            self.projection = orthogonal_gaussian(self.features_count, d, self.seed).to(old.device, old.dtype)

    def redraw(self, seed: int | None = None) -> None:
        """Draw a new random matrix: from `seed`, else the next seed (seed + 1). For training schedules
        that redraw the features every so many steps; outputs change after it, by the estimate's error."""
        seed = self.seed + 1 if seed is None else seed
        self._check_int("seed", seed, 0)
        self.seed = seed
        d = self.projection.shape[-1] if self.projection.numel() else self.head_dim
        if d is not None:
            self._draw(d)

    def default_scale(self, d: int) -> float:
        return d**-0.5  # the softmax it estimates: exp(q·k / √D)

    def _query_factor(self, q: Tensor) -> float:
        # φ(a)·φ(b) estimates exp(a·b) after both are divided by D^¼ in the map: a = q · scale · √D
        return self._scale(q) * q.shape[-1] ** 0.5

    def _features(self, d: int) -> int:
        return self.features_count

    def feature_map_for(self, q: Tensor) -> FeatureMap:
        d = q.shape[-1]
        if self.projection.numel() == 0:
            self._draw(d)  # built without head_dim: drawn for the first D seen
        elif self.projection.shape[-1] != d:
            raise ValueError(f"performer: its random features are drawn for D={self.projection.shape[-1]}, got D={d}")
        return PositiveRandomFeatures(self.projection)

    # -- decoding: the sums kept under a running stabilizer ------------------------------------------
    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device):
        if self.eps:
            raise ValueError(
                f"performer: decoding needs eps=0 (got eps={self.eps}): the forward's key stabilizer is the "
                "largest logit of all keys, later ones included, and eps is added after it, so with eps > 0 "
                "an output depends on keys a decoder has not seen"
            )
        state = super()._empty_state(batch, heads, head_dim, value_dim, dtype, device)
        # the largest key logit so far: the sums are kept divided by exp(it), as the forward divides by its max
        return {**state, "key_max": torch.full((batch, heads, 1, 1), -math.inf, dtype=state["S"].dtype, device=device)}

    def _step(self, q, k, v, state, keep):
        """The t new positions from the sums Σ φ(k) [v, 1]ᵀ kept under the running max of the key logits: the
        forward's causal scan, started from the state (eps = 0 here: _empty_state refuses more)."""
        sums = state.tensors["S"]
        dtype = q.dtype
        q, k, v = (x.to(sums.dtype) for x in (q, k, v))
        real = (
            torch.ones(q.shape[0], 1, q.shape[2], dtype=sums.dtype, device=q.device)
            if keep is None
            else keep[:, None, :].to(sums.dtype)
        )
        num, sums, top = self._running(q, k, v, real, sums, state.tensors["key_max"][..., 0, 0], self._query_factor(q))
        return _ratio(num).to(dtype), state.advanced(q.shape[2], S=sums, key_max=top[..., None, None])

    # -- causal: the running max of the key logits as each query's stabilizer --------------------------
    def _causal(self, q, k, v, keep, factor):
        if self.eps:
            return super()._causal(q, k, v, keep, factor)
        b, h, n, _ = q.shape
        real = torch.ones(b, 1, n, dtype=k.dtype, device=k.device) if keep is None else keep[..., 0]
        state = q.new_zeros(b, h, self.features_count, v.shape[-1] + 1)
        return _ratio(
            self._running(q, k, v, real, state, torch.full((b, h), -math.inf, dtype=q.dtype, device=q.device), factor)[
                0
            ]
        )

    def _running(self, q, k, v, real, state, before_max, factor):
        """([numerator, denominator] (B, H, t, Dv + 1), the sums after, the running max after) of t positions
        from `state` (relative to `before_max` (B, H), −inf before any key); real (B, 1, t) of the positions."""
        n = q.shape[-2]
        chunk = min(self.chunk_size, n)
        fmap = self.feature_map_for(q)
        q, k, v = (pad_to_multiple(t, chunk)[0] for t in (q, k, _ones_column(v)))
        real = pad_to_multiple(real, chunk, dim=-1)[0]  # (the positions added to fill a chunk count as padding)
        with torch.no_grad():
            top = torch.cat([fmap.logits(k[:, :, sl]).amax(-1) for sl in spans(k.shape[-2], 512)], dim=-1)  # (B, H, t')
            running = running_max(torch.cat([before_max[..., None], top.masked_fill(real == 0, -math.inf)], dim=-1))
            before, running = running[..., :-1], running[..., 1:]
            running = torch.where(torch.isfinite(running), running, torch.zeros_like(running))  # (no real key yet)
            before = torch.where(torch.isfinite(before), before, running)  # (nothing before: no decay)
        k = torch.cat(
            [k, running[..., None], before[..., None]], dim=-1
        )  # (the stabilizers travel with their keys' groups)
        self._q_factor = factor
        size = max(chunk, GROUP_POSITIONS // chunk * chunk)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            num, state = _GroupedScan.apply(self, chunk, size, real, state, q, k, v)
        else:
            num, state = _scan_groups(self, q, k, v, real, state, chunk, size)
        return num[:, :, :n], state, running[..., n - 1]

    def _group(self, q, k, v, keep, state, chunk):
        """One group of the causal scan (the recurrence engine's call): features of q and of the keys under their
        running max, the max's growth as the decay. k arrives with the running max and the one before it."""
        k, running, before = k[..., :-2], k[..., -2].detach(), k[..., -1].detach()
        fmap = PositiveRandomFeatures(self.projection)
        m = self.features_count**-0.5
        lq = fmap.logits(q * self._q_factor)
        phi_q = (lq - lq.detach().amax(-1, keepdim=True)).exp() * m
        lk = fmap.logits(k).masked_fill(
            keep[..., None] == 0, -math.inf
        )  # padded keys: nothing (and no exp of a large logit)
        phi_k = (lk - running[..., None]).exp() * m
        return gated_chunks(phi_q, phi_k, v, (before - running) * keep, state, chunk)

    def features(self, x: Tensor) -> Tensor:
        """φ(x) = exp(W x' − ‖x'‖²/2) / √m of rows x (B, H, N, D), x' = x / D^¼, without stabilizer:
        φ(q · scale · √D)·φ(k) estimates exp(scale · q·k) — the map itself, to inspect or test."""
        fmap = self.feature_map_for(x)
        return fmap.logits(x).exp() * self.features_count**-0.5

    def extra_repr(self) -> str:
        return f"features={self.features_count}, seed={self.seed}, chunk_size={self.chunk_size}"
