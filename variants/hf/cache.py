"""Decoding inside a model: `state_cache` (each layer's decoding state as a transformers Cache), and the cache
`generate()` gets in place of its default one.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .layers import (
    ATTRIBUTE,
    IMPLEMENTATION,
    cache_argument,
    _own_cache_window,
    _reads_past,
    _transformers,
    attention_layers,
)
from .checks import _check_model, decoding_refusal


def state_cache(model):
    """A transformers `Cache` that keeps each layer's decoding state (variants/_decoding.py) instead of its keys and
    values, for `model.generate(..., past_key_values=variants.hf.state_cache(model))` after `use`: linear and the
    recurrent variants decode with a constant state, a window keeps its sinks and last w positions, memory_compressed
    its slots, full a KV cache. The prompt and each new token go through the variant's `step`. Positions are the
    model's own (RoPE is applied before the cache, so a window's kept keys keep their absolute rotations, as in
    the forward). Padded batches decode as the forward computes them (each state keeps its positions' padding
    masks, a recurrence skips padded positions; tested with left padding). Not supported: cropping (assisted
    generation), which a state cannot undo; beam search reorders the states.

    Example:
        >>> out = model.generate(ids, max_new_tokens=64, past_key_values=variants.hf.state_cache(model))
    """
    _transformers()
    layers = {path: layer for path, layer in _check_model(model).items() if ATTRIBUTE in layer._modules}
    if not layers:
        raise ValueError(
            "variants.hf.state_cache: the model has no attnbench variant attached; call variants.hf.use(model, "
            "variant) first"
        )
    ordered = sorted(layers.values(), key=lambda layer: getattr(layer, "layer_idx", 0))
    for layer in ordered:
        reason = decoding_refusal(layer._modules[ATTRIBUTE])
        if reason:
            raise ValueError(f"variants.hf.state_cache: {layer._modules[ATTRIBUTE].spec.name} cannot decode: {reason}")
    return _state_cache_class()([_state_layer_class()(layer._modules[ATTRIBUTE]) for layer in ordered])


@functools.lru_cache(maxsize=1)
def _state_layer_class():
    from transformers.cache_utils import CacheLayerMixin

    class StateLayer(CacheLayerMixin):
        """One layer's decoding state. `update` hands the new keys and values on (marking them for the layer's
        attention call, which steps the state); the state, not the keys, is what is kept."""

        is_sliding = False
        is_compileable = False
        is_croppable = False

        def __init__(self, attn):
            super().__init__()
            self.attn, self.state, self.pending = attn, None, None

        def lazy_initialization(self, key_states, value_states):
            self.device, self.is_initialized = key_states.device, True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.pending = key_states  # the layer's attention call, next, finds it and steps the state
            self.attn.__dict__["_attnbench_state_layer"] = self
            return key_states, value_states

        def get_seq_length(self) -> int:
            return 0 if self.state is None else self.state.length

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            self.state, self.pending, self.is_initialized = None, None, False

        def reorder_cache(self, beam_idx) -> None:
            self._select(beam_idx)

        def batch_select_indices(self, indices) -> None:
            self._select(indices)

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.state is not None:
                self._select(torch.arange(self.state.batch, device=self.device).repeat_interleave(repeats))

        def _select(self, index) -> None:
            if self.state is not None:
                from dataclasses import replace

                index = index.to(self.device)
                self.state = replace(
                    self.state,
                    batch=int(index.numel()),
                    tensors={k: t.index_select(0, index) for k, t in self.state.tensors.items()},
                )

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError(
                "variants.hf.state_cache: a decoding state cannot drop positions (crop); "
                "use the default cache for assisted generation"
            )

    return StateLayer


@functools.lru_cache(maxsize=1)
def _state_cache_class():
    from transformers.cache_utils import Cache

    class StateCache(Cache):
        """Every layer's decoding state (see `state_cache`)."""

        def __init__(self, layers):
            super().__init__(layers=layers)

    return StateCache


