"""The checks made before anything is changed or computed (by `use`, `state_cache` and the attention
function): each error names the model, the layer, the variant and what is allowed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._registry import available, option_names, variant_class
from .layers import (
    _REGISTERED,
    FROM_LAYER,
    is_cross_attention,
    _own_cache_window,
    _reads_past,
    _transformers,
    attention_layers,
)


def decoding_refusal(attn) -> str | None:
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
    if not spec.supports_non_causal and is_cross_attention(path, layer):
        raise ValueError(
            f"{caller}: {where} is a cross-attention layer (every query sees the whole encoder "
            f"sequence); {variant} is causal only: {spec.why_not_non_causal}"
        )
    if is_cross_attention(path, layer) and not spec.supports_cross_attention:
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
