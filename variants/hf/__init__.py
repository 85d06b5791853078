"""Any attention variant inside a Hugging Face `transformers` model: training, evaluation, `generate()`.

    import variants.hf
    model = LlamaForCausalLM(config)                       # or from_pretrained(...)
    variants.hf.use(model, "sliding_window", window=64)    # every attention layer, weights kept
    model.generate(input_ids, max_new_tokens=20)           # with the KV cache, as usual

The rooms, each importing only those above it: `layers` (what the adapter reads of a model), `checks`
(errors before anything changes), `weights` (a variant's saved parameters), `cache` (decoding states as a
Cache), `runtime` (the attention function and its mask), `api` (`use`, `register`).

Needs the `hf` extra (`pip install -e '.[hf]'`); `import variants` never imports transformers.
"""

from .api import register, use, without_attention_dropout
from .cache import state_cache
from .checks import decoding_refusal
from .layers import (
    ATTRIBUTE,
    HF_EXTRA,
    IMPLEMENTATION,
    attention_layers,
    cache_argument,
    is_cross_attention,
    layer_kind,
)

__all__ = [
    "ATTRIBUTE",
    "HF_EXTRA",
    "IMPLEMENTATION",
    "attention_layers",
    "cache_argument",
    "decoding_refusal",
    "is_cross_attention",
    "layer_kind",
    "register",
    "state_cache",
    "use",
    "without_attention_dropout",
]
