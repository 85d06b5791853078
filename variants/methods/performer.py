"""Performer (FAVOR+): Choromanski et al. 2021, "Rethinking Attention with Performers".

Softmax's kernel exp(q·k) is estimated without bias by positive random features:

    φ(x) = exp(W x − ‖x‖² / 2) / √m,   W: (m, D) rows w_r ~ N(0, I_D), drawn orthogonal in blocks
    E[φ(a)·φ(b)] = exp(a·b)

With a = q · scale · D^¼ and b = k · D^-¼ (scale = D^-½ by default, so a = q / D^¼ as in the
paper), φ(a)·φ(b) estimates exp(scale · q·k), and the output is linear attention's (linear.py:
the same scan, causal chunk-wise) with these features: m = `features` random directions, error
shrinking like 1/√m. Time O(N·m·Dv), memory O(N·Dv) + one group of features.

Numerics: exp(w·x) overflows for long x, so each row's features are computed as
exp(w·x − ‖x‖²/2 − c) with c a constant the ratio does not see: per query row its own max over
features, for keys one max over every (real) key and feature per batch and head — as the paper's
implementation does. Both cancel between numerator and denominator exactly (eps = 0 here; a row
with no visible key reads 0), so no future key changes a causal output.

The random matrix is a buffer drawn from `seed` (saved with the model's state). It stays fixed: a
training loop that wants fresh features (performer-pytorch redraws every 1000 steps) calls
`attn.redraw()`, which draws the next seed's matrix.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._base import VariantSpec, register
from .._utils import spans
from .linear import FeatureMap, FeatureMapAttention


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
    spec = VariantSpec(
        name="performer",
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
            raise ValueError(f"performer: decoding needs eps=0 (got eps={self.eps}): the forward's key stabilizer is the "
                             "largest logit of all keys, later ones included, and eps is added after it, so with eps > 0 "
                             "an output depends on keys a decoder has not seen")
        state = super()._empty_state(batch, heads, head_dim, value_dim, dtype, device)
        # the largest key logit so far: the sums are kept divided by exp(it), as the forward divides by its max
        return {**state, "key_max": torch.full((batch, heads, 1, 1), -math.inf, dtype=state["S"].dtype, device=device)}

    def _decode_features(self, q, k, state, keep):
        # the forward's key stabilizer is the max over all keys, which a decoder does not know yet: keep the
        # running max c and scale the sums by exp(c_old − c_new) when it grows (the online softmax's rescaling);
        # with eps = 0 the ratio does not depend on it, so the steps equal the forward
        fmap = self.feature_map_for(q)
        old = state.tensors["key_max"]
        top = torch.maximum(old, fmap.setup(q, k, keep)["key_max"])
        consts = {"key_max": top}
        return (fmap.apply(q, state.length, consts, True), fmap.apply(k, state.length, consts, False),
                torch.exp(old - top), {"key_max": top})

    def features(self, x: Tensor) -> Tensor:
        """φ(x) = exp(W x' − ‖x'‖²/2) / √m of rows x (B, H, N, D), x' = x / D^¼, without stabilizer:
        φ(q · scale · √D)·φ(k) estimates exp(scale · q·k) — the map itself, to inspect or test."""
        fmap = self.feature_map_for(x)
        return fmap.logits(x).exp() * self.features_count**-0.5

    def extra_repr(self) -> str:
        return f"features={self.features_count}, seed={self.seed}, chunk_size={self.chunk_size}"
