"""Any attention variant inside a Hugging Face `transformers` model: training, evaluation, `generate()`.

    import variants.hf
    model = LlamaForCausalLM(config)                       # or from_pretrained(...)
    variants.hf.use(model, "sliding_window", window=64)    # every attention layer, weights kept
    model.generate(input_ids, max_new_tokens=20)           # with the KV cache, as usual

How it plugs in: `transformers` models call their attention through `AttentionInterface` (one
function per implementation name, chosen by `config._attn_implementation`) and build its mask
through `AttentionMaskInterface`. This module registers one implementation, "attnbench", whose
function hands each layer's q, k, v to the variant attached to that layer, and whose mask is the
2-D padding mask only (as for FlashAttention): the variants apply causality and windows themselves,
so no Nq x Nk mask is ever built for them.

What the model passes is honoured: grouped-query attention (K and V handed over with their own heads: a
variant computes the groups natively, its state holding the model's K/V heads, or repeats them with the
reason its spec gives), the layer's `scaling`, left and right padding (padded query rows give zeros, never NaN), the
layer's `is_causal` (encoders are bidirectional), and with a KV cache the queries are the last Nq of
the Nk positions (the variants' bottom-right causal). `sliding_window` without a `window=` takes the
model's `config.sliding_window` W, which there counts the query itself: this project's window W - 1.

A variant with parameters (memory_compressed) gets one module per attention layer, attached to it as
`attnbench_attention`: its parameters are in `model.parameters()`, trained, and saved by
`save_pretrained`; `use` on a model loaded from such a checkpoint restores them.

Needs the `hf` extra (`pip install -e '.[hf]'`); `import variants` never imports transformers.
"""

from __future__ import annotations

import functools
import inspect
import json
import os

import torch
from torch import Tensor, nn

from ._base import available, build, option_names, variant_class

IMPLEMENTATION = "attnbench"  # the name `use` sets as the model's attention implementation
ATTRIBUTE = "attnbench_attention"  # the variant module attached to each attention layer
HF_EXTRA = "pip install -e '.[hf]'"
FROM_LAYER = ("num_heads", "head_dim", "num_kv_heads")  # options each layer supplies itself
UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "head_mask")  # score modifiers no variant has


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"variants.hf needs the transformers package: {HF_EXTRA} ({err})") from None
    return transformers


# -- public API ------------------------------------------------------------------------------------


def use(model, variant: str, *, reinit: bool = False, **options):
    """Switch every attention layer of a `transformers` model to `variant`, keeping the model's weights.

    Options are the variant's own (see `bench list`), except num_heads and head_dim, which each layer
    gives. `scale` defaults to the layer's own `scaling`; `window` (sliding windows) to the model's
    `config.sliding_window` - 1 on the layers the model windows, while its global layers (a local/global
    model: Gemma 3, Cohere 2, Qwen2 with max_window_layers) stay global (full); `window=w` windows every
    layer. Calling `use` again with another variant replaces the previous one; again with the same variant
    and options keeps the attached modules (their trained parameters) unless `reinit=True`.

    Nothing else the model computes or saves changes: its config is left as it is (`config.attnbench`
    records the variant, which the model's own attention ignores on reload). `generate()` then keeps each
    layer's decoding state (`state_cache`), and a forward with `use_cache=True` a cache of every position
    where the model's own cache would keep only its window but the variant reads further back.
    Returns the model (switched in place; on an error nothing is changed).

    Example:
        >>> model = variants.hf.use(LlamaForCausalLM(config), "linear")
    """
    _transformers()
    if not isinstance(reinit, bool):
        raise TypeError(f"variants.hf.use: reinit must be a bool, got {reinit!r}")
    _check_variant(variant, options)
    layers = _check_model(model)
    config = model.config
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise ValueError(
            f"variants.hf.use: {type(model).__name__} caps its attention scores (attn_logit_softcapping="
            f"{softcap}); the attnbench variants compute plain scaled dot-product scores"
        )
    _check_model_fits(model, variant)
    record = {"variant": variant, "options": options}
    again = (
        not reinit
        and config._attn_implementation == IMPLEMENTATION
        and getattr(config, "attnbench", None) == record
        and all(ATTRIBUTE in layer._modules for layer in layers.values())
    )
    modules = {}
    like = next(model.parameters(), None)
    for path, layer in layers.items():
        _check_layer_fits(model, path, layer, variant)
        if again:
            modules[path] = layer._modules[ATTRIBUTE]  # the same variant again: its (trained) parameters kept
        else:
            modules[path] = _variant_for_layer(config, f"{type(model).__name__}.{path}", layer, variant, options, like)
    before = {path: layer._modules.get(ATTRIBUTE) for path, layer in layers.items()}
    had = (config._attn_implementation, getattr(config, "attnbench", None))
    try:  # only once every layer is known to work, and undone if the model refuses late: all or nothing
        for path, layer in layers.items():
            if ATTRIBUTE in layer._modules:
                del layer._modules[ATTRIBUTE]
            layer.add_module(ATTRIBUTE, modules[path])
        if not again:
            _load_saved_variant_weights(model)
        _register_implementation(IMPLEMENTATION, None)
        model.set_attn_implementation(IMPLEMENTATION)
        model.config.attnbench = record  # saved with config.json, for the record
        _keep_what_the_variants_read(model)
    except Exception:
        for path, layer in layers.items():
            layer._modules.pop(ATTRIBUTE, None)
            if before[path] is not None:
                layer.add_module(ATTRIBUTE, before[path])
        if had[0] != config._attn_implementation:
            model.set_attn_implementation(had[0])
        if had[1] is None:
            config.__dict__.pop("attnbench", None)
        else:
            config.attnbench = had[1]
        raise
    return model


