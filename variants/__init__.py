"""attnbench variants: attention implementations behind one interface, and modules that use them.

    import variants
    variants.available()                       # registered names
    attn = variants.build("sliding_window", window=128)
    out = attn(q, k, v, causal=True)           # (B, H, N, D) -> (B, H, N, Dv)

Importing this package registers every variant: each module of `variants/methods/` (one method a
file) is imported and registers itself, so a method file placed there needs no other edit. It
imports no optional dependency (xformers is imported only when `full_xformers` is built for a CUDA device).
"""

import importlib
import pkgutil

from . import methods
from ._registry import (
    available,
    baseline,
    build,
    check_options,
    check_variant_options,
    effective_options,
    option_docs,
    option_names,
    options_taken,
    register,
    unregister,
    variant_class,
)
from ._spec import VariantSpec
from ._variant import AttentionVariant
from .modules import MultiHeadAttention, TransformerBlock
from .positions.sinusoidal import SinusoidalPositionalEncoding
from .swap import swap_attention


def _import_methods() -> None:
    """Import every method file of `variants/methods/` (in name order; files starting with _ are helpers)."""
    for info in sorted(pkgutil.iter_modules(methods.__path__), key=lambda info: info.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{methods.__name__}.{info.name}")


_import_methods()

__all__ = [
    "AttentionVariant",
    "VariantSpec",
    "available",
    "baseline",
    "build",
    "check_options",
    "check_variant_options",
    "effective_options",
    "option_docs",
    "option_names",
    "options_taken",
    "register",
    "unregister",
    "variant_class",
    "MultiHeadAttention",
    "SinusoidalPositionalEncoding",
    "TransformerBlock",
    "swap_attention",
]
