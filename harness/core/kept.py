"""What a training keeps of an attention: the memory its forward pass leaves alive for the backward, measured on
the CPU as the resident set's growth from before the call to after it, while its output (and so the autograd graph)
is held (`harness.core.memory`: every block its own mapping, so a freed one leaves the resident set at once).

A training holds this for every layer until the backward reaches it, so a model of L attention layers keeps L
times it; a call's own peak (bench run's prediction, `memory_estimate`) comes on top, for one layer at a time.
Measured at the N asked, one layer (small blocks below the mapping threshold make it ± a few MiB); a layer whose
call is predicted past the memory budget is not run. Autograd's saved-tensor hooks would count without running,
but they change what is kept: full_naive keeps 3 N x N buffers under them, 2 without.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import variants
from harness.core.memory import pin_mmap_threshold, release_free_memory, rss_bytes


@dataclass(frozen=True)
class Shape:
    """The attention of one layer: batch B, H query heads on Hkv K/V heads of dimension D, in `dtype`."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    causal: bool = True

    def hints(self) -> dict:
        """The shape options a variant is built with (its gates and maps are per head)."""
        return {"num_heads": self.heads, "num_kv_heads": self.kv_heads, "head_dim": self.head_dim}


def kept_bytes(name: str, options: dict, n: int, shape: Shape) -> int:
    """Bytes the forward of variant `name` at N = n leaves alive with its output held (its inputs not counted;
    the process's allocator is pinned to one mapping a block, as bench run's memory cells are)."""
    attn = variants.build(name, **shape.hints(), **options).to(shape.dtype)
    q = torch.randn(shape.batch, shape.heads, n, shape.head_dim, dtype=shape.dtype, requires_grad=True)
    k, v = (
        torch.randn(shape.batch, shape.kv_heads, n, shape.head_dim, dtype=shape.dtype, requires_grad=True)
        for _ in range(2)
    )
    pin_mmap_threshold()
    before = rss_bytes()
    out = attn(q, k, v, causal=shape.causal)
    release_free_memory()
    kept = rss_bytes() - before
    del out
    return max(0, kept)


def model_memory(name: str, options: dict, n: int, shape: Shape, layers: int, training: bool, budget: int) -> dict:
    """What `layers` layers of variant `name` need at N = n: in a training, each layer's kept bytes (measured)
    until the backward, plus one call's peak (bench run's prediction, backward included); in inference, one call's
    peak (the layers run one after another). Keys: kept_layer, kept, peak, total. ValueError where the call's
    predicted peak is over `budget` bytes (nothing is run then)."""
    attn = variants.build(name, device="meta", **shape.hints(), **options)
    size = torch.empty((), dtype=shape.dtype).element_size()
    b, h, d = shape.batch, shape.heads, shape.head_dim
    peak = attn.memory_estimate(b, h, n, n, d, d, size, shape.causal, training)
    if training and peak > budget:
        raise ValueError(
            f"a call is predicted to need {peak / 2**30:.1f} GiB, over the memory budget ({budget / 2**30:.1f} GiB)"
        )
    layer = kept_bytes(name, options, n, shape) if training else 0
    return {"kept_layer": layer, "kept": layers * layer, "peak": peak, "total": layers * layer + peak}
