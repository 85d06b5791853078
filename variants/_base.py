"""The one attention interface: `VariantSpec`, `AttentionVariant`, the registry and input checks.

Every variant is an `nn.Module` with the same call:

    out = attn(q, k, v, causal=False, key_padding_mask=None)
    # q: (B, H, Nq, D)  k: (B, Hkv, Nk, D)  v: (B, Hkv, Nk, Dv)  ->  out: (B, H, Nq, Dv)
    # grouped-query attention: Hkv divides H, query head h reads K/V head h // (H / Hkv) (Hkv = H: every head its own)
    # key_padding_mask: bool (B, Nk), True = a real token, False = padding
    # causal with Nq < Nk: the queries are the last Nq positions of the keys' sequence (bottom-right
    # alignment, as FlashAttention >= 2.1 and transformers): query i sits at Nk - Nq + i, sees keys <= it

`AttentionVariant.forward` validates the inputs against the variant's `spec` and then calls
`_attend`, which each variant implements on inputs it may trust.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._decoding import DecodingState, appended, check_step, kv_cache, padded
from ._utils import dense_attention, spans


@dataclass(frozen=True)
class VariantSpec:
    """What a variant is and what it can do; the harness reads only this and `flops`."""

    name: str  # registered name, e.g. "sliding_window"
    summary: str  # one line: what the method does
    reference: str  # the paper (or library) it implements
    time_complexity: str  # e.g. "O(N^2 D)"
    memory_complexity: str  # extra memory beyond inputs and output, e.g. "O(N w)"
    supports_causal: bool = True
    scale_is_query_factor: bool = True  # the `scale` option acts as a factor of q (dot-product scores); False: it multiplies scores of another form
    why_not_causal: str = ""  # where supports_causal is False: the method's reason, for errors and skipped cells
    supports_non_causal: bool = True  # False: causal by nature (a recurrence over positions): causal=False is refused
    why_not_non_causal: str = ""  # where supports_non_causal is False: the method's reason
    not_deployable: tuple[
        tuple[str, str], ...
    ] = ()  # (step, why) for each of "export", "compile", "onnx" the variant cannot take (tested)
    max_len_option: str | None = (
        None  # the option bounding N (a learned projection's columns): variants.hf fills it from the model's max_position_embeddings
    )
    supports_cross_attention: bool = True  # Nq != Nk without causal (causal Nq <= Nk: every variant)
    supports_key_padding_mask: bool = True
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types it runs on
    backward_devices: tuple[str, ...] = ("cpu", "cuda")  # device types where backward works
    dtypes: tuple[str, ...] = ("float32", "float64", "float16", "bfloat16")
    subquadratic: bool = (
        False  # memory (and, where the method is, time) below O(N^2); the complexity tests hold it to that
    )
    notes: str = ""  # anything a user must know (e.g. what causal means for this method)
    # facts the harness and the tests read instead of tables keyed by names:
    same_function_as: str | None = (
        None  # another variant computing the same function with the options they share and the same scale (tested): its quality stands for this one's
    )
    reach_option: str | None = (
        None  # the option bounding how far back a position sees (a window): readers mark it, judge accuracy inside and beyond
    )
    function_options: tuple[
        str, ...
    ] = ()  # options that change the function computed: a speed run and a quality run must agree on them
    style: tuple[str, str] | None = None  # (colour, marker) in every figure; None: a stable pick from the name
    examples: tuple[tuple[tuple[str, object], ...], ...] = (
        (),
    )  # option sets that exercise every path at a test's small N (N ~ 13)
    repeats_kv: str = ""  # grouped-query inputs (Hkv < H): "" computed natively (no K/V repeated in memory); else why K, V are repeated to the H query heads first
    state_repeats_kv: str | None = (
        None  # the decoding state's heads: None as `repeats_kv`; "" one per K/V head even where the forward repeats; else why per query head
    )
    family: str = ""  # the family of methods it stands for where a run trains one variant a family (bench quality --preset long); "" none

    def example_options(self) -> list[dict]:
        """`examples` as dicts: what the shared contract tests build the variant with."""
        return [dict(options) for options in self.examples]

    def facts(self) -> dict:
        """What a run records of the variant in its metadata, so readers need no variant code."""
        return {
            "name": self.name,
            "summary": self.summary,
            "same_function_as": self.same_function_as,
            "reach_option": self.reach_option,
            "function_options": list(self.function_options),
            "subquadratic": self.subquadratic,
            "style": list(self.style) if self.style else None,
            "family": self.family,
        }


class AttentionVariant(nn.Module):
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

    # -- grouped-query attention --------------------------------------------------------------
    def repeats_kv_reason(self) -> str:
        """Why this variant (with its options) repeats K and V to the query heads before computing, or "" when it
        computes grouped-query inputs natively: its spec's `repeats_kv` unless its options change it."""
        return self.spec.repeats_kv

    def state_repeats_kv_reason(self) -> str:
        """Why the decoding state keeps its keys, values or sums per query head, or "" when it keeps one per K/V
        head (and `step` takes K/V unrepeated): the spec's `state_repeats_kv`, else `repeats_kv_reason()`.
        A window or a KV cache needs K and V only, whatever the forward's kernel takes."""
        if self.spec.state_repeats_kv is None:
            return self.repeats_kv_reason()
        return self.spec.state_repeats_kv

    def kv_heads_stored(self, heads: int, kv_heads: int) -> int:
        """How many heads of keys, values or state the variant keeps for H query heads on Hkv K/V heads."""
        return heads if self.state_repeats_kv_reason() else kv_heads

    def _kv_parameter_heads(self) -> int | None:
        """The heads parameters acting on k (gates, projections) are sized by: K/V heads where the variant
        computes grouped-query natively and knows them, else the query heads."""
        if self.repeats_kv_reason() or self.num_kv_heads is None:
            return self.num_heads
        return self.num_kv_heads

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
    def backward_unsupported_reason(cls, device: str) -> str | None:
        dev = torch.device(device).type
        if dev not in cls.spec.backward_devices:
            return f"{cls.spec.name} has no backward on {dev} (backward runs on: {', '.join(cls.spec.backward_devices) or 'none'})"
        return None

    def kv_heads_unsupported_reason(self, kv_heads: int) -> str | None:
        """None when the variant takes k, v of `kv_heads` heads (with its q), else why not (parameters sized for
        other K/V heads): checked before any computation, as the lengths are."""
        return None

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
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """The (B, H, Nq, Nk) weights the variant applies to the values: out = weights @ v.

        Every variant here is linear in v, so calling it with v = identity (Dv = Nk) returns exactly
        these weights. Variants that transform v first (memory_compressed) override this.
        """
        eye = torch.eye(k.shape[-2], dtype=q.dtype, device=q.device).expand(*k.shape[:2], -1, -1)
        with torch.no_grad():
            return self(q, k, eye, causal=causal, key_padding_mask=key_padding_mask)

    # -- decoding -----------------------------------------------------------------------------
    state_kind = "kv"  # what `init_state` keeps: "kv", "window", "compressed" or "recurrent" (variants/_decoding.py)
    step_positions: int | None = None  # the most new positions one `_step` takes (`step` splits longer ones); None: any

    @classmethod
    def decode_unsupported_reason(cls) -> str | None:
        """None when the variant decodes (causal, one position after another), else why not."""
        reason = cls.causal_unsupported_reason()
        return f"{reason}, and decoding is causal" if reason else None

    def init_state(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        value_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_len: int | None = None,
        kv_heads: int | None = None,
    ) -> DecodingState:
        """An empty decoding state for `step` (see variants/_decoding.py): by default a KV cache; the
        recurrent methods keep a fixed-size state instead. `heads`: the query heads H; `kv_heads`: the heads Hkv
        of the keys and values the steps will take (grouped-query attention; None: H): a variant that computes
        them natively keeps Hkv heads of state, one that repeats them keeps H.

        Example:
            >>> attn = build("full")
            >>> state = attn.init_state(1, 2, 8, 8)
            >>> out, state = attn.step(*(torch.randn(1, 2, 1, 8) for _ in range(3)), state)
            >>> out.shape, state.length
            (torch.Size([1, 2, 1, 8]), 1)
        """
        reason = self.decode_unsupported_reason()
        if reason:
            raise ValueError(f"{self.spec.name} cannot decode: {reason}")
        kv_heads = heads if kv_heads is None else kv_heads
        for option, value in (
            ("batch", batch),
            ("heads", heads),
            ("head_dim", head_dim),
            ("value_dim", value_dim),
            ("kv_heads", kv_heads),
        ):
            self._check_int(option, value, 1)
        check_shape_hints(self, heads, head_dim, kv_heads)  # (the forward's own checks and messages)
        reason = self.kv_heads_unsupported_reason(kv_heads)
        if reason:
            raise ValueError(f"{self.spec.name}: a state for Hkv={kv_heads} K/V heads is not supported: {reason}")
        self._check_int("max_len", max_len, 1, allow_none=True)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{self.spec.name}: init_state's dtype must be a floating torch.dtype, got {dtype!r}")
        dev = torch.device(device)
        stored = self.kv_heads_stored(heads, kv_heads)
        tensors = self._empty_state(batch, stored, head_dim, value_dim, dtype, dev)
        if max_len is not None and self.state_kind == "kv":  # a KV cache, bounded: one buffer, written in place
            tensors = {
                **tensors,
                **kv_cache(batch, stored, self.cached_key_dim(head_dim), value_dim, dtype, dev, capacity=max_len),
            }
        return DecodingState(
            self.spec.name,
            self.state_kind,
            batch,
            heads,
            head_dim,
            value_dim,
            dtype,
            dev,
            0,
            max_len,
            tensors,
            kv_heads=kv_heads,
        )

    def step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, DecodingState]:
        """The outputs (B, H, t, Dv) of t new positions given the state of everything before, and the new state.

        key_padding_mask: bool (B, t) for the new positions (True = a real token), as the forward takes for
        all of them: padded positions are never attended to (the recurrences skip them). Equals the causal
        forward over the whole sequence at those positions, with the whole mask (tested for every variant)."""
        check_step(self.spec.name, state, q, k, v, key_padding_mask)
        keep = (
            None
            if key_padding_mask is None or (bool(key_padding_mask.all()) and not padded(state))
            else key_padding_mask
        )
        k, v = self._grouped_kv(q, k, v, self.state_repeats_kv_reason())
        if self.step_positions is None or q.shape[2] <= self.step_positions:
            return self._step(q, k, v, state, keep)
        outs = []
        for sl in spans(
            q.shape[2], self.step_positions
        ):  # a long step as several: each _step's t x t work stays bounded
            out, state = self._step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state, None if keep is None else keep[:, sl])
            outs.append(out)
        return torch.cat(outs, dim=2), state

    def step_read_bytes(self, state: DecodingState) -> int:
        """Bytes of `state` that one step of one new position must read: all of it, unless the method reads
        only part (moba: its block sums and the blocks it selects). What a decode cell's bandwidth counts."""
        return state.nbytes()

    def prefill(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, key_padding_mask: Tensor | None = None
    ) -> DecodingState:
        """The state after these positions when their outputs are not needed (a prompt before decoding):
        `step`'s state, without computing what only the outputs need (a KV cache only appends)."""
        check_step(self.spec.name, state, q, k, v, key_padding_mask)
        keep = (
            None
            if key_padding_mask is None or (bool(key_padding_mask.all()) and not padded(state))
            else key_padding_mask
        )
        return self._prefill(q, *self._grouped_kv(q, k, v, self.state_repeats_kv_reason()), state, keep)

    def _grouped_kv(self, q: Tensor, k: Tensor, v: Tensor, reason: str | None = None) -> tuple[Tensor, Tensor]:
        """k and v as `_attend` (and, given the state's `reason`, `_step`) take them: repeated to q's heads where
        the variant says it repeats them (`repeats_kv_reason`), else as given (Hkv heads, computed natively)."""
        groups = q.shape[1] // k.shape[1]
        if groups == 1 or not (self.repeats_kv_reason() if reason is None else reason):
            return k, v
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

    def cached_key_dim(self, head_dim: int) -> int:
        """The width of the keys a KV state keeps: head_dim, unless the method caches a projection of them
        (additive: k W_k, attn_dim wide)."""
        return head_dim

    def _empty_state(self, batch, heads, head_dim, value_dim, dtype, device) -> dict[str, Tensor]:
        return kv_cache(batch, heads, self.cached_key_dim(head_dim), value_dim, dtype, device)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, keep: Tensor | None) -> DecodingState:
        """KV cache: the keys and values appended. `keep`: (B, t) bool of the new positions, None where no
        position of the state (or of these) is padding."""
        return appended(state, k, v, keep)[3]

    def _step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, keep: Tensor | None
    ) -> tuple[Tensor, DecodingState]:
        """KV cache: the new keys appended, then the variant's own causal call (bottom-right) over the cache."""
        keys, values, mask, state = appended(state, k, v, keep)
        return self(q, keys, values, causal=True, key_padding_mask=mask), state

    # -- the call -----------------------------------------------------------------------------
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """Attention of q over (k, v). Shapes (B, H, Nq, D), (B, H, Nk, D), (B, H, Nk, Dv) -> (B, H, Nq, Dv).

        NaN or infinite inputs propagate to the rows they reach (never hidden as zeros). Padded key
        positions (key_padding_mask False) may hold any finite values: they are never attended to.
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
        if q.shape[-2] == 0:
            return q.new_zeros(*q.shape[:-1], v.shape[-1])
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


def dense_mask(n_q: int, n_k: int, causal: bool, key_padding_mask: Tensor | None, device) -> Tensor | None:
    """Bool (B|1, 1, Nq, Nk) mask of exact attention: True = query i may attend key j."""
    allowed = None
    if causal:
        allowed = causal_mask(n_q, n_k, device)[None, None]
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, None, :]
        allowed = pad if allowed is None else allowed & pad
    return allowed


def causal_mask(n_q: int, n_k: int, device) -> Tensor:
    """Bool (Nq, Nk), bottom-right aligned: query i sits at position Nk - Nq + i and sees keys j <= it."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)


