"""What a method file imports: the interface in four rooms, each importing only those above it.

_spec.py      VariantSpec: what a variant is and can do (the facts the harness reads)
_checks.py    the input checks every call passes, and the masks of exact attention
_variant.py   AttentionVariant: the one call, (B, H, N, D) in and out; its decoding half in _decoder.py
_registry.py  register, build, and the options each variant takes

from .._base import AttentionVariant, VariantSpec, register
"""

from ._checks import causal_mask, dense_mask, distances
from ._registry import register
from ._spec import VariantSpec
from ._variant import AttentionVariant

__all__ = ["AttentionVariant", "VariantSpec", "causal_mask", "dense_mask", "distances", "register"]
