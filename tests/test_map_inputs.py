"""What a learned feature map reads and how it starts (linear.py's `MapInputs`): feature_inputs="pre_rope" undoes
RoPE, feature_init="kaiming" and query_scaled=False are LoLCATs' code's forms.

Checked: the rotation undone is the inverse of transformers' own `apply_rotary_pos_emb`; the pre-RoPE kernel is
shift-invariant (the same text at two offsets gives the same outputs; post_rope's does not); decoding with an
offset equals the forward; in a tiny Llama the whole model is unchanged by shifted position ids with pre_rope
(not with post_rope), its cache included, θ taken from the model; kaiming maps start as torch draws them, with no
trained bias; bad input named. (References, gradients and decoding: the registry's tests run every example.)
"""

from __future__ import annotations

import pytest
import torch

import variants
from conftest import rope_undone
from helpers import tiny_llama_config
from variants.methods.linear import unrotated

THETA = 100.0
CASES = [
    ("window_linear", {"window": 3, "block": 2}),
    ("linear", {"feature_map": "hedgehog", "chunk_size": 4}),
    ("gated_deltanet", {"feature_map": "hedgehog", "chunk_size": 4}),
    ("mamba2", {"feature_map": "hedgehog", "chunk_size": 4}),
]


def rope_applied(x, positions, theta=THETA):
    """RoPE from its definition: each pair (x_i, x_{i+D/2}) as a complex number turned by p θ^(−2i/D)."""
    return rope_undone(x, -positions, theta)


def build(name, options, inputs="pre_rope", seed=0):
    torch.manual_seed(seed)
    attn = variants.build(name, num_heads=2, head_dim=8, feature_inputs=inputs, rope_theta=THETA, **options).double()
    with torch.no_grad():  # away from the identity start, so φ is no special case
        for p in attn.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return attn


def qkv(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def test_unrotated_inverts_transformers_rotation():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = pytest.importorskip("transformers").LlamaConfig(
        hidden_size=32, num_attention_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 500.0}
    )
    rotary = llama.LlamaRotaryEmbedding(config)
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [8000, 8001, 8002, 8003, 8004, 8005]])
    cos, sin = rotary(q, positions)
    q_rot, k_rot = llama.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(unrotated(q_rot, positions, 500.0), q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unrotated(k_rot, positions, 500.0), k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, options", CASES, ids=[c[0] for c in CASES])
def test_the_pre_rope_kernel_is_shift_invariant(name, options):
    q0, k0, v = qkv()
    outs = {}
    for inputs in ("pre_rope", "post_rope"):
        attn = build(name, options, inputs)
        for offset in (0, 37):
            positions = torch.arange(offset, offset + q0.shape[2])
            attn.position_offset = offset  # (variants.hf sets it from the model's position ids)
            outs[inputs, offset] = attn(rope_applied(q0, positions), rope_applied(k0, positions), v, causal=True)
    torch.testing.assert_close(outs["pre_rope", 0], outs["pre_rope", 37], atol=1e-5, rtol=1e-5)
    assert (outs["post_rope", 0] - outs["post_rope", 37]).abs().max() > 1e-3  # LoLCATs' reads absolute positions


@pytest.mark.parametrize("name, options", CASES, ids=[c[0] for c in CASES])
def test_decoding_at_an_offset_equals_the_forward(name, options):
    attn = build(name, options)
    attn.position_offset = 11
    q, k, v = qkv(n=10)
    with torch.no_grad():
        whole = attn(q, k, v, causal=True)
        state, parts = attn.init_state(1, 2, 8, 8, torch.float64, torch.device("cpu")), []
        for sl in (slice(0, 4), slice(4, 5), slice(5, 10)):
            out, state = attn.step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state)
            parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 2), whole)


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 500.0}
    config = tiny_llama_config(rope_parameters=rope, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).double().eval()


