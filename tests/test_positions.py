"""Position encodings (variants/positions): each equals its definition written element by element (float64); a
variant that carries a score bias equals the dense definition with the bias (outputs and gradients, the bias's
own included); every other variant refuses one, naming why; the attention module applies rope and the biases."""

import math

import pytest
import torch

import variants
from variants._checks import distances
from variants.positions import ENCODINGS, attention_encoding, encoding_unsupported_reason, input_encoding
from variants.positions.alibi import AlibiBias, alibi_slopes
from variants.positions.learned import LearnedPositionalEmbedding
from variants.positions.relative import T5RelativeBias, relative_bucket
from variants.positions.rope import RotaryEmbedding

CARRIERS = [name for name in variants.available() if not variants.variant_class(name).score_bias_unsupported_reason()]


def test_learned_adds_its_rows_and_refuses_past_its_table():
    pe = LearnedPositionalEmbedding(4, max_len=6)
    x = torch.randn(2, 5, 4)
    assert torch.equal(pe(x), x + pe.table[:5])
    with pytest.raises(ValueError, match=r"sequence length 7 exceeds max_len=6"):
        pe(torch.zeros(1, 7, 4))


def test_rope_is_a_rotation_of_each_plane_by_its_angle():
    d, base = 6, 10000.0
    rope = RotaryEmbedding(d)
    x = torch.randn(1, 2, 5, d, dtype=torch.float64)
    positions = torch.tensor([0, 3, 7, 100, 4096])
    out = rope(x, positions)
    for t in range(5):
        for i in range(d // 2):
            a = positions[t].item() * base ** (-2 * i / d)
            x1, x2 = x[..., t, i], x[..., t, i + d // 2]
            assert torch.allclose(out[..., t, i], x1 * math.cos(a) - x2 * math.sin(a), atol=1e-12)
            assert torch.allclose(out[..., t, i + d // 2], x1 * math.sin(a) + x2 * math.cos(a), atol=1e-12)


def test_rope_scores_depend_on_the_distance_only():
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(t, s):
        return (rope(q, torch.tensor([t])) * rope(k, torch.tensor([s]))).sum().item()

    assert score(10, 3) == pytest.approx(score(1007, 1000), abs=1e-9)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-6)
    with pytest.raises(ValueError, match=r"head_dim=5 must be an even int"):
        RotaryEmbedding(5)


@pytest.mark.parametrize("heads", [1, 4, 6, 8, 12])
def test_alibi_slopes_and_bias_follow_the_paper(heads):
    slopes = alibi_slopes(heads)
    if heads in (1, 4, 8):  # a power of two: 2^(-8h/H), h = 1 .. H
        assert slopes == pytest.approx([2 ** (-8 * h / heads) for h in range(1, heads + 1)])
    else:  # the power of two below, then every other slope of the next power
        below = 2 ** math.floor(math.log2(heads))
        above = [2 ** (-8 * h / (2 * below)) for h in range(1, 2 * below + 1)]
        assert slopes == pytest.approx(alibi_slopes(below) + above[0::2][: heads - below])
    d = distances(5, 9, "cpu")
    bias = AlibiBias(heads)(d, causal=False)
    for h in range(heads):
        for i in range(5):
            for j in range(9):
                assert bias[h, i, j].item() == pytest.approx(-slopes[h] * abs(4 + i - j))


def _t5_bucket(n: int, causal: bool, buckets: int, max_distance: int) -> int:
    """T5's `_relative_position_bucket` for one distance n = query − key, written as the paper's code reads."""
    offset = 0
    if not causal:
        buckets //= 2
        offset = buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    exact = buckets // 2
    if n < exact:
        return offset + n
    wide = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (buckets - exact))
    return offset + min(wide, buckets - 1)


@pytest.mark.parametrize("causal", [True, False])
def test_relative_buckets_follow_t5(causal):
    d = torch.arange(-300, 301)
    got = relative_bucket(d, causal, 32, 128)
    assert got.tolist() == [_t5_bucket(n, causal, 32, 128) for n in d.tolist()]
    bias = T5RelativeBias(3)
    torch.nn.init.normal_(bias.table)
    assert torch.equal(bias(d, causal), bias.table[got].T)


def _dense(attn, q, k, v, causal, mask, bias):
    """softmax(scale q·k + bias(distance)) v over the keys the variant itself attends (its weights > 0 without a bias)."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    allowed = attn.attention_matrix(q.detach(), kk.detach(), causal=causal, key_padding_mask=mask) > 0
    s = q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias(distances(q.shape[-2], k.shape[-2], "cpu"), causal)
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0) @ vv


@pytest.mark.parametrize("name", CARRIERS)
@pytest.mark.parametrize("encoding", ["alibi", "relative"])
@pytest.mark.parametrize(
    "causal, n_q, kv_heads, padded", [(True, 21, 4, True), (False, 21, 2, True), (True, 6, 2, False)]
)
def test_a_score_bias_equals_its_dense_definition(name, encoding, causal, n_q, kv_heads, padded):
    torch.manual_seed(0)
    cls = variants.variant_class(name)
    if not cls.spec.supports_cross_attention and n_q != 21 and not causal:
        pytest.skip("no cross-attention")
    attn = variants.build(name, **({"window": 5, "block_size": 4} if cls.spec.reach_option else {})).double()
    bias = attention_encoding(encoding, 4, 8).double()
    if encoding == "relative":
        torch.nn.init.normal_(bias.table)
    q = torch.randn(2, 4, n_q, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 21, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = None
    if padded:
        mask = torch.ones(2, 21, dtype=torch.bool)
        mask[1, -4:] = False
    out = attn(q, k, v, causal=causal, key_padding_mask=mask, score_bias=bias)
    ref = _dense(attn, q, k, v, causal, mask, bias)
    assert torch.allclose(out, ref, atol=1e-10)
    inputs = [q, k, v, *bias.parameters()]
    for got, want in zip(
        torch.autograd.grad(out.square().sum(), inputs), torch.autograd.grad(ref.square().sum(), inputs)
    ):
        assert torch.allclose(got, want, atol=1e-9)


@pytest.mark.parametrize("name", [n for n in variants.available() if n not in CARRIERS])
def test_a_variant_without_scores_refuses_a_bias_naming_why(name):
    reason = variants.variant_class(name).score_bias_unsupported_reason()
    assert name in reason and len(reason) > 40
    assert encoding_unsupported_reason(name, "alibi") == reason
    assert encoding_unsupported_reason(name, "rope") is None


def test_every_kind_of_method_carries_what_it_can():
    assert {"full", "full_naive", "sliding_window"} <= set(CARRIERS)
    for name in ("linear", "mamba2", "gated_deltanet", "performer"):
        assert "never forms the query-key scores" in encoding_unsupported_reason(name, "relative")
    with pytest.raises(ValueError, match=r"positions='bogus' is not a position encoding; choose one of sinusoidal"):
        encoding_unsupported_reason("full", "bogus")
    assert list(ENCODINGS) == ["sinusoidal", "learned", "rope", "alibi", "relative", "none"]
    assert input_encoding("rope", 8, 10) is None and isinstance(input_encoding("learned", 8, 10), torch.nn.Module)


def test_attention_module_rotates_q_and_k_by_their_positions():
    torch.manual_seed(0)
    mha = variants.MultiHeadAttention(16, 2, variant="full_naive", positions="rope")
    x = torch.randn(1, 7, 16)
    rope = RotaryEmbedding(8)

    def heads(t):
        return t.view(1, 7, 2, 8).transpose(1, 2)

    q, k, v = heads(mha.q_proj(x)), heads(mha.k_proj(x)), heads(mha.v_proj(x))
    pos = torch.arange(7)
    inner = variants.build("full_naive")(rope(q, pos), rope(k, pos), v, causal=True)
    want = mha.out_proj(inner.transpose(1, 2).reshape(1, 7, 16))
    assert torch.allclose(mha(x, causal=True), want, atol=1e-6)


def test_attention_module_refuses_what_its_variant_cannot_carry():
    with pytest.raises(ValueError, match=r"positions='alibi': linear never forms the query-key scores"):
        variants.MultiHeadAttention(16, 2, variant="linear", positions="alibi")
    with pytest.raises(ValueError, match=r"positions='sinusoidal' is not an encoding an attention applies"):
        variants.TransformerBlock(16, 2, 32, variant="full", positions="sinusoidal")
    with pytest.raises(ValueError, match=r"takes no score bias"):
        variants.build("moba")(*(torch.randn(1, 2, 8, 4) for _ in range(3)), causal=True, score_bias=AlibiBias(2))