def _state_step(
    attn, layer, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None, causal: bool
) -> Tensor:
    """The layer's attention with its decoding state: every call, the prompt included, by the variant's `step` (one
    pass gives the outputs and the state; a long prompt is stepped in bounded pieces)."""
    layer.pending = None
    if not causal:
        raise ValueError(
            f"variants.hf.state_cache: {type(attn).__name__} is called without causality; decoding is causal"
        )
    if layer.state is None:
        b, h, _, d = query.shape
        layer.state = attn.init_state(b, h, d, value.shape[-1], query.dtype, query.device, kv_heads=key.shape[1])
    out, layer.state = attn.step(
        query, key, value, layer.state, key_padding_mask=key_padding_mask
    )  # the new positions'
    return out


def _keep_what_the_variants_read(model) -> None:
    """Make the model's caches hold what its variants read, without touching its config: `generate()` gets
    the state cache (each layer's decoding state: what the variant reads, by definition), and where the model's
    own cache would drop positions a variant reads, a forward with use_cache=True and no cache gets one that
    keeps every position. Installed once per model (instance attributes, never saved)."""
    if "_attnbench_hooks" in model.__dict__:
        return
    if hasattr(
        type(model), "_prepare_cache_for_generation"
    ):  # (an object holding the model: copies and pickles follow it)
        model.__dict__["_prepare_cache_for_generation"] = _GenerationCache(model)
    model.__dict__["_attnbench_hooks"] = model.register_forward_pre_hook(_cache_of_every_position, with_kwargs=True)


class _GenerationCache:
    """The model's `_prepare_cache_for_generation`: generate()'s own cache preparation, then `_generation_cache`'s choice."""

    def __init__(self, model):
        self.model = model

    def __call__(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        model = self.model
        type(model)._prepare_cache_for_generation(
            model, generation_config, model_kwargs, generation_mode, *args, **kwargs
        )
        _generation_cache(model, model_kwargs, generation_config, generation_mode)


def _cache_of_every_position(model, args, kwargs):
    """Forward pre-hook: a forward with use_cache and no cache, on a model whose own cache would drop positions
    its variant reads, gets a DynamicCache without config (every layer keeps every position)."""
    name = cache_argument(model)
    use_cache = kwargs.get("use_cache")
    use_cache = getattr(model.config, "use_cache", False) if use_cache is None else use_cache
    if name and use_cache and kwargs.get(name) is None and _cache_drops_what_is_read(model):
        from transformers import DynamicCache

        kwargs[name] = DynamicCache()
    return args, kwargs


def _cache_drops_what_is_read(model) -> bool:
    record = getattr(model.config, "attnbench", None)
    window = _own_cache_window(model.config)
    return bool(
        record
        and window
        and model.config._attn_implementation == IMPLEMENTATION
        and _reads_past(record["variant"], record["options"], window)
    )


def _generation_cache(model, model_kwargs: dict, generation_config, generation_mode) -> None:
    """generate()'s cache after `use`: the state cache in place of the default DynamicCache (a cache the user
    passed, or chose by cache_implementation, is kept), for the generation modes a state can follow (not
    assisted generation, which crops); otherwise a DynamicCache of every position where the default one
    would drop what a variant reads."""
    transformers = _transformers()
    key = next((name for name in ("cache", "past_key_values") if name in model_kwargs), None)
    made = None if key is None else model_kwargs[key]
    if type(made) is not transformers.DynamicCache or getattr(made, "_is_user_defined", False):
        return
    if model.config._attn_implementation != IMPLEMENTATION or generation_config.cache_implementation not in (
        None,
        "dynamic",
    ):
        return
    mode = getattr(generation_mode, "value", generation_mode)
    layers = [layer for layer in attention_layers(model).values() if ATTRIBUTE in layer._modules]
    decodes = all(decoding_refusal(layer._modules[ATTRIBUTE]) is None for layer in layers)
    if decodes and mode in STATE_CACHE_MODES and not model.config.is_encoder_decoder:
        model_kwargs[key] = state_cache(model)
    elif _cache_drops_what_is_read(model):
        model_kwargs[key] = transformers.DynamicCache()


STATE_CACHE_MODES = (
    "greedy_search",
    "sample",
    "beam_search",
    "beam_sample",
)  # generate() modes the state cache follows