def register(variant: str, **options) -> str:
    """Register a parameter-free variant as an attention implementation; returns its name.

    The name can be given as `attn_implementation=` to `from_pretrained` / `from_config`, or to
    `model.set_attn_implementation`. Each layer builds its variant on first use (options as in `use`).
    A variant with parameters (memory_compressed) must be attached with `use`, which gives each layer
    its own parameters.

    Example:
        >>> name = variants.hf.register("sliding_window", window=63)
        >>> model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    """
    _transformers()
    _check_variant(variant, options)
    probe = build(variant, num_heads=1, head_dim=8, **options)
    if any(True for _ in probe.parameters()):
        raise ValueError(
            f"variants.hf.register: {variant} has parameters (one set per layer), so it cannot be a shared "
            f"attention implementation; use variants.hf.use(model, {variant!r}, ...) to attach it to each layer"
        )
    name = "attnbench_" + variant + "".join(f"_{key}_{value}" for key, value in sorted(options.items()))
    _register_implementation(name, (variant, dict(options)))
    return name


def without_attention_dropout(model):
    """Zero the attention dropout of every attention layer of a built model (the layers copied it from the config
    when they were built: `attention_dropout` floats, nn.Dropout modules such as BERT's `dropout` and GPT-2's
    `attn_dropout`), so that it can train with a variant, which has none. Returns the model; the rest of its
    dropout (residual, embeddings) is left as it is.

    Example:
        >>> model = variants.hf.use(variants.hf.without_attention_dropout(model.train()), "linear")
    """
    _transformers()
    for layer in _check_model(model).values():
        for key, value in list(vars(layer).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(layer, key, 0.0)
        for child in layer.children():
            if isinstance(child, nn.Dropout):
                child.p = 0.0
    return model


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
        reason = _decoding_refusal(layer._modules[ATTRIBUTE])
        if reason:
            raise ValueError(f"variants.hf.state_cache: {layer._modules[ATTRIBUTE].spec.name} cannot decode: {reason}")
    return _state_cache_class()([_state_layer_class()(layer._modules[ATTRIBUTE]) for layer in ordered])


def _decoding_refusal(attn) -> str | None:
    """Why this variant module cannot keep a decoding state (its method, or its options: performer with eps > 0,
    cosformer without max_len), or None."""
    reason = attn.decode_unsupported_reason()
    if reason:
        return reason
    d = getattr(attn, "head_dim", None) or 8
    try:
        heads = getattr(attn, "num_heads", None) or 1
        attn.init_state(
            1, heads, d, getattr(attn, "value_dim", None) or d, kv_heads=getattr(attn, "num_kv_heads", None) or heads
        )
    except (ValueError, TypeError) as err:
        return str(err)
    return None


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


def attention_layers(model) -> dict[str, nn.Module]:
    """{dotted path: module} of every layer of `model` that calls its attention through AttentionInterface."""
    return {path: module for path, module in model.named_modules() if _calls_attention_interface(type(module))}


# -- checks ----------------------------------------------------------------------------------------


def _check_model(model) -> dict[str, nn.Module]:
    """The model's attention layers; TypeError/ValueError when it is not a model whose attention can switch."""
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"variants.hf.use: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    layers = attention_layers(model) if model._can_set_attn_implementation() else {}
    if not layers:
        raise ValueError(
            f"variants.hf.use: {type(model).__name__} does not route its attention through transformers' "
            f"AttentionInterface, so its attention cannot be switched (model families that do: Llama, "
            f"Mistral, Qwen2, GPT-NeoX, BERT, ...)"
        )
    return layers


def _check_variant(variant: str, options: dict) -> None:
    if not isinstance(variant, str) or variant not in available():
        raise ValueError(f"variants.hf: unknown variant {variant!r}; available: {', '.join(available())}")
    given = [key for key in FROM_LAYER if key in options]
    if given:
        raise TypeError(f"variants.hf: {variant}: options {given} come from each attention layer; do not pass them")
    unknown = sorted(set(options) - set(option_names(variant)))
    if unknown:
        allowed = [name for name in option_names(variant) if name not in FROM_LAYER]
        raise TypeError(f"variants.hf: {variant} takes no option(s) {unknown}; allowed options: {', '.join(allowed)}")


@functools.lru_cache(maxsize=None)
def _calls_attention_interface(cls: type) -> bool:
    """Whether the class's own forward calls AttentionInterface (its source read once per class)."""
    forward = vars(cls).get("forward")
    if forward is None or not issubclass(cls, nn.Module):
        return False
    try:
        return "ALL_ATTENTION_FUNCTIONS.get_interface(" in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


CROSS_ATTENTION_NAMES = ("crossattention", "cross_attention", "cross_attn", "encoder_attn", "encdecattention")


def _is_cross_attention(path: str, layer: nn.Module) -> bool:
    """Layers whose keys come from another sequence (an encoder's): by flag, class or the names families give them."""
    names = [type(layer).__name__.lower(), *path.lower().split(".")]
    decoders_other = (
        bool(getattr(layer, "is_decoder", False)) and getattr(layer, "is_causal", True) is False
    )  # BART's encoder_attn
    return (
        bool(getattr(layer, "is_cross_attention", False))
        or decoders_other
        or any(n in part for n in CROSS_ATTENTION_NAMES for part in names)
    )


def _check_layer_fits(model, path: str, layer: nn.Module, variant: str) -> None:
    device = next((p.device.type for p in model.parameters()), "cpu")
    _check_layer(
        f"{type(model).__name__}.{path} ({type(layer).__name__})",
        "variants.hf.use",
        path,
        layer,
        variant,
        device,
        model.training,
    )


def _check_layer(
    where: str, caller: str, path: str, layer: nn.Module, variant: str, device: str, training: bool
) -> None:
    """ValueError/RuntimeError when `variant` cannot be this layer's attention (`where` names it in the message)."""
    spec = variant_class(variant).spec
    if callable(getattr(layer, "prepare_dynamic_mask", None)):
        raise ValueError(
            f"{caller}: {where} adds an input-dependent mask to its scores (Doge's dynamic mask "
            f"attention, a 4-D mask made from the values); the attnbench variants take a padding mask only"
        )
    if isinstance(getattr(layer, "sinks", None), Tensor):
        raise ValueError(
            f"{caller}: {where} adds learned attention sinks to its softmax (GPT-OSS: a logit per head that "
            f"takes weight from every key); the attnbench variants compute plain softmax attention"
        )
    if getattr(layer, "has_relative_attention_bias", False) or hasattr(layer, "relative_attention_bias"):
        raise ValueError(
            f"{caller}: {where} adds a learned position bias to its scores (T5-style); the attnbench "
            f"variants compute plain scaled dot-product scores"
        )
    if not spec.supports_causal and getattr(layer, "is_causal", True):
        raise ValueError(
            f"{caller}: {where} is causal (a decoder); {variant} is not causal: {spec.why_not_causal} "
            f"(use it in a bidirectional encoder such as BERT)"
        )
    if not spec.supports_non_causal and not getattr(layer, "is_causal", True):
        raise ValueError(
            f"{caller}: {where} is not causal (an encoder's bidirectional attention); {variant} is "
            f"causal only: {spec.why_not_non_causal} (use it in a decoder)"
        )
    if not spec.supports_non_causal and _is_cross_attention(path, layer):
        raise ValueError(
            f"{caller}: {where} is a cross-attention layer (every query sees the whole encoder "
            f"sequence); {variant} is causal only: {spec.why_not_non_causal}"
        )
    if _is_cross_attention(path, layer) and not spec.supports_cross_attention:
        raise ValueError(
            f"{caller}: {where} is a cross-attention layer (queries and keys from different "
            f"sequences); {variant} has no cross-attention"
        )
    reason = variant_class(variant).unavailable_reason(device)
    if reason:
        raise RuntimeError(f"{caller}: {where}: {variant} cannot run on the model's device: {reason}")
    if training:
        reason = variant_class(variant).backward_unsupported_reason(device)
        if reason:
            raise RuntimeError(
                f"{caller}: {where}: the model is in training mode, but {reason}; call "
                f"model.eval() and run it under torch.no_grad(), or use a variant with a backward there"
            )


def _variant_for_layer(
    config, where: str, layer: nn.Module, variant: str, options: dict, like: Tensor | None
) -> nn.Module:
    """The variant module one layer runs: its heads, head dim, scale and (sliding windows) window; on the
    device of `like` (a parameter of the model), and in its dtype where the variant has parameters."""
    heads, head_dim, value_dim = _layer_shape(config, layer)
    chosen = dict(options)
    groups = getattr(layer, "num_key_value_groups", 1) or 1
    if heads and heads % groups == 0:
        chosen["num_kv_heads"] = heads // groups  # grouped-query: the layer's K/V heads
    if value_dim != head_dim and "value_dim" in option_names(variant) and "value_dim" not in chosen:
        chosen["value_dim"] = value_dim  # (MLA-shaped layers: DeepSeek-V3's values are narrower than its keys)
    reach = variant_class(variant).spec.reach_option  # a window bounding how far back a position sees
    if reach is not None and reach not in chosen:
        kind = _layer_kind(config, layer)
        if kind == "full_attention":  # a local/global model's global layer stays global: exact softmax
            variant, chosen = "full", {key: value for key, value in chosen.items() if key == "scale"}
        else:
            window = getattr(layer, "sliding_window", None) or getattr(config, "sliding_window", None)
            if window is None:
                raise ValueError(
                    f"variants.hf: {where}: {variant} needs window=: the model's config has no "
                    f"sliding_window to take it from"
                )
            chosen[reach] = max(int(window) - 1, 1)  # transformers' W counts the query itself
    spec = variant_class(variant).spec
    if spec.max_len_option and spec.max_len_option not in chosen and getattr(config, "max_position_embeddings", None):
        chosen[spec.max_len_option] = int(
            config.max_position_embeddings
        )  # parameters sized to the model's longest input
    if "scale" not in chosen and getattr(layer, "scaling", None) is not None and spec.scale_is_query_factor:
        chosen["scale"] = float(layer.scaling)
    module = build(variant, num_heads=heads, head_dim=head_dim, **chosen)
    module._attnbench_fixed_scale = "scale" in options  # the user's scale wins over the layer's
    if like is not None:
        module = module.to(like.device)
        if any(True for _ in module.parameters()):
            module = module.to(like.dtype)
    return module


def _layer_shape(config, layer: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(query heads, q/k head dim, value head dim) of one layer: its own where it keeps them (BART's decoder
    heads differ from its encoder's; DeepSeek-V3's q/k heads are 12 wide, its values 6), else the config's."""
    heads = (
        getattr(layer, "num_heads", None)
        or getattr(layer, "num_attention_heads", None)
        or getattr(config, "num_attention_heads", None)
    )
    head_dim = (
        getattr(layer, "qk_head_dim", None)
        or getattr(layer, "head_dim", None)
        or getattr(layer, "attention_head_size", None)
    )
    if head_dim is None and heads:
        head_dim = config.hidden_size // heads
    return heads, head_dim, getattr(layer, "v_head_dim", None) or head_dim


def _layer_kind(config, layer: nn.Module) -> str | None:
    """The layer's entry of config.layer_types ("full_attention", "sliding_attention"), None when not given."""
    types = getattr(config, "layer_types", None)
    index = getattr(layer, "layer_idx", None)
    if not types or not isinstance(index, int) or not 0 <= index < len(types):
        return None
    return types[index]


def _own_cache_window(config) -> int | None:
    """W when the model's own cache (transformers' DynamicCache built from its config) keeps only the last W
    positions of some layers (its sliding layers), else None."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None
    return int(window)


def _reads_past(variant: str, options: dict, window: int) -> bool:
    """Whether `variant` (with `options`) on a layer the model windows by W reads positions a cache of the last
    W drops: anything but a window w with w + 1 <= W and no global (sink) tokens."""
    reach = variant_class(variant).spec.reach_option
    if reach is None or options.get("global_tokens", 0):
        return True
    return reach in options and int(options[reach]) + 1 > window


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
    name = _cache_argument(model)
    use_cache = kwargs.get("use_cache")
    use_cache = getattr(model.config, "use_cache", False) if use_cache is None else use_cache
    if name and use_cache and kwargs.get(name) is None and _cache_drops_what_is_read(model):
        from transformers import DynamicCache

        kwargs[name] = DynamicCache()
    return args, kwargs


def _cache_argument(model) -> str | None:
    """The name the model's forward takes its cache by ("cache" in recent transformers, "past_key_values")."""
    parameters = inspect.signature(type(model).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


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
    decodes = all(_decoding_refusal(layer._modules[ATTRIBUTE]) is None for layer in layers)
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


def _check_model_fits(model, variant: str) -> None:
    """Refuse, before anything is attached, layer kinds no variant expresses: chunked attention, and the
    non-attention layers of hybrid models (their own caches and convolutions)."""
    text = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    chunk = getattr(text, "attention_chunk_size", None)
    types = list(getattr(text, "layer_types", None) or [])
    if chunk or "chunked_attention" in types:
        raise ValueError(
            f"variants.hf.use: {name} attends in chunks (attention_chunk_size={chunk}: each query sees only "
            f"its own chunk of positions, Llama 4's pattern); no attnbench variant expresses it"
        )
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(
            f"variants.hf.use: {name} has layers of kind {', '.join(other)} (config.layer_types: a hybrid "
            f"model's non-attention or shared layers, with caches of their own); variants.hf switches "
            f"models whose layers are all full_attention or sliding_attention"
        )


# -- what runs inside the model ---------------------------------------------------------------------

_REGISTERED: dict[str, tuple[str, dict] | None] = {}  # implementation name -> (variant, options), None for `use`


def _register_implementation(name: str, spec) -> None:
    transformers = _transformers()
    _REGISTERED[name] = spec
    transformers.AttentionInterface.register(name, _attention_forward)
    transformers.AttentionMaskInterface.register(name, _padding_mask)


def _layer_variant(module: nn.Module, implementation: str) -> nn.Module:
    attn = module._modules.get(ATTRIBUTE)
    spec = _REGISTERED.get(implementation)
    if spec is None:  # `use`: the module attached to the layer
        if attn is None:
            raise RuntimeError(
                f"variants.hf: {type(module).__name__} has no attnbench variant attached; call "
                f"variants.hf.use(model, variant) (or register a variant and pass its name)"
            )
        return attn
    cache = module.__dict__.setdefault("_attnbench_registered", {})  # not a submodule: nothing to save
    if implementation not in cache:
        like = next(module.parameters(), None)
        # the checks `use` makes of each layer, made here at the layer's first call (a registered name knows no model)
        _check_layer(
            type(module).__name__,
            f"variants.hf: {implementation}",
            "",
            module,
            spec[0],
            "cpu" if like is None else like.device.type,
            module.training,
        )
        cache[implementation] = _variant_for_layer(
            getattr(module, "config", None), type(module).__name__, module, spec[0], spec[1], like
        )
    return cache[implementation]


def _attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention function signature: (B, H, Nq, D) q, (B, Hkv, Nk, D) k, v -> ((B, Nq, H, Dv), None)."""
    implementation = module.config._attn_implementation if hasattr(module, "config") else IMPLEMENTATION
    attn = _layer_variant(module, implementation)
    name = attn.spec.name
    for arg in UNSUPPORTED_KWARGS:
        if kwargs.get(arg) is not None:
            raise ValueError(
                f"variants.hf: {type(module).__name__} passes {arg}; {name} (like every attnbench variant) "
                f"computes plain scaled dot-product scores and cannot apply it"
            )
    if kwargs.get("output_attentions"):  # as transformers' sdpa: no weights are returned, and it says so
        _transformers().utils.logging.get_logger(__name__).warning_once(
            f"variants.hf: {name} does not return attention weights (output_attentions=True gives none, as with sdpa); "
            f"the variant's attention_matrix(q, k) gives the weights of its definition"
        )
    if dropout:  # (layers pass their dropout in training only)
        raise ValueError(
            f"variants.hf: {type(module).__name__} asks for attention dropout p={dropout} (the model is "
            f"training); {name} has none. Zero it on the built model with "
            f"variants.hf.without_attention_dropout(model) (a config change does not reach built layers), "
            f"or call model.eval()"
        )
    if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(
            f"variants.hf: {type(module).__name__} got an attention mask of shape {shape}; attnbench "
            f"variants take a 2-D padding mask (a custom 4-D mask cannot be expressed by them)"
        )
    given_key = key  # (B, Hkv, Nk, D): grouped-query K/V as the model computes them, never repeated here
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    n_q, n_k = query.shape[-2], key.shape[-2]
    if not causal and n_q != n_k and not attn.spec.supports_cross_attention:
        raise ValueError(
            f"variants.hf: {type(module).__name__} attends {n_q} queries to {n_k} other keys "
            f"(cross-attention); {name} has no cross-attention"
        )
    if scaling is not None and not attn._attnbench_fixed_scale and attn.spec.scale_is_query_factor:
        attn.scale = float(scaling)  # (a score of another form, additive's, keeps its own scale)
    key_padding_mask = None  # (_padding_mask gives None already where nothing is padded)
    if attention_mask is not None:
        key_padding_mask = attention_mask[:, -n_k:].to(device=query.device, dtype=torch.bool)
    layer = attn.__dict__.pop("_attnbench_state_layer", None)
    if layer is not None and layer.pending is given_key:  # a state cache's layer: the keys are the new positions only
        out = _state_step(attn, layer, query, key, value.to(query.dtype), key_padding_mask, bool(causal))
    else:
        out = attn(query, key, value.to(query.dtype), causal=bool(causal), key_padding_mask=key_padding_mask)
    return out.transpose(1, 2).contiguous(), None


def _padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    config=None,
    **kwargs,
):
    """AttentionMaskInterface function: the 2-D padding mask (B, Nk), or None without padding.

    Causality and sliding windows are applied by the variants themselves (from the layer's is_causal and
    window); any other pattern (packed sequences, image-token overlays, chunked attention) cannot be
    expressed by them and is refused here, never silently dropped.
    """
    _check_pattern(mask_function, config)
    if kv_offset and config is not None:  # the cache dropped the first kv_offset positions (a sliding layer's cache)
        _check_cache_keeps_what_is_read(config, int(kv_offset))
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[-1] != kv_length:
        raise ValueError(
            f"variants.hf: padding mask of {attention_mask.shape[-1]} positions for {kv_length} keys "
            f"(a static cache?); attnbench variants need the keys to be exactly the positions seen so far"
        )
    if attention_mask.all():
        return None
    return attention_mask


def _check_cache_keeps_what_is_read(config, dropped: int) -> None:
    """ValueError when the model's cache has dropped positions its variant still reads (a window cache of W
    positions under a variant that reads further back), so the outputs would differ from those without cache."""
    implementation = getattr(config, "_attn_implementation", None)
    spec = _REGISTERED.get(implementation)
    record = getattr(config, "attnbench", None) if spec is None else {"variant": spec[0], "options": spec[1]}
    window = _own_cache_window(config)
    if record and window and not _reads_past(record["variant"], record["options"], window):
        return
    what = record["variant"] if record else "the attnbench variant"
    raise ValueError(
        f"variants.hf: the model's cache kept only the last {window} positions of its sliding layers "
        f"({dropped} dropped), but {what} reads further back, so its outputs would differ from those "
        f"without a cache. After variants.hf.use, generate() and model(..., use_cache=True) make a cache "
        f"that keeps them; a cache you pass must too: variants.hf.state_cache(model) or "
        f"transformers.DynamicCache() (without config)"
    )


def _check_pattern(mask_function, config) -> None:
    """Accept causal, bidirectional and (config.sliding_window W) sliding patterns, causal (kv > q - W) or
    bidirectional (|q - kv| <= W, ModernBERT's local layers); refuse the rest. The variants apply their own
    pattern (a window variant on the layers the model windows takes W from the model)."""
    from transformers import masking_utils as mu

    if mask_function is None or mask_function in (mu.causal_mask_function, mu.bidirectional_mask_function):
        return
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window >= 0:
        size, mid = 2 * window + 3, window + 1  # one query with W + 1 keys on each side
        try:
            row = mask_function(torch.tensor(0), torch.tensor(0), torch.tensor(mid), torch.arange(size))
            d = mid - torch.arange(size)
            bands = (
                (d >= 0) & (d < window),
                d.abs() <= window,
            )  # (a model that builds a window-0 mask for no layer: empty)
            if isinstance(row, Tensor) and any(torch.equal(row.to(torch.bool).reshape(-1), band) for band in bands):
                return
        except Exception:  # a pattern that cannot be probed by position alone: not one the variants express
            pass
    name = getattr(mask_function, "__qualname__", repr(mask_function))
    raise ValueError(
        f"variants.hf: the model asks for an attention pattern attnbench variants cannot express "
        f"({name}: e.g. packed sequences, image-token or chunked overlays); supported: causal, "
        f"bidirectional, sliding-window causal or bidirectional, each with padding"
    )


# -- saved parameters ---------------------------------------------------------------------------------


def _load_saved_variant_weights(model) -> None:
    """Load the attached variants' parameters from the checkpoint the model was loaded from, if it holds them.

    `save_pretrained` saves them with the model; `from_pretrained` builds the model before `use` attaches
    the variants, so it drops them as unexpected keys. This puts them back.
    """
    wanted = {name: p for name, p in model.state_dict().items() if f".{ATTRIBUTE}." in name}
    folder = getattr(model, "name_or_path", "") or ""
    if not wanted or not os.path.isdir(folder):
        return
    from safetensors import safe_open

    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as handle:
            files = sorted({os.path.join(folder, f) for f in json.load(handle)["weight_map"].values()})
    found = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                short = _strip_prefix(key, wanted)
                if short is not None:
                    found[short] = handle.get_tensor(key)
    if not found:
        return
    mismatched = [key for key, tensor in found.items() if tuple(tensor.shape) != tuple(wanted[key].shape)]
    if mismatched:
        raise ValueError(
            f"variants.hf.use: the checkpoint in {folder} holds attnbench parameters of other shapes "
            f"({mismatched[0]}: {tuple(found[mismatched[0]].shape)} vs {tuple(wanted[mismatched[0]].shape)}): "
            f"saved with another variant or options"
        )
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(
            f"variants.hf.use: the checkpoint in {folder} holds some attnbench parameters but not {missing[0]}"
        )
    model.load_state_dict(found, strict=False)


def _strip_prefix(key: str, wanted: dict) -> str | None:
    """The model's own name for a checkpoint key (checkpoints may add or drop the base-model prefix)."""
    if key in wanted:
        return key
    for name in wanted:
        if name.endswith("." + key) or key.endswith("." + name):
            return name
    return None
