"""Position encodings: how a model knows where a token is, one file each with its formula on top.

Three places an encoding can act, and which methods can carry it:

- "input": added to the token embeddings before the first layer (`sinusoidal`, `learned`); every method.
- "rotation": q and k rotated by their positions before the scores (`rope`); every method, since it changes
  q and k and not how they are combined.
- "bias": a score added to q·k by distance (`alibi`, `relative`); only a method that forms the scores: its spec
  says so (`carries_score_bias`), and `score_bias_unsupported_reason` says why another cannot.
- `none` (NoPE): nothing; a causal mask (and a short convolution, where the model has one) is all the order a
  model sees.

The quality models take one by name (`bench quality --positions`); `MultiHeadAttention(positions=...)` takes
the rotation and the biases.
"""

from __future__ import annotations

from torch import nn

from .._registry import variant_class
from .alibi import AlibiBias
from .learned import LearnedPositionalEmbedding
from .relative import T5RelativeBias
from .rope import RotaryEmbedding
from .sinusoidal import SinusoidalPositionalEncoding

# name -> where it acts (the order of the docs and the reports)
ENCODINGS = {
    "sinusoidal": "input",
    "learned": "input",
    "rope": "rotation",
    "alibi": "bias",
    "relative": "bias",
    "none": "none",
}


def check_encoding(name: str) -> str:
    """`name` if it is an encoding; else ValueError naming the choices."""
    if name not in ENCODINGS:
        raise ValueError(f"positions={name!r} is not a position encoding; choose one of {', '.join(ENCODINGS)}")
    return name


def encoding_unsupported_reason(variant: str, name: str) -> str | None:
    """None when attention `variant` can carry encoding `name`, else why not (a bias needs the scores)."""
    if ENCODINGS[check_encoding(name)] != "bias":
        return None
    return variant_class(variant).score_bias_unsupported_reason()


def input_encoding(name: str, d_model: int, max_len: int) -> nn.Module | None:
    """The module that adds encoding `name` to (B, N, d_model) embeddings, or None where it acts elsewhere."""
    if check_encoding(name) == "sinusoidal":
        return SinusoidalPositionalEncoding(d_model, max_len)
    if name == "learned":
        return LearnedPositionalEmbedding(d_model, max_len)
    return None


def attention_encoding(name: str | None, num_heads: int, head_dim: int) -> nn.Module | None:
    """The module an attention applies for encoding `name`: a `RotaryEmbedding` of q and k, or a score bias
    (`AlibiBias`, `T5RelativeBias`); None for an encoding of the inputs, or none."""
    if name is None or ENCODINGS[check_encoding(name)] in ("input", "none"):
        return None
    if name == "rope":
        return RotaryEmbedding(head_dim)
    return AlibiBias(num_heads) if name == "alibi" else T5RelativeBias(num_heads)


__all__ = [
    "ENCODINGS",
    "AlibiBias",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "T5RelativeBias",
    "attention_encoding",
    "check_encoding",
    "encoding_unsupported_reason",
    "input_encoding",
]
