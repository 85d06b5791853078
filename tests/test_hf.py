"""variants.hf: every variant inside transformers models (tiny configs built here, random weights, offline).

Checked against transformers' own `sdpa` attention where the variant is exact (full, and
sliding_window on a Mistral with its window), and by behaviour everywhere else: causality, padding
invariance, backward, and generation with the KV cache equal to generation without it.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import variants.hf as vh  # noqa: E402
from conftest import registry_cases  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

VOCAB, N = 61, 14
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
)
# every registered variant that runs on the CPU with a backward, with the first example of its spec
# (options that exercise its method at N = 14); the layer gives the shape hints
VARIANTS = {case.values[0]: case.values[1] for case in reversed(registry_cases())}
CAUSAL = {
    case.values[0]: case.values[1] for case in reversed(registry_cases(causal=True))
}  # the ones a decoder can use
BIDIRECTIONAL = {case.values[0]: case.values[1] for case in reversed(registry_cases(non_causal=True))}  # an encoder's


def llama(seed=0, **extra):
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, "num_key_value_heads": 2, **extra}, attn_implementation="sdpa")  # grouped-query
    return LlamaForCausalLM(config).double()


def batch(seed=1, left_pad=4, right_pad=0):
    """input_ids (2, N) and attention_mask: row 1 padded on the left (and/or right)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, N), generator=g)
    mask = torch.ones(2, N, dtype=torch.long)
    if left_pad:
        mask[1, :left_pad] = 0
    if right_pad:
        mask[1, N - right_pad :] = 0
    return ids, mask


def loss_on_real_tokens(logits, mask):
    return (logits.log_softmax(-1)[..., 0] * mask).sum()


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# -- exact against transformers' sdpa ------------------------------------------------------------------


def test_full_equals_sdpa_on_llama_with_gqa_and_left_padding():
    ids, mask = batch()
    model = llama()
    want = model(ids, attention_mask=mask).logits
    loss_on_real_tokens(want, mask).backward()
    want_grads = grads(model)
    model.zero_grad()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    vh.use(model, "full")
    assert model.config._attn_implementation == "attnbench"
    got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()  # padded query rows too
    loss_on_real_tokens(got, mask).backward()
    got_grads = grads(model)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_sliding_window_takes_mistrals_window_and_equals_sdpa():
    torch.manual_seed(0)
    config = MistralConfig(**TINY, num_key_value_heads=2, sliding_window=5, attn_implementation="sdpa")
    model = MistralForCausalLM(config).double().eval()
    ids, mask = batch(left_pad=3)
    want = model(ids, attention_mask=mask).logits
    vh.use(model, "sliding_window")  # no window given: Mistral's W = 5 keys, query included -> w = 4
    assert {layer.attnbench_attention.window for layer in vh.attention_layers(model).values()} == {4}
    got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
    with_cache = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    assert torch.equal(
        with_cache, model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    )


def test_full_generation_equals_sdpa_generation():
    model = llama().eval()
    ids, mask = batch()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    vh.use(model, "full")
    assert torch.equal(
        model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0), want
    )


FAMILIES = {  # family: (config class, model class, config fields beyond TINY)
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 8}),
    "GPTNeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", {"num_key_value_heads": 1, "head_dim": 8}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 2, "pad_token_id": 0}),
    "OPT": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    "GPT2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_layer": 2, "n_head": 4}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_full_equals_sdpa_and_a_window_generates_with_cache(family):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        **{**TINY, "bos_token_id": 1, "eos_token_id": 2, **extra}, attn_implementation="sdpa"
    )
    model = getattr(transformers, model_class)(config).double().eval()
    ids, mask = batch()
    want = model(ids, attention_mask=mask).logits
    got = vh.use(model, "full")(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
    vh.use(model, "sliding_window", window=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def mistral(window=4, seed=0):
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**TINY, num_key_value_heads=2, sliding_window=window)).double().eval()