# -- input checks ------------------------------------------------------------------------------


def check_inputs(
    attn: AttentionVariant, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None
) -> None:
    """Raise a ValueError/TypeError naming the argument, the value and what is allowed."""
    name = attn.spec.name
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor of shape (B, H, N, D), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must have 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: {arg} must be a floating-point tensor, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in attn.spec.devices:
        raise RuntimeError(
            f"{name}: inputs are on {q.device}, but this variant runs on {', '.join(attn.spec.devices)} only"
        )
    reason = attn.dtype_unsupported_reason(q.device.type, str(q.dtype).removeprefix("torch."))
    if reason:
        raise TypeError(f"{name}: {reason}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"{name}: q, k, v must share the batch dim, and k, v their heads: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{name}: q has H={q.shape[1]} heads, k and v Hkv={k.shape[1]}: grouped-query attention needs H "
            f"a multiple of Hkv (each K/V head serving H / Hkv query heads)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{name}: q and k must share the head dim D, got q D={q.shape[-1]}, k D={k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{name}: k and v must share the key length Nk, got k Nk={k.shape[-2]}, v Nk={v.shape[-2]}")
    if q.shape[-1] == 0 or k.shape[-2] == 0:
        raise ValueError(
            f"{name}: head dim D and key length Nk must be >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    check_shape_hints(attn, q.shape[1], q.shape[-1], k.shape[1])
    reason = attn.kv_heads_unsupported_reason(k.shape[1])
    if reason:
        raise ValueError(f"{name}: k and v with Hkv={k.shape[1]} heads are not supported: {reason}")
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal and not attn.spec.supports_causal:
        raise ValueError(
            f"{name}: causal=True is not supported by this variant"
            + (f": {attn.spec.why_not_causal}" if attn.spec.why_not_causal else "")
        )
    if not causal and not attn.spec.supports_non_causal:
        why = attn.spec.why_not_non_causal
        raise ValueError(
            f"{name}: causal=False is not supported: the method is causal only"
            + (f" ({why})" if why else "")
            + "; call it with causal=True"
        )
    if causal and n_q > n_k:
        raise ValueError(
            f"{name}: causal=True needs Nq <= Nk (the queries are the last Nq of the Nk positions), "
            f"got Nq={n_q}, Nk={n_k}"
        )
    reason = attn.length_unsupported_reason(n_q, n_k)
    if reason:
        raise ValueError(f"{name}: Nq={n_q}, Nk={n_k} is not supported: {reason}")
    if n_q != n_k and not causal and not attn.spec.supports_cross_attention:
        raise ValueError(
            f"{name}: cross-attention (Nq={n_q} != Nk={n_k}, causal=False) is not supported; this variant "
            f"needs Nq == Nk, or causal=True with Nq <= Nk (the queries are the last Nq positions)"
        )
    if key_padding_mask is not None:
        if not attn.spec.supports_key_padding_mask:
            raise ValueError(f"{name}: key_padding_mask is not supported by this variant")
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            got = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
            raise TypeError(f"{name}: key_padding_mask must be a bool tensor (True = real token), got {got}")
        if tuple(key_padding_mask.shape) != (q.shape[0], n_k):
            raise ValueError(
                f"{name}: key_padding_mask must have shape (B, Nk) = {(q.shape[0], n_k)}, got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"{name}: key_padding_mask is on {key_padding_mask.device}, q on {q.device}")


def check_shape_hints(attn: AttentionVariant, heads: int, head_dim: int, kv_heads: int | None = None) -> None:
    """ValueError when the heads, K/V heads or head dim of inputs (or of a decoding state) differ from those the
    variant was built for (its num_heads, num_kv_heads, head_dim hints: per-head parameters are sized by them)."""
    if attn.num_heads is not None and heads != attn.num_heads:
        raise ValueError(f"{attn.spec.name}: built for num_heads={attn.num_heads}, got H={heads}")
    if attn.head_dim is not None and head_dim != attn.head_dim:
        raise ValueError(f"{attn.spec.name}: built for head_dim={attn.head_dim}, got D={head_dim}")
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(
            f"{attn.spec.name}: H={heads} query heads is not a multiple of Hkv={kv_heads} K/V heads "
            f"(grouped-query attention: each K/V head serves H / Hkv query heads)"
        )
    if kv_heads is not None and attn.num_kv_heads is not None and kv_heads != attn.num_kv_heads:
        raise ValueError(f"{attn.spec.name}: built for num_kv_heads={attn.num_kv_heads}, got Hkv={kv_heads}")


# -- registry ----------------------------------------------------------------------------------

_REGISTRY: dict[str, type[AttentionVariant]] = {}


def register(cls: type[AttentionVariant]) -> type[AttentionVariant]:
    """Class decorator: make `cls` available under `cls.spec.name`."""
    name = cls.spec.name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"a variant named {name!r} is already registered ({_REGISTRY[name].__qualname__})")
    _REGISTRY[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a registered variant (for test-only variants)."""
    _REGISTRY.pop(name, None)


def available() -> list[str]:
    """Sorted names of every registered variant (whether or not it runs on this machine)."""
    return sorted(_REGISTRY)


def variant_class(name: str) -> type[AttentionVariant]:
    """The class registered as `name`; ValueError listing the registered names otherwise."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name]


def build(name: str, *, device: str | torch.device | None = None, **options) -> AttentionVariant:
    """Build the variant registered as `name`, with its options, on `device`.

    With a device, the variant must run there; without one (the module's parameters, if any, are
    on the CPU until it is moved), it must run on at least one of its devices on this machine, and
    each call checks the device of its inputs.

    Example:
        >>> attn = build("full")
        >>> q = k = v = torch.randn(1, 2, 16, 8)
        >>> attn(q, k, v, causal=True).shape
        torch.Size([1, 2, 16, 8])
    """
    cls = variant_class(name)
    dev = torch.device(device) if device is not None else None
    reasons = [cls.unavailable_reason(d) for d in ((dev.type,) if dev is not None else cls.spec.devices)]
    if all(reasons):
        raise RuntimeError(f"variant {name!r} is unavailable: {'; '.join(reasons)}")
    try:
        module = cls(**options)
    except TypeError as err:
        allowed = _option_names(cls)
        raise TypeError(
            f"{name}: invalid options {sorted(options)}: {err}; allowed options: {', '.join(allowed)}"
        ) from None
    return module.to(dev) if dev is not None else module


def _option_defaults(cls: type) -> dict[str, object]:
    import inspect

    defaults: dict[str, object] = {}
    for klass in cls.__mro__:  # subclass options first, then the shared ones (scale, num_heads, head_dim)
        if "__init__" in vars(klass) and issubclass(klass, AttentionVariant):
            for p, param in inspect.signature(klass.__init__).parameters.items():
                if param.kind is param.KEYWORD_ONLY and p not in defaults:
                    defaults[p] = param.default
    return defaults


def _option_names(cls: type) -> list[str]:
    return list(_option_defaults(cls))


def options_taken(name: str, options: dict) -> dict:
    """What variant `name` takes of a run's options: the shared ones it accepts (window, compression, ...),
    and those scoped to it as 'name.option' (linformer.max_len), which win over a shared one."""
    accepted = set(option_names(name))
    shared = {key: value for key, value in options.items() if key in accepted}
    scoped = {key.partition(".")[2]: value for key, value in options.items() if key.partition(".")[0] == name}
    return {**shared, **{key: value for key, value in scoped.items() if key in accepted}}


def effective_options(name: str, **given) -> dict[str, object]:
    """Every option of variant `name` with the value it would run with: `given`, else its default."""
    return {**_option_defaults(variant_class(name)), **given}


def option_docs(name: str) -> dict[str, str]:
    """Each option of variant `name` with its description, read from the `Args:` sections of the
    `__init__` docstrings along its classes (the variant's own first); "" where none documents it."""
    docs: dict[str, str] = {}
    for klass in variant_class(name).__mro__:
        init = vars(klass).get("__init__")
        if init is None or not issubclass(klass, AttentionVariant):
            continue
        for option, text in _args_section(init.__doc__ or "").items():
            docs.setdefault(option, text)
    return {option: docs.get(option, "") for option in option_names(name)}


def _args_section(doc: str) -> dict[str, str]:
    """{'window': 'w, the band...'} from a Google-style `Args:` section (continuation lines joined)."""
    import inspect
    import re

    lines = inspect.cleandoc(doc).splitlines()
    found: dict[str, str] = {}
    current = None
    inside = False
    for line in lines:
        if line.strip() == "Args:":
            inside, current = True, None
            continue
        if not inside:
            continue
        match = re.match(r"^\s{4}(\w+)\s*(?:\(.*?\))?:\s*(.*)$", line)
        if match:
            current = match.group(1)
            found[current] = match.group(2).strip()
        elif line.startswith(" " * 8) and current:
            found[current] += " " + line.strip()
        elif line.strip() == "" or not line.startswith(" "):
            inside = line.strip() == "" and inside
            current = None
    return found


def option_names(name: str) -> list[str]:
    """The keyword options the variant `name` accepts."""
    return _option_names(variant_class(name))
