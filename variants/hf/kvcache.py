"""A KV-cache policy inside a `transformers` model: an exact prefill that records every layer's queries, the
cache compressed by a policy (variants/kvcache/), and tokens fed after it at their true positions.

    cache, prompt = prefill(model, ids)                     # exact attention; prompt: each layer's queries
    small = compressed(model, cache, prompt, policy, 0.5)   # a new cache; `cache` stays whole (branch many)
    logits = feed(model, next_ids, small, start=ids.shape[1])

The attention function registered as "attnbench_kv" is scaled dot-product attention, bottom-right causal
(new positions see every kept one), so layers may keep different counts (PyramidKV) and no N x N mask is
built. RoPE is applied before the cache: kept keys keep their original rotations, new tokens get theirs.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from .. import kvcache
from .layers import cache_argument, _transformers, attention_layers

KV_IMPLEMENTATION = "attnbench_kv"
RECORD = "_attnbench_kv_queries"  # a layer's list the attention function appends its queries to, while recording


def _attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, **kwargs):
    """(B, H, t, D) queries over (B, Hkv, m, D) keys whose last t are theirs -> ((B, t, H, Dv), None)."""
    record = module.__dict__.get(RECORD)
    if record is not None:
        record.append(query)
    out = kvcache.attend(query, key, value, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, attention_mask=None, **kwargs):
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("variants.hf.kvcache: padded batches are not supported (one sequence, or equal lengths)")
    return None


@functools.lru_cache(maxsize=1)
def _registered() -> str:
    transformers = _transformers()
    transformers.AttentionInterface.register(KV_IMPLEMENTATION, _attention)
    transformers.AttentionMaskInterface.register(KV_IMPLEMENTATION, _no_mask)
    return KV_IMPLEMENTATION


def _layers(model) -> list:
    return sorted(attention_layers(model).values(), key=lambda layer: getattr(layer, "layer_idx", 0))


def rope_of(model):
    """positions (P,) -> (cos, sin) of shape (P, D): the model's rotary embedding, or None if it has none."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return None
    like = next(model.parameters())

    def rope(positions: Tensor):
        cos, sin = rotary(like[:1], positions[None].to(like.device))
        return cos[0].float(), sin[0].float()

    return rope


@contextlib.contextmanager
def kv_attention(model):
    """The model's attention is "attnbench_kv" inside (feeds skip the switch: timed tokens pay nothing for it)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(_registered())
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def feed(model, ids: Tensor, cache, start: int, record: bool = False):
    """Logits (B, t, V) of `ids` (B, t) at positions start.. after `cache` (extended in place); with `record`,
    also each layer's queries (B, H, t, D)."""
    switched = model.config._attn_implementation != KV_IMPLEMENTATION
    layers = _layers(model) if record else []
    for layer in layers:
        layer.__dict__[RECORD] = []
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    try:
        with kv_attention(model) if switched else contextlib.nullcontext(), torch.no_grad():
            logits = model(ids, position_ids=positions, use_cache=True, **{cache_argument(model): cache}).logits
        queries = [layer.__dict__[RECORD][0] for layer in layers]
    finally:
        for layer in layers:
            layer.__dict__.pop(RECORD, None)
    return (logits, queries) if record else logits


def empty_cache():
    return _transformers().DynamicCache()


def branch(cache):
    """A cache holding the same keys and values (not copied: a feed appends to its own)."""
    out = empty_cache()
    for index, layer in enumerate(cache.layers):
        out.update(layer.keys, layer.values, index)
    return out


def prompts(model, cache, queries: list[Tensor]) -> list[kvcache.Prompt]:
    """Each layer's kvcache.Prompt: the cache's keys and values, the recorded queries, the rotary embedding."""
    rope, layers = rope_of(model), _layers(model)
    return [
        kvcache.Prompt(
            cache.layers[i].keys, cache.layers[i].values, q, i, len(layers), rope, getattr(layers[i], "scaling", None)
        )
        for i, q in enumerate(queries)
    ]


def compressed(cache, index: list[Tensor]):
    """A new cache of each layer's kept positions (`index[layer]`: (B, Hkv, n) from a policy's `keep`)."""
    out = empty_cache()
    for i, layer in enumerate(cache.layers):
        out.update(*kvcache.gathered(layer.keys, layer.values, index[i]), i)
    return out


def prefill(model, ids: Tensor):
    """(logits, the exact cache, each layer's kvcache.Prompt) of a prompt `ids` (B, N)."""
    cache = empty_cache()
    logits, queries = feed(model, ids, cache, 0, record=True)
    return logits, cache, prompts(model, cache, queries)


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