@pytest.mark.parametrize(
    "name, options", [("linear", {}), ("full", {}), ("sliding_window", {"window": 2, "global_tokens": 1})]
)
def test_a_variant_reading_past_mistrals_window_gets_a_cache_that_keeps_it(name, options):
    # Mistral's own cache keeps only its window W (4); these variants read further back. Nothing in the config
    # changes (its layer types set RoPE in other families, and are saved), yet generation with the cache equals
    # generation without it, and so does a forward with use_cache=True continued by hand
    model = vh.use(mistral(), name, **options)
    assert getattr(model.config, "layer_types", None) is None and model.config.sliding_window == 4
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))
    first = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
    cache = getattr(first, "cache", None) or first.past_key_values
    rest = model(ids[:, 10:], attention_mask=mask, use_cache=True, **{vh.cache_argument(model): cache}).logits
    torch.testing.assert_close(rest, model(ids, attention_mask=mask).logits[:, 10:])
    # a cache of the model's own kind, passed by hand, would silently lose what the variant reads: refused
    own = transformers.DynamicCache(config=model.config)
    model(ids[:, :10], use_cache=True, **{vh.cache_argument(model): own})
    with pytest.raises(
        ValueError,
        match=rf"cache kept only the last 4 positions of its sliding layers \(7 dropped\), "
        rf"but {name} reads further back",
    ):
        model(ids[:, 10:], use_cache=True, **{vh.cache_argument(model): own})


def test_a_window_within_mistrals_keeps_the_models_own_cache():
    model = vh.use(mistral(), "sliding_window")  # the model's window: W - 1 = 3, which its cache holds
    ids, mask = batch()
    first = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
    cache = getattr(first, "cache", None) or first.past_key_values
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    rest = model(ids[:, 10:], attention_mask=mask, use_cache=True, **{vh.cache_argument(model): cache}).logits
    torch.testing.assert_close(rest, model(ids, attention_mask=mask).logits[:, 10:])


# -- every variant, by behaviour --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_variant_in_llama_trains_is_causal_and_ignores_padding(name):
    model = vh.use(llama(), name, **CAUSAL[name])
    ids, mask = batch(left_pad=4, right_pad=2)
    logits = model(ids, attention_mask=mask).logits
    assert logits.shape == (2, N, VOCAB) and torch.isfinite(logits).all()
    loss_on_real_tokens(logits, mask).backward()
    assert all(torch.isfinite(g).all() for g in grads(model).values())
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        # causality: changing the last 5 tokens leaves the logits before them bit-identical
        later = ids.clone()
        later[:, -5:] = (later[:, -5:] + 7) % VOCAB
        torch.testing.assert_close(
            model(later, attention_mask=mask).logits[:, :-5], logits[:, :-5].detach(), atol=0, rtol=0
        )
        # padding: changing the padded tokens changes nothing on the real ones
        padded = ids.clone()
        padded[~mask.bool()] = (padded[~mask.bool()] + 11) % VOCAB
        again = model(padded, attention_mask=mask).logits
        torch.testing.assert_close(again[mask.bool()], logits.detach()[mask.bool()], atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_generation_with_cache_equals_generation_without(name):
    model = vh.use(llama().eval(), name, **CAUSAL[name])
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kwargs)
    assert cached.shape == (2, N + 8)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kwargs))


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_generation_keeps_the_variants_own_state_with_left_padding(name):
    # after `use`, generate() keeps each layer's decoding state (a recurrence's fixed state, a window's sinks and
    # last w, ...), not keys and values: greedy tokens equal those without any cache, on a batch whose second
    # row is left-padded (GQA: a native variant's state holds the model's K/V heads, a repeating one's its query heads)
    model = vh.use(llama().eval(), name, **CAUSAL[name])
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    out = model.generate(ids, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, model.generate(ids, use_cache=False, **kwargs))
    cache = getattr(out, "cache", None) or out.past_key_values
    attn = next(iter(vh.attention_layers(model).values())).attnbench_attention
    if vh.decoding_refusal(attn) is not None:  # (none of the registry's causal examples today)
        assert type(cache).__name__ == "DynamicCache"
        return
    assert type(cache).__name__ == "StateCache"
    assert [layer.state.kind for layer in cache.layers] == [attn.state_kind] * 2
    assert all(layer.state.length == N + 7 for layer in cache.layers)  # the last token is not fed back
    # a state cache passed by hand gives the same
    hand = model.generate(ids, **{vh.cache_argument(model): vh.state_cache(model)}, **kwargs)
    assert torch.equal(hand, out.sequences)


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_generation_logits_with_the_state_cache_equal_those_without(name):
    # tokens can agree while logits drift (moba's tied gates once chose other blocks in its steps than in its
    # forward: 0.1-0.4 apart from the 7th new token): every new token's logits, with the state cache and
    # without any cache, on a left-padded batch where the pad token, which embeds to zero, also stands among
    # the real tokens (an all-zero query: its gates tie)
    model = vh.use(llama(pad_token_id=0).eval(), name, **CAUSAL[name])
    ids, mask = batch(left_pad=3)
    ids[~mask.bool()] = 0
    ids[:, 9] = 0
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    cached, plain = model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(plain.logits), atol=1e-9, rtol=1e-7)


