"""The attention function registered as "attnbench": each layer's q, k, v handed to its variant.

`transformers` models call their attention through `AttentionInterface` (one function per implementation
name, chosen by `config._attn_implementation`) and build its mask through `AttentionMaskInterface`. The
mask registered here is the 2-D padding mask only (as for FlashAttention): the variants apply causality and
windows themselves, so no Nq x Nk mask is ever built for them.

What the model passes is honoured: grouped-query K and V with their own heads (never repeated here), the
layer's `scaling`, left and right padding (padded query rows give zeros, never NaN), the layer's
`is_causal`, and with a KV cache the queries as the last Nq of the Nk positions (bottom-right causal).
`sliding_window` without a `window=` takes the model's `config.sliding_window` W, which there counts the
query itself: this project's window W - 1.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._registry import build, option_names, variant_class
from .cache import _state_step
from .checks import _check_cache_keeps_what_is_read, _check_layer, _check_pattern
from .layers import _REGISTERED, ATTRIBUTE, IMPLEMENTATION, UNSUPPORTED_KWARGS, layer_kind, _layer_shape, _transformers


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
        kind = layer_kind(config, layer)
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
    if chosen.get("feature_inputs") == "pre_rope" and "rope_theta" not in chosen:
        chosen["rope_theta"] = _rope_theta(config, where, variant)
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


def _rope_theta(config, where: str, variant: str) -> float:
    """The base θ of the model's rotary embedding, which feature_inputs="pre_rope" undoes; a ValueError naming the
    model where it has none, or one the variant cannot undo (scaled or partial rotations)."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(
            f"variants.hf: {where}: {variant} feature_inputs='pre_rope' undoes the model's rotary position "
            f"embedding (RoPE); {type(config).__name__} has none (no rope_theta)"
        )
    kind, part = params.get("rope_type", "default"), getattr(config, "partial_rotary_factor", 1.0)
    if kind != "default" or part != 1.0:
        raise ValueError(
            f"variants.hf: {where}: {variant} feature_inputs='pre_rope' undoes plain RoPE over every dim; the model "
            f"has rope_type={kind!r}, partial_rotary_factor={part}"
        )
    return float(theta)


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
    stepped = layer is not None and layer.pending is given_key  # a state cache's layer: the keys are the new positions
    if getattr(attn, "feature_inputs", None) == "pre_rope":  # the rotation undone at the model's own positions
        seen = (layer.state.length if layer.state is not None else 0) if stepped else n_k - n_q  # (positions before)
        attn.position_offset = _position_offset(kwargs.get("position_ids"), seen + n_q - 1)
    if stepped:
        out = _state_step(attn, layer, query, key, value.to(query.dtype), key_padding_mask, bool(causal))
    else:
        out = attn(query, key, value.to(query.dtype), causal=bool(causal), key_padding_mask=key_padding_mask)
    return out.transpose(1, 2).contiguous(), None


def _position_offset(position_ids: Tensor | None, counted: int) -> Tensor:
    """(B, 1): the model's position of each row's last query minus the variant's count of it (`counted`: n_k − 1 in a
    call, state.length + n_q − 1 in a step), which the variant adds to every position it counts (left padding
    included: the last query is never a pad)."""
    if position_ids is None:
        raise ValueError(
            "variants.hf: feature_inputs='pre_rope' needs the layer's position_ids (the positions RoPE rotated q "
            "and k by); this model's attention does not pass them"
        )
    return position_ids[:, -1:].to(torch.long) - counted


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
