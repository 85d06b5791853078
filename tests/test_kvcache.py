"""The KV-cache policies (variants/kvcache/): each policy's scores against its file's per-position reference,
the kept set's shape and budget per K/V head (grouped-query native), decoding over the kept set against the
dense reference that masks the dropped positions, what each policy is known to keep, and bad input."""

from __future__ import annotations

import pytest
import torch

from variants import kvcache

SMALL = {"snapkv": {"window_size": 8}, "pyramidkv": {"window_size": 8}, "expected_attention": {"n_future": 16}}
RATIOS = (0.25, 0.5, 0.75, 0.875)


def rope_of(dim: int, base: float = 10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)

    def rope(positions):
        freqs = positions.float()[:, None] * inv[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    return rope


def prompt_of(b=1, h=4, hkv=2, n=64, d=16, layer=1, layers=4, seed=0) -> kvcache.Prompt:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, n, d, generator=g) for heads in (h, hkv, hkv))
    return kvcache.Prompt(k, v, q, layer=layer, layers=layers, rope=rope_of(d))


def policy(name: str) -> kvcache.KVPolicy:
    return kvcache.build(name, **SMALL.get(name, {}))


@pytest.mark.parametrize("name", kvcache.available())
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa-H4-Hkv2", "mha-H2"])
def test_scores_equal_the_per_position_reference(name, heads):
    prompt = prompt_of(h=heads[0], hkv=heads[1], n=48, b=2)
    pol = policy(name)
    got = pol.scores(prompt)
    want = kvcache.policy_module(name).reference_scores(pol, prompt)
    assert got.shape == (2, heads[1], 48)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("normalized", [False, True])
def test_h2o_in_row_blocks_equals_the_reference(monkeypatch, normalized):
    """H2O's fast path reads the queries ROWS at a time, each block against the keys it sees: blocks of 16 over
    50 positions (a ragged last block) still sum to the per-query reference."""
    monkeypatch.setattr(kvcache.policy_module("h2o"), "ROWS", 16)
    prompt, pol = prompt_of(h=6, hkv=2, n=50, b=2), kvcache.build("h2o", normalized=normalized)
    want = kvcache.policy_module("h2o").reference_scores(pol, prompt)
    torch.testing.assert_close(pol.scores(prompt).double(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", kvcache.available())
@pytest.mark.parametrize("ratio", RATIOS)
def test_keep_gives_the_budget_per_kv_head_ascending(name, ratio):
    prompt = prompt_of(n=64, hkv=2, h=6)
    pol = policy(name)
    index = pol.keep(prompt, ratio)
    kept = pol.kept(prompt, ratio)
    assert index.shape == (1, 2, kept)
    assert bool((index.diff(dim=-1) > 0).all()), "positions ascending and distinct"
    assert 0 <= int(index.min()) and int(index.max()) < 64
    if name != "pyramidkv":
        assert kept == max(1, int(64 * (1 - ratio)))


@pytest.mark.parametrize("name", kvcache.available())
@pytest.mark.parametrize("new", [1, 3])
def test_decoding_over_the_kept_set_equals_the_masked_dense_reference(name, new):
    prompt = prompt_of(n=40, h=4, hkv=2)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, new, 16, generator=g)
    k_new, v_new = (torch.randn(1, 2, new, 16, generator=g) for _ in range(2))
    index = policy(name).keep(prompt, 0.5)
    keys, values = kvcache.gathered(prompt.keys, prompt.values, index)
    fast = kvcache.attend(q, torch.cat([keys, k_new], 2), torch.cat([values, v_new], 2))
    kept = torch.zeros(1, 2, 40, dtype=torch.bool).scatter(2, index, True)
    all_k, all_v = torch.cat([prompt.keys, k_new], 2), torch.cat([prompt.values, v_new], 2)
    torch.testing.assert_close(fast, kvcache.reference_attend(q, all_k, all_v, kept), rtol=1e-5, atol=1e-5)


def test_each_kv_head_keeps_its_own_positions():
    prompt = prompt_of(n=64, h=4, hkv=2, seed=3)
    index = kvcache.build("knorm").keep(prompt, 0.5)
    assert not torch.equal(index[0, 0], index[0, 1])
    norms = prompt.keys.norm(dim=-1)
    for head in range(2):  # every kept key's norm is at most every dropped one's
        kept = torch.zeros(64, dtype=torch.bool)
        kept[index[0, head]] = True
        assert norms[0, head][kept].max() <= norms[0, head][~kept].min()


def test_streaming_llm_keeps_the_sinks_and_the_most_recent():
    index = kvcache.build("streaming_llm", n_sink=4).keep(prompt_of(n=64), 0.75)  # 16 kept
    assert index[0, 0].tolist() == [0, 1, 2, 3] + list(range(52, 64))


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
def test_the_observation_window_is_always_kept(name):
    index = policy(name).keep(prompt_of(n=64), 0.75)
    assert set(range(56, 64)) <= set(index[0, 0].tolist())


def test_tova_keeps_one_set_for_every_head_and_the_last_position():
    index = kvcache.build("tova").keep(prompt_of(n=64, h=4, hkv=2), 0.5)
    assert torch.equal(index[0, 0], index[0, 1]) and int(index[0, 0, -1]) == 63


def test_expected_attention_keeps_the_sinks():
    index = policy("expected_attention").keep(prompt_of(n=64), 0.875)
    assert index[0, 0, :4].tolist() == [0, 1, 2, 3]


def test_pyramidkv_budgets_shrink_with_depth_and_keep_the_total():
    pol = kvcache.build("pyramidkv")
    budgets = [pol.kept(prompt_of(n=1024, d=8, layer=layer, layers=8), 0.5) for layer in range(8)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    assert abs(sum(budgets) - 8 * 512) <= 8, budgets


def test_random_is_seeded_and_differs_by_layer():
    pol = kvcache.build("random", seed=5)
    first, again = pol.keep(prompt_of(layer=0), 0.5), pol.keep(prompt_of(layer=0), 0.5)
    assert torch.equal(first, again) and not torch.equal(first, pol.keep(prompt_of(layer=1), 0.5))


@pytest.mark.parametrize("ratio", [0, 1, -0.25, 1.5, "0.5", True])
def test_a_ratio_outside_zero_one_is_refused_naming_it(ratio):
    with pytest.raises(ValueError, match=r"ratio=.*strictly between 0 and 1"):
        kvcache.build("knorm").keep(prompt_of(), ratio)


def test_bad_names_options_and_prompts_are_refused():
    with pytest.raises(ValueError, match="unknown KV-cache policy 'snap'.*snapkv"):
        kvcache.build("snap")
    with pytest.raises(ValueError, match="snapkv: options window not all taken; it takes window_size, kernel_size"):
        kvcache.build("snapkv", window=4)
    with pytest.raises(ValueError, match="kernel_size=4: odd"):
        kvcache.build("snapkv", kernel_size=4)
    with pytest.raises(ValueError, match="a prompt of 32 positions; window_size=64"):
        kvcache.build("snapkv").keep(prompt_of(n=32), 0.5)
    no_rope = kvcache.Prompt(*[t for t in (prompt_of().keys, prompt_of().values, prompt_of().queries)])
    with pytest.raises(ValueError, match="expected_attention: needs the model's rotary embedding"):
        kvcache.build("expected_attention").keep(no_rope, 0.5)