def test_fulls_state_is_the_models_own_kv_cache_byte_for_byte_with_grouped_query_heads():
    # K and V reach the variant unrepeated: full keeps the model's 2 K/V heads, not its 4 query heads (it kept
    # 2x the model's cache before); a recurrence one state a K/V head
    ids, mask = batch(left_pad=0)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    own = llama().eval().generate(ids, **kwargs)
    own_bytes = sum(
        t.numel() * t.element_size() for layer in own.past_key_values.layers for t in (layer.keys, layer.values)
    )
    model = vh.use(llama().eval(), "full")
    out = model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, own.sequences)
    states = [layer.state for layer in out.past_key_values.layers]
    assert sum(state.nbytes() for state in states) == own_bytes and all(
        state.tensors["k"].shape[1] == 2 for state in states
    )
    recurrent = vh.use(llama().eval(), "mamba2").generate(ids, **kwargs).past_key_values.layers
    assert all(layer.state.tensors["S"].shape[1] == 2 for layer in recurrent)


def test_beam_search_and_sampling_follow_the_states():
    model = vh.use(llama().eval(), "retention")
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    beams = dict(num_beams=3, do_sample=False, **kwargs)
    assert torch.equal(model.generate(ids, **beams), model.generate(ids, use_cache=False, **beams))
    torch.manual_seed(5)
    sampled = model.generate(ids, do_sample=True, num_return_sequences=2, **kwargs)
    torch.manual_seed(5)
    assert torch.equal(sampled, model.generate(ids, do_sample=True, num_return_sequences=2, use_cache=False, **kwargs))


def test_state_cache_says_it_takes_padded_batches():
    # it did decode left-padded batches (tested above) while its docstring said padded batches were not supported
    doc = " ".join(vh.state_cache.__doc__.split())
    assert "Padded batches decode as the forward computes them" in doc and "Not supported: cropping" in doc
    assert "padded batches (a padding mask" not in doc


def test_state_cache_refuses_what_it_cannot_keep():
    with pytest.raises(ValueError, match=r"state_cache: the model has no attnbench variant attached"):
        vh.state_cache(llama())
    model = vh.use(llama().eval(), "performer", eps=0.1)  # its stabilizer then reads later keys
    with pytest.raises(ValueError, match=r"state_cache: performer cannot decode: performer: decoding needs eps=0"):
        vh.state_cache(model)
    ids, mask = batch()  # generate() then keeps the default cache, exact as before
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))


