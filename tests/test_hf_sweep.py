"""The family sweep (opt in: `pytest -m slow tests/test_hf_sweep.py`): for every causal-LM family transformers
ships, built from one tiny config where its fields allow, `use(model, "full")` equals the model's own sdpa on real
tokens, or is refused at `use` with a reason. No third outcome: a model accepted and then refused, or wrong, at
its first forward fails the test. Families that a generic tiny config cannot build (their own fields, no sdpa,
an inconsistent tiny config) are skipped with the reason."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import variants.hf as vh  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

TINY = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    n_embd=32,
    n_layer=2,
    n_head=4,
    d_model=32,
    n_positions=128,
    num_layers=2,
    ffn_dim=64,
    n_inner=64,
    num_heads=4,
    d_ff=64,
    hidden_dim=64,
    n_heads=4,
    dim=32,
    n_layers=2,
)
MOST_PARAMETERS = 3_000_000  # a config whose fields ignore these sizes is not tiny: skipped
FAMILIES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_model(model_type: str):
    """The family's causal LM from TINY's fields that its config has; pytest.skip with the reason where that fails."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    name = name[0] if isinstance(name, (list, tuple)) else name
    try:
        config_class = CONFIG_MAPPING[model_type]
        defaults = config_class()
        config = config_class(**{k: v for k, v in TINY.items() if hasattr(defaults, k)})
        config._attn_implementation = "sdpa"
        model_class = getattr(transformers, name)
        with torch.device("meta"):
            size = sum(p.numel() for p in model_class(config).parameters())
        if size > MOST_PARAMETERS:
            pytest.skip(f"{model_type}: not tiny with the generic fields ({size} parameters)")
        torch.manual_seed(0)
        model = model_class(config).eval()
        ids = torch.randint(3, 61, (2, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits
    except pytest.skip.Exception:
        raise
    except Exception as err:  # its own fields, no sdpa, a tiny config its code rejects
        pytest.skip(f"{model_type}: not built from a generic tiny config ({type(err).__name__}: {str(err)[:100]})")
    return model, ids, want


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("model_type", FAMILIES)
def test_full_equals_sdpa_or_is_refused_at_use(model_type):
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    model, ids, want = tiny_model(model_type)
    try:
        vh.use(model, "full")
    except (ValueError, TypeError, RuntimeError) as err:  # refused at use: the message names the reason
        assert str(err).startswith("variants.hf"), err
        return
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits  # a refusal here is the third outcome: a failure
    torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)