@pytest.mark.parametrize("inputs", ["pre_rope", "post_rope"])
def test_a_llama_with_pre_rope_ignores_where_the_text_starts(inputs):
    import variants.hf as vh

    model = vh.use(tiny_llama(), "window_linear", window=3, feature_inputs=inputs)
    attn = next(m for m in model.modules() if isinstance(m, variants.variant_class("window_linear")))
    with torch.no_grad():  # the maps away from their start, and the linear part weighed as much as the window
        for m in model.modules():
            if isinstance(m, type(attn)):
                m.window_factor.fill_(-5.0)
                for p in m.parameters():
                    p.add_(0.5 * torch.randn_like(p))
    ids = torch.randint(1, 257, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids).logits
        shifted = model(ids, position_ids=torch.arange(50, 64)[None].expand(2, -1)).logits
        first = model(ids[:, :10], use_cache=True)  # the rest one position at a time through the cache
        cache, steps = first.past_key_values, []
        for t in range(10, 14):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    if inputs == "pre_rope":
        assert attn.rope_theta == 500.0  # (the model's, not the option's default)
        torch.testing.assert_close(shifted, logits, atol=1e-6, rtol=1e-6)
    else:
        assert (shifted - logits).abs().max() > 1e-3
    torch.testing.assert_close(torch.cat([first.logits, *steps], 1), logits)


def test_kaiming_maps_start_as_lolcats_draws_them_with_no_trained_bias():
    torch.manual_seed(0)
    attn = variants.build("window_linear", num_heads=3, head_dim=8, feature_dim=4, feature_init="kaiming")
    weight = attn.q_features.weight  # (H, D, F): torch's fan_in for it is D·F
    bound = (6 / (8 * 4)) ** 0.5  # kaiming_uniform_'s bound with its defaults (a = 0): sqrt(6 / fan_in)
    assert weight.shape == (3, 8, 4) and weight.abs().max() <= bound and weight.abs().max() > bound / 2
    trained = {name for name, _ in attn.named_parameters()}
    assert "q_features.bias" not in trained and "q_features.weight" in trained and not attn.q_features.bias.any()
    identity = variants.build("window_linear", num_heads=3, head_dim=8, feature_dim=4)
    assert torch.equal(identity.q_features.weight[0], torch.eye(8, 4)) and "q_features.bias" in dict(
        identity.named_parameters()
    )


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="feature_inputs='sideways'"):
        variants.build("window_linear", num_heads=2, head_dim=8, feature_inputs="sideways")
    with pytest.raises(ValueError, match="feature_map='elu'"):
        variants.build("linear", feature_inputs="pre_rope")
    with pytest.raises(ValueError, match="even head_dim"):
        variants.build("window_linear", num_heads=2, head_dim=7, feature_inputs="pre_rope")
    with pytest.raises(ValueError, match="feature_init='xavier'"):
        variants.build("window_linear", num_heads=2, head_dim=8, feature_init="xavier")
    with pytest.raises(ValueError, match="query_scaled='no'"):
        variants.build("mamba2", num_heads=2, head_dim=8, feature_map="hedgehog", query_scaled="no")
    with pytest.raises(ValueError, match="feature_init='kaiming' is for a learned feature map"):
        variants.build("mamba2", num_heads=2, head_dim=8, feature_init="kaiming")
    with pytest.raises(ValueError, match="rope_theta=0.5"):
        variants.build("window_linear", num_heads=2, head_dim=8, feature_inputs="pre_rope", rope_theta=0.5)
    transformers = pytest.importorskip("transformers")
    import variants.hf as vh

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=61))
    with pytest.raises(ValueError, match="rotary position embedding"):
        vh.use(gpt2, "window_linear", window=3, feature_inputs="pre_rope")(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("inputs", ["post_rope", "pre_rope"])
def test_older_shares_follow_their_definition(inputs):
    """window_linear.older_shares against a per-row sum: the linear part's mass over the shared normalizer, and
    exact softmax's probability on the same old keys (grouped K: each query head reads its group's key)."""
    attn = build("window_linear", {"window": 3, "block": 2}, inputs)
    q, _, _ = qkv(n=12)
    k = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    mine, exact = attn.older_shares(q, k, rows=5)
    scale, f = 8**-0.5, torch.sigmoid(attn.window_factor)
    phi_q = attn.q_features(attn._map_query(q, 0))
    phi_k = attn.k_features(attn._pre_rope(k.expand(1, 2, 12, 8), 0))
    for h in range(2):
        for row, t in enumerate(range(7, 12)):
            s = torch.stack([q[0, h, t] @ k[0, 0, j] * scale for j in range(t + 1)])
            old = [j for j in range(t + 1) if t - j > 3]
            win = [j for j in range(t + 1) if t - j <= 3]
            lin = sum(phi_q[0, h, t] @ phi_k[0, h, j] for j in old)
            e = torch.exp(s[win] - s[win].max()).sum()
            torch.testing.assert_close(mine[0, h, row], lin / (f[h] * e + lin))
            torch.testing.assert_close(exact[0, h, row], torch.softmax(s, 0)[old].sum())