@pytest.mark.parametrize("name", sorted(set(VARIANTS) - set(CAUSAL)))
def test_non_causal_variant_is_refused_in_a_decoder(name):
    with pytest.raises(
        ValueError,
        match=rf"LlamaForCausalLM\.model\.layers\.0\.self_attn \(LlamaAttention\) is causal "
        rf"\(a decoder\); {name} is not causal: ",
    ):
        vh.use(llama(), name, **VARIANTS[name])


def test_linformer_in_an_encoder_takes_the_models_longest_input():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=96,
    )
    model = vh.use(BertModel(config), "linformer", rank=8)
    attn = next(iter(vh.attention_layers(model).values())).attnbench_attention
    assert attn.max_len == 96 and attn.e.shape == (4, 8, 96)


def test_flex_runs_forward_in_a_model():
    # CPU: forward only (no FlexAttention backward on CPU); compiled once for this shape
    model = llama().float().eval()
    ids, mask = batch()
    with torch.no_grad():
        want = vh.use(model, "sliding_window", window=3)(ids, attention_mask=mask).logits
        got = vh.use(model, "sliding_window_flex", window=3)(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)


def test_bfloat16_forward_and_backward():
    model = vh.use(llama().to(torch.bfloat16), "sliding_window", window=3)
    ids, mask = batch()
    logits = model(ids, attention_mask=mask).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    loss_on_real_tokens(logits.float(), mask).backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.dtype == torch.bfloat16


# -- parameters --------------------------------------------------------------------------------------------


def test_memory_compressed_parameters_train_save_and_restore(tmp_path):
    model = vh.use(llama(), "memory_compressed", compression=3)
    own = [name for name, _ in model.named_parameters() if vh.ATTRIBUTE in name]
    assert len(own) == 4 * model.config.num_hidden_layers  # k/v weight and bias per layer
    ids, mask = batch()
    loss_on_real_tokens(model(ids, attention_mask=mask).logits, mask).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for name, p in model.named_parameters() if name in own)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in own:
                p.add_(0.5)  # trained values differ from any fresh initialization
    model.save_pretrained(tmp_path)
    loaded = vh.use(
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64), "memory_compressed", compression=3
    )
    saved = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, saved[name]), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_use_again_replaces_the_variant():
    model = vh.use(llama(), "memory_compressed", compression=3)
    vh.use(model, "linear")
    assert not [name for name, _ in model.named_parameters() if vh.ATTRIBUTE in name]
    assert {layer.attnbench_attention.spec.name for layer in vh.attention_layers(model).values()} == {"linear"}


def test_register_gives_a_name_for_from_config():
    name = vh.register("sliding_window", window=3)
    torch.manual_seed(0)
    config = LlamaConfig(**TINY, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name).double()
    ids, mask = batch()
    got = model(ids, attention_mask=mask).logits
    want = vh.use(model, "sliding_window", window=3)(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# -- an encoder ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(set(VARIANTS) - set(BIDIRECTIONAL)))
def test_causal_only_variants_are_refused_in_an_encoder(name):
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    with pytest.raises(
        ValueError,
        match=rf"BertSelfAttention\) is not causal \(an encoder's bidirectional attention\); "
        rf"{name} is causal only: .+ \(use it in a decoder\)",
    ):
        vh.use(BertModel(config), name, **VARIANTS[name])


@pytest.mark.parametrize("name", sorted(BIDIRECTIONAL))
def test_bert_encoder_is_bidirectional_with_padding(name):
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        attn_implementation="sdpa",
    )
    model = BertModel(config).double().eval()
    ids, mask = batch(left_pad=0, right_pad=5)
    want = model(ids, attention_mask=mask).last_hidden_state
    vh.use(model, name, **VARIANTS.get(name, {}))
    with torch.no_grad():
        got = model(ids, attention_mask=mask).last_hidden_state
        assert torch.isfinite(got).all()
        if name == "full":
            torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-6, rtol=1e-6)
        # bidirectional: the first token's output depends on a later one (within every variant's reach)
        later = ids.clone()
        later[0, 2] = (later[0, 2] + 7) % VOCAB
        assert not torch.equal(model(later, attention_mask=mask).last_hidden_state[0, 0], got[0, 0])


def bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
        attn_implementation="sdpa",
    )
    return transformers.BartForConditionalGeneration(config).double().eval()


def test_encoder_decoder_with_cross_attention():
    model = bart()
    ids, mask = batch(left_pad=0, right_pad=4)
    decoder_ids = ids[:, :6]
    want = model(ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    with pytest.raises(
        ValueError,
        match=r"BartForConditionalGeneration\.model\.decoder\.layers\.0\.encoder_attn \(BartAttention\) "
        r"is a cross-attention layer .* sliding_window has no cross-attention",
    ):
        vh.use(model, "sliding_window", window=3)
    got = vh.use(model, "full")(ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    vh.use(model, "linear")
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


# -- bad input ---------------------------------------------------------------------------------------------


def test_bad_input_is_a_clear_error():
    model = llama()
    with pytest.raises(ValueError, match=r"unknown variant 'flash'; available: .*full"):
        vh.use(model, "flash")
    with pytest.raises(
        TypeError, match=r"sliding_window takes no option\(s\) \['compression'\]; allowed options: window"
    ):
        vh.use(model, "sliding_window", compression=3)
    with pytest.raises(TypeError, match=r"options \['num_heads'\] come from each attention layer"):
        vh.use(model, "memory_compressed", num_heads=4)
    with pytest.raises(TypeError, match=r"model must be a transformers PreTrainedModel, got Linear"):
        vh.use(torch.nn.Linear(2, 2), "full")
    with pytest.raises(
        ValueError, match=r"memory_compressed has parameters .* use variants.hf.use\(model, 'memory_compressed'"
    ):
        vh.register("memory_compressed")
    with pytest.raises(ValueError, match=r"sliding_window needs window=: the model's config has no sliding_window"):
        vh.use(model, "sliding_window")
    assert model.config._attn_implementation == "sdpa"  # nothing switched by a refused call


def test_variant_without_backward_refused_for_a_model_in_training_mode():
    with pytest.raises(
        RuntimeError,
        match=r"LlamaForCausalLM\.model\.layers\.0\.self_attn \(LlamaAttention\): the model is in "
        r"training mode, but sliding_window_flex has no backward on cpu",
    ):
        vh.use(llama(), "sliding_window_flex", window=3)


def test_cross_attention_layer_refused_at_use_time():
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        is_decoder=True,
        add_cross_attention=True,
    )
    with pytest.raises(
        ValueError,
        match=r"BertModel\.encoder\.layer\.0\.crossattention\.self .* is a cross-attention layer.*"
        r"sliding_window has no cross-attention",
    ):
        vh.use(BertModel(config), "sliding_window", window=3)


def test_model_without_attention_interface_refused():
    class Old(transformers.PreTrainedModel):
        config_class = LlamaConfig

        def __init__(self, config):
            super().__init__(config)
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"Old does not route its attention through transformers' AttentionInterface"):
        vh.use(Old(LlamaConfig(**TINY)), "full")


def test_position_bias_refused_at_use_time():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0
    )
    with pytest.raises(
        ValueError,
        match=r"T5ForConditionalGeneration\.encoder\.block\.0\.layer\.0\.SelfAttention \(T5Attention\) "
        r"adds a learned position bias",
    ):
        vh.use(transformers.T5ForConditionalGeneration(config), "full")


def test_softcapped_scores_refused():
    config = transformers.Gemma2Config(
        **TINY, num_key_value_heads=1, head_dim=8, sliding_window=5, attn_implementation="eager"
    )
    with pytest.raises(
        ValueError, match=r"Gemma2ForCausalLM caps its attention scores \(attn_logit_softcapping=50.0\)"
    ):
        vh.use(transformers.Gemma2ForCausalLM(config), "full")


