"""`AttentionVariant`: the one attention interface every method implements.

Every variant is an `nn.Module` with the same call:

    out = attn(q, k, v, causal=False, key_padding_mask=None)
    # q: (B, H, Nq, D)  k: (B, Hkv, Nk, D)  v: (B, Hkv, Nk, Dv)  ->  out: (B, H, Nq, Dv)
    # grouped-query attention: Hkv divides H, query head h reads K/V head h // (H / Hkv) (Hkv = H: every head its own)
    # key_padding_mask: bool (B, Nk), True = a real token, False = padding
    # score_bias (variants whose spec carries_score_bias): a module, bias(distance, causal) -> (H, *distance.shape),
    # added to the scores by distance = query position - key position (variants/positions: ALiBi, T5's bias)
    # causal with Nq < Nk: the queries are the last Nq positions of the keys' sequence (bottom-right
    # alignment, as FlashAttention >= 2.1 and transformers): query i sits at Nk - Nq + i, sees keys <= it

`AttentionVariant.forward` validates the inputs against the variant's `spec` and then calls
`_attend`, which each variant implements on inputs it may trust.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ._checks import check_inputs, dense_mask
from ._decoder import Decodes
from ._heads import Heads
from ._spec import VariantSpec
from ._utils import dense_attention


class AttentionVariant(Heads, Decodes, nn.Module):
    """Base class of every attention implementation.

    Subclasses set `spec`, implement `_attend(q, k, v, causal, key_padding_mask)` and `flops`,
    and may override `memory_estimate` and `unavailable_reason`.

    `num_heads`, `num_kv_heads` and `head_dim` are shape hints every variant accepts: variants with
    per-head parameters need them to create those parameters; all variants check inputs against them.
    """

    spec: VariantSpec

    def __init__(
        self,
        *,
        scale: float | None = None,
        num_heads: int | None = None,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
    ) -> None:
        """Options every variant takes.

        Args:
            scale: factor of the scores q·k before the softmax; None means D ** -0.5.
            num_heads: shape hint: heads H of the inputs (variants with per-head parameters need it; all check it).
            head_dim: shape hint: head dimension D of the inputs (likewise).
            num_kv_heads: shape hint: heads Hkv of k and v (grouped-query attention: a divisor of H); None: k and
                v may have any number of heads dividing q's (a variant with parameters per K/V head sizes them by
                num_heads then).
        """
        super().__init__()
        if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"{self.spec.name}: option scale={scale!r} is invalid; expected a positive finite number or None (= D ** -0.5)"
            )
        self._check_int("num_heads", num_heads, 1, allow_none=True)
        self._check_int("head_dim", head_dim, 1, allow_none=True)
        self._check_int("num_kv_heads", num_kv_heads, 1, allow_none=True)
        if num_heads is not None and num_kv_heads is not None and num_heads % num_kv_heads:
            raise ValueError(
                f"{self.spec.name}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads} "
                f"(grouped-query attention: each K/V head serves H / Hkv query heads)"
            )
        self.scale = scale
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads

    # -- what the harness reads ---------------------------------------------------------------
    def flops(self, n_q: int, n_k: int, d: int, dv: int, causal: bool) -> float:
        """Useful FLOPs of one forward call, per (batch * head)."""
        raise NotImplementedError

    backward_flops_factor: float = 3.5  # fwd+bwd FLOPs = factor * forward FLOPs

    def memory_estimate(
        self,
        batch: int,
        heads: int,
        n_q: int,
        n_k: int,
        d: int,
        dv: int,
        element_size: int,
        causal: bool,
        backward: bool,
    ) -> int:
        """Predicted peak extra bytes of one call (beyond q, k, v); used to skip cells that cannot fit."""
        out = batch * heads * n_q * dv * element_size
        return int(out * (4 if backward else 2))

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        """None when the variant runs on `device` ("cpu", "cuda"), else why it does not."""
        dev = torch.device(device).type
        if dev not in cls.spec.devices:
            return f"{cls.spec.name} runs on {', '.join(cls.spec.devices)}, not {dev}"
        if dev == "cuda" and not torch.cuda.is_available():
            return "no CUDA device is available"
        return None

    @classmethod
    def dtype_unsupported_reason(cls, device: str, dtype: str) -> str | None:
        """None when the variant computes in `dtype` ("float32", ...) on `device`, else why it does not."""
        if dtype not in cls.spec.dtypes:
            return f"{cls.spec.name} does not support {dtype} (supports {', '.join(cls.spec.dtypes)})"
        return None

    @classmethod
    def causal_unsupported_reason(cls) -> str | None:
        """None when the variant computes causal attention, else why not (its spec's `why_not_causal`)."""
        if cls.spec.supports_causal:
            return None
        return f"{cls.spec.name} does not support causal attention" + (
            f": {cls.spec.why_not_causal}" if cls.spec.why_not_causal else ""
        )

    @classmethod
    def non_causal_unsupported_reason(cls) -> str | None:
        """None when the variant computes non-causal attention, else why not (its spec's `why_not_non_causal`)."""
        if cls.spec.supports_non_causal:
            return None
        why = cls.spec.why_not_non_causal
        return f"{cls.spec.name} is causal only" + (f": {why}" if why else "")

    @classmethod
    def mode_unsupported_reason(cls, causal: bool) -> str | None:
        """None when the variant computes attention of this mode (causal or not), else why not: what the
        runner, the micro-benchmarks, viz and quality record for a cell they skip."""
        return cls.causal_unsupported_reason() if causal else cls.non_causal_unsupported_reason()

    @classmethod
    def score_bias_unsupported_reason(cls) -> str | None:
        """None when the variant adds a score bias by distance (ALiBi, T5's relative bias), else why not."""
        return cls.spec.score_bias_reason()

    @classmethod
    def backward_unsupported_reason(cls, device: str) -> str | None:
        dev = torch.device(device).type
        if dev not in cls.spec.backward_devices:
            return f"{cls.spec.name} has no backward on {dev} (backward runs on: {', '.join(cls.spec.backward_devices) or 'none'})"
        return None

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        """None when the variant takes k, v of `kv_heads` heads (with its q), else why not (parameters sized for
        other K/V heads): checked before any computation, as the lengths are."""
        return None

    @classmethod
    def training_options(cls, window: int, head_dim: int) -> dict:
        """Options that make the method comparable in a small training run whose sliding window sees `window` keys,
        at head dim `head_dim` (bench quality's presets compare every method at one reach): none by default."""
        return {}

    def length_unsupported_reason(self, n_q: int, n_k: int) -> str | None:
        """None when the variant takes Nq queries over Nk keys, else why not (a learned projection of
        max_len columns, more landmarks than keys...): checked before any computation, and `bench run`
        records a cell it refuses as skipped with this reason."""
        return None

    def kernel_name(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, backward: bool = False
    ) -> str | None:
        """The library kernel a call with these inputs dispatches to, where the variant can tell (else None)."""
        return None

    def softmax_equivalent_length(self) -> int | None:
        """The largest N at which the variant's definition is exact softmax attention (None: at no N).

        The harness then also checks the variant against an exact reference of its own at that N, so a
        broken definition (`reference`) cannot vouch for a broken implementation.
        """
        return None

    def check_length(self, n: int) -> int:
        """The N at which a correctness check exercises every path of the variant, given a default `n`.

        Variants whose fast path skips work at long range (a band, tiles) return an N long enough
        for that skipping to happen; the harness checks at this N (capped at the run's longest N).
        """
        return n

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """The variant's definition computed densely (O(Nq·Nk) memory): what `forward` must equal.

        Used by the harness to check a variant on a device before timing it; only for small N.
        Default: exact softmax attention with the causal and padding masks.
        """
        return dense_attention(
            q, k, v, dense_mask(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device), self._scale(q)
        )

    def attention_matrix(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        score_bias: nn.Module | None = None,
    ) -> Tensor:
        """The (B, H, Nq, Nk) weights the variant applies to the values: out = weights @ v.

        Every variant here is linear in v, so calling it with v = identity (Dv = Nk) returns exactly
        these weights. Variants that transform v first (memory_compressed) override this (they carry no
        score bias).
        """
        eye = torch.eye(k.shape[-2], dtype=q.dtype, device=q.device).expand(*k.shape[:2], -1, -1)
        biased = {} if score_bias is None else {"score_bias": score_bias}
        with torch.no_grad():
            return self(q, k, eye, causal=causal, key_padding_mask=key_padding_mask, **biased)

    def _grouped_kv(self, q: Tensor, k: Tensor, v: Tensor, reason: str | None = None) -> tuple[Tensor, Tensor]:
        """k and v as `_attend` (and, given the state's `reason`, `_step`) take them: repeated to q's heads where
        the variant says it repeats them (`repeats_kv_reason`), else as given (Hkv heads, computed natively)."""
        groups = q.shape[1] // k.shape[1]
        if groups == 1 or not (self.repeats_kv_reason() if reason is None else reason):
            return k, v
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

    # -- the call -----------------------------------------------------------------------------
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        score_bias: nn.Module | None = None,
    ) -> Tensor:
        """Attention of q over (k, v). Shapes (B, H, Nq, D), (B, H, Nk, D), (B, H, Nk, Dv) -> (B, H, Nq, Dv).

        NaN or infinite inputs propagate to the rows they reach (never hidden as zeros). Padded key
        positions (key_padding_mask False) may hold any finite values: they are never attended to.
        score_bias: added to each score by distance (see the module docstring); a variant that forms no scores
        refuses it, naming why.
        """
        if not isinstance(causal, bool) and causal not in (0, 1):
            raise TypeError(
                f"{self.spec.name}: causal must be a bool (or 0/1), got {causal!r} of type {type(causal).__name__}"
            )
        check_inputs(self, q, k, v, causal, key_padding_mask)
        if q.requires_grad or k.requires_grad or v.requires_grad:
            reason = self.backward_unsupported_reason(q.device.type) if torch.is_grad_enabled() else None
            if reason:
                raise RuntimeError(
                    f"{reason}: it cannot be trained there. For inference, call it under torch.no_grad() "
                    f"(or with inputs that do not require grad); to train, use a variant with a backward "
                    f"on {q.device.type} (see bench list)"
                )
        if score_bias is not None and self.score_bias_unsupported_reason():
            raise ValueError(self.score_bias_unsupported_reason())
        if q.shape[-2] == 0:
            return q.new_zeros(*q.shape[:-1], v.shape[-1])
        if score_bias is not None:  # (an optional argument of the `_attend` of the variants that carry a bias)
            return self._attend(q, *self._grouped_kv(q, k, v), bool(causal), key_padding_mask, score_bias=score_bias)
        return self._attend(q, *self._grouped_kv(q, k, v), bool(causal), key_padding_mask)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        raise NotImplementedError

    def _check_int(self, option: str, value, minimum: int, allow_none: bool = False) -> None:
        """ValueError naming the option unless `value` is an int >= minimum (or None where allowed)."""
        if allow_none and value is None:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            allowed = f"an int >= {minimum}" + (" or None" if allow_none else "")
            raise ValueError(f"{self.spec.name}: option {option}={value!r} is invalid; expected {allowed}")

    def default_scale(self, d: int) -> float:
        """What scale=None stands for at head dim D: D ** -0.5 (feature-map variants: 1, q as it is)."""
        return d**-0.5

    def _scale(self, q: Tensor) -> float:
        return self.scale if self.scale is not None else self.default_scale(q.shape[-1])

    def extra_repr(self) -> str:
        return f"name={self.spec.name!r}"
