"""What the adapter reads of a `transformers` model: its attention layers, their shapes and kinds, its cache's
argument and window; and the names the adapter registers (`IMPLEMENTATION`, `ATTRIBUTE`, the implementations).
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

from .._registry import variant_class

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


def attention_layers(model) -> dict[str, nn.Module]:
    """{dotted path: module} of every layer of `model` that calls its attention through AttentionInterface."""
    return {path: module for path, module in model.named_modules() if _calls_attention_interface(type(module))}


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


def is_cross_attention(path: str, layer: nn.Module) -> bool:
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


def layer_kind(config, layer: nn.Module) -> str | None:
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


def cache_argument(model) -> str | None:
    """The name the model's forward takes its cache by ("cache" in recent transformers, "past_key_values")."""
    parameters = inspect.signature(type(model).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


_REGISTERED: dict[str, tuple[str, dict] | None] = {}  # implementation name -> (variant, options), None for `use`