def test_attention_dropout_refused_only_where_it_would_apply():
    # finding 9: eval needs no dropout; training refuses with a remedy that works on a built model
    model = vh.use(llama(attention_dropout=0.1).eval(), "linear")
    ids, mask = batch()
    model(ids, attention_mask=mask)  # eval: no dropout applies
    model.train()
    with pytest.raises(
        ValueError,
        match=r"asks for attention dropout p=0.1 \(the model is training\); linear has none. "
        r"Zero it on the built model with variants.hf.without_attention_dropout",
    ):
        model(ids, attention_mask=mask)
    vh.without_attention_dropout(model)
    model(ids, attention_mask=mask).logits.sum().backward()  # trains now
    for family, config in (
        (
            "BERT",
            transformers.BertConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=4,
                intermediate_size=64,
                attention_probs_dropout_prob=0.1,
            ),
        ),
        ("GPT-2", transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, attn_pdrop=0.1)),
        (
            "DistilBERT",
            transformers.DistilBertConfig(
                vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, hidden_dim=64, attention_dropout=0.1
            ),
        ),
    ):
        other = vh.use(transformers.AutoModel.from_config(config).eval(), "full")  # eval: accepted
        other(ids)
        with pytest.raises(ValueError, match=r"asks for attention dropout p=0.1"):
            other.train()(ids)
        vh.without_attention_dropout(other)(ids)  # the layers' own dropout (BERT's nn.Dropout, GPT-2's attn_dropout)


def test_packed_sequences_refused_not_ignored():
    # position_ids that restart inside a row without an attention mask: transformers builds a block-diagonal pattern
    model = vh.use(llama(), "full")
    ids, _ = batch()
    positions = torch.cat([torch.arange(7), torch.arange(7)])[None].expand(2, -1)
    with pytest.raises(ValueError, match=r"attention pattern attnbench variants cannot express"):
        model(ids, position_ids=positions, use_cache=False)


def test_importing_variants_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, variants; assert 'transformers' not in sys.modules, 'imported'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.slow
def test_flex_generates_with_one_compilation_for_every_decoding_step(monkeypatch):
    # opt in (-m slow; about 11 s): FlexAttention compiles per shape and stride, so every decoding step must
    # hand it the same ones (w + 1 keys, contiguous) — else 30 new tokens compile 30 times (150 s, seen)
    import variants.methods.sliding_window_flex as flex

    seen = set()
    compiled = flex.compiled_flex_attention

    def recording(device_type):
        def call(q, k, v, **kwargs):
            seen.add(tuple((tuple(t.shape), t.stride()) for t in (q, k, v)))
            return compiled(device_type)(q, k, v, **kwargs)

        return call

    monkeypatch.setattr(flex, "compiled_flex_attention", recording)
    model = llama().float().eval()
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    want = vh.use(model, "sliding_window", window=8).generate(ids, **kwargs)
    vh.use(model, "sliding_window_flex", window=8)
    assert torch.equal(model.generate(ids, **kwargs), want)
    assert len(seen) == 2, seen  # the prompt's shapes, and one set for all 29 decoding steps


def test_output_attentions_warns_as_sdpa_does(caplog):
    # finding 15 of issue 23: output_attentions=True returned () without a word
    import logging

    model = vh.use(llama().eval(), "linear")
    ids, mask = batch()
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            out = model(ids, attention_mask=mask, output_attentions=True)
    finally:
        transformers.logging.disable_propagation()
    assert not any(a is not None for a in (out.attentions or ()))
    assert "linear does not return attention weights (output_attentions=True gives none, as with sdpa)" in caplog.text


def test_a_copied_or_saved_model_keeps_its_own_generation_cache(tmp_path):
    # the generation hook is a method bound to the model: a deepcopy generates from its own layers' states, and
    # the whole model pickles (torch.save)
    import copy

    model = vh.use(llama().eval(), "retention")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)  # another model now
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(twin.generate(ids, **kwargs), twin.generate(ids, use_cache=False, **kwargs))
    torch.save(model, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    assert torch.equal(again.generate(ids, **kwargs), model.generate(ids, **kwargs))
