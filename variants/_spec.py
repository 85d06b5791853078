"""`VariantSpec`: what a variant is and can do, the facts the harness and the tests read instead of tables
keyed by variant names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VariantSpec:
    """What a variant is and what it can do; the harness reads only this and `flops`."""

    name: str  # registered name, e.g. "sliding_window"
    summary: str  # one line: what the method does
    reference: str  # the paper (or library) it implements
    time_complexity: str  # e.g. "O(N^2 D)"
    memory_complexity: str  # extra memory beyond inputs and output, e.g. "O(N w)"
    supports_causal: bool = True
    # the `scale` option acts as a factor of q (dot-product scores); False: it multiplies scores of another form
    scale_is_query_factor: bool = True
    why_not_causal: str = ""  # where supports_causal is False: the method's reason, for errors and skipped cells
    supports_non_causal: bool = True  # False: causal by nature (a recurrence over positions): causal=False is refused
    why_not_non_causal: str = ""  # where supports_non_causal is False: the method's reason
    # (step, why) for each of "export", "compile", "onnx" the variant cannot take (tested)
    not_deployable: tuple[tuple[str, str], ...] = ()
    # the option bounding N (a learned projection's columns): variants.hf fills it from max_position_embeddings
    max_len_option: str | None = None
    supports_cross_attention: bool = True  # Nq != Nk without causal (causal Nq <= Nk: every variant)
    supports_key_padding_mask: bool = True
    # forms the query-key scores and adds a score bias to them (`forward(..., score_bias=)`: ALiBi, T5's relative
    # bias); False: `why_no_score_bias`, or the reason its kind implies
    carries_score_bias: bool = False
    why_no_score_bias: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types it runs on
    backward_devices: tuple[str, ...] = ("cpu", "cuda")  # device types where backward works
    dtypes: tuple[str, ...] = ("float32", "float64", "float16", "bfloat16")
    # memory (and, where the method is, time) below O(N^2); the complexity tests hold it to that
    subquadratic: bool = False
    notes: str = ""  # anything a user must know (e.g. what causal means for this method)

    # -- facts the harness and the tests read instead of tables keyed by names --
    # another variant computing the same function with the options they share and the same scale (tested):
    # its quality stands for this one's
    same_function_as: str | None = None
    # the option bounding how far back a position sees (a window): readers mark it, judge accuracy inside and beyond
    reach_option: str | None = None
    # options that change the function computed: a speed run and a quality run must agree on them
    function_options: tuple[str, ...] = ()
    style: tuple[str, str] | None = None  # (colour, marker) in every figure; None: a stable pick from the name
    # option sets that exercise every path at a test's small N (N ~ 13)
    examples: tuple[tuple[tuple[str, object], ...], ...] = ((),)
    # grouped-query inputs (Hkv < H): "" computed natively (no K/V repeated in memory); else why K, V are
    # repeated to the H query heads first
    repeats_kv: str = ""
    # the decoding state's heads: None as `repeats_kv`; "" one per K/V head even where the forward repeats;
    # else why per query head
    state_repeats_kv: str | None = None
    # the family of methods it stands for where a run trains one variant a family (bench quality --preset
    # long); "" none
    family: str = ""
    # one of the variants `bench quality --preset positions` trains: a way a method handles order (exact softmax,
    # a window, a kernel, decaying recurrences, a learned decay inside softmax)
    position_study: bool = False
    # the kind of method the figures draw it among, a small multiple each (beside the baseline): "exact",
    # "local and sparse", "kernel", "low-rank and compressed", "recurrent"
    kind: str = ""
    # the variant every other is compared with (speed-ups, crossovers, the accuracy floor of bench advise):
    # exact softmax through the fastest kernel every device has; one registered variant says so
    baseline: bool = False
    # option sets `bench lm` measures the variant with by default, inside a pretrained model ((): not by default)
    lm_defaults: tuple[tuple[tuple[str, object], ...], ...] = ()

    def score_bias_reason(self) -> str | None:
        """None when the variant carries a score bias (`carries_score_bias`), else why not: `why_no_score_bias`, or
        the reason its kind implies."""
        if self.carries_score_bias:
            return None
        if self.why_no_score_bias:
            return f"{self.name} takes no score bias: {self.why_no_score_bias}"
        if self.kind in ("kernel", "recurrent"):
            return (
                f"{self.name} never forms the query-key scores a bias is added to ({self.kind} attention; its "
                "decays, where it has them, act as one); a rotation (rope) or an input encoding reaches it"
            )
        if self.kind == "low-rank and compressed":
            return (
                f"{self.name} scores keys mixed across positions (projections, landmarks, compressed blocks), so no "
                "score has one distance to bias; a rotation (rope) or an input encoding reaches it"
            )
        return f"{self.name} takes no score bias: not implemented here (its spec does not carry one)"

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
            "kind": self.kind,
            "baseline": self.baseline,
        }
