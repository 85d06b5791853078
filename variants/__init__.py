"""attnbench variants: attention implementations behind one interface, and modules that use them.

    import variants
    variants.available()                       # registered names
    attn = variants.build("sliding_window", window=128)
    out = attn(q, k, v, causal=True)           # (B, H, N, D) -> (B, H, N, Dv)

Importing this package registers every variant; it imports no optional dependency (xformers is
imported only when `full_xformers` is built for a CUDA device).
"""

from ._base import (
    AttentionVariant,
    VariantSpec,
    available,
    build,
    effective_options,
    option_docs,
    option_names,
    options_taken,
    register,
    unregister,
    variant_class,
)
from .modules import MultiHeadAttention, SinusoidalPositionalEncoding, TransformerBlock, swap_attention

# each import registers one variant
from . import full, full_naive, full_xformers, sliding_window, sliding_window_flex, linear, memory_compressed  # noqa: E402,F401  isort: skip

__all__ = [
    "AttentionVariant",
    "VariantSpec",
    "available",
    "build",
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
