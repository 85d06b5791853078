"""A KV-cache policy inside a transformers model (variants/hf/kvcache.py): the recording prefill is the model's
own forward, a branch leaves the exact cache whole, and tokens fed after a compressed cache equal a dense
forward whose new positions see only the kept ones (per head, per layer: the reference masks)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import variants.hf.kvcache as hk  # noqa: E402
from helpers import tiny_llama_config  # noqa: E402
from transformers import AttentionInterface, LlamaForCausalLM  # noqa: E402
from variants import kvcache  # noqa: E402

N, NEW = 40, 5
OPTIONS = {"snapkv": {"window_size": 8}, "pyramidkv": {"window_size": 8}, "expected_attention": {"n_future": 16}}


def llama(seed=0):
    torch.manual_seed(seed)
    config = tiny_llama_config(
        vocab_size=61, num_hidden_layers=3, max_position_embeddings=128, attn_implementation="sdpa"
    )
    return LlamaForCausalLM(config).double().eval()


def ids_of(n, seed=1):
    return torch.randint(0, 61, (1, n), generator=torch.Generator().manual_seed(seed))


def test_the_recording_prefill_and_a_branch_are_the_models_own_forward():
    model, ids = llama(), ids_of(N + NEW)
    with torch.no_grad():
        want = model(ids).logits
    logits, cache, prompt = hk.prefill(model, ids[:, :N])
    torch.testing.assert_close(logits, want[:, :N])
    torch.testing.assert_close(hk.feed(model, ids[:, N:], hk.branch(cache), N), want[:, N:])
    assert [p.queries.shape for p in prompt] == [(1, 4, N, 8)] * 3
    assert all(layer.keys.shape[2] == N for layer in cache.layers), "the branch left the exact cache whole"
    assert model.config._attn_implementation == "sdpa", "the model's own attention is put back"


def masked_reference(kept: list[torch.Tensor]):
    """An attention function: prompt rows causal, each new row over its layer's kept prompt positions
    (kvcache.reference_attend, one row at a time)."""

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        prompt_part = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, :N], key[:, :, :N], value[:, :, :N], is_causal=True, scale=scaling, enable_gqa=True
        )
        new = kvcache.reference_attend(query[:, :, N:], key, value, kept[layer], scale=scaling)
        return torch.cat([prompt_part, new], dim=2).transpose(1, 2).contiguous(), None

    return attention


@pytest.mark.parametrize("name", kvcache.available())
def test_tokens_after_a_compressed_cache_equal_the_masked_dense_forward(name):
    model, ids = llama(), ids_of(N + NEW)
    _, cache, prompt = hk.prefill(model, ids[:, :N])
    policy = kvcache.build(name, **OPTIONS.get(name, {}))
    index = [policy.keep(p, 0.5) for p in prompt]
    small = hk.compressed(cache, index)
    assert [layer.keys.shape[:3] for layer in small.layers] == [(1, 2, policy.kept(p, 0.5)) for p in prompt]
    got = hk.feed(model, ids[:, N:], small, N)
    kept = [torch.zeros(1, 2, N, dtype=torch.bool).scatter(2, i, True) for i in index]
    AttentionInterface.register("test_kv_reference", masked_reference(kept))
    model.set_attn_implementation("test_kv_reference")
    try:
        with torch.no_grad():
            want = model(ids, attention_mask=None).logits[:, N:]
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, want)


def test_the_rotary_embedding_read_is_the_models():
    model = llama()
    cos, sin = hk.rope_of(model)(torch.arange(5))
    angle = 3 * model.model.rotary_emb.inv_freq[1]
    assert cos.shape == (5, 8) and torch.isclose(cos[3, 1], torch.cos(angle).float(), atol=1e-6)
