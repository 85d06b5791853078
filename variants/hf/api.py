"""The adapter's calls: `use` (every attention layer's variant swapped, weights kept), `register` (a named
implementation for `from_pretrained(attn_implementation=...)`) and `without_attention_dropout`.
"""

from __future__ import annotations

from torch import nn

from .._registry import build
from .cache import _keep_what_the_variants_read
from .checks import _check_layer_fits, _check_model, _check_model_fits, _check_variant
from .layers import ATTRIBUTE, IMPLEMENTATION, _transformers
from .runtime import _register_implementation, _variant_for_layer
from .weights import _load_saved_variant_weights


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
