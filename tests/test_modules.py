"""MultiHeadAttention, positional encoding, TransformerBlock and swap_attention."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import variants
from conftest import ref_full


def hand_written_mha(mha: variants.MultiHeadAttention, query, key, value, causal=False, kpm=None):
    """Classic multi-head attention written out with the module's weights and the dense reference."""
    h = mha.num_heads

    def heads(x, proj):  # (B, N, E) -> (B, H, N, E/H)
        y = x @ proj.weight.T + proj.bias
        return y.view(y.shape[0], y.shape[1], h, -1).transpose(1, 2)

    out = ref_full(heads(query, mha.q_proj), heads(key, mha.k_proj), heads(value, mha.v_proj), causal, kpm)
    out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)
    return out @ mha.out_proj.weight.T + mha.out_proj.bias


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_mha_equals_hand_written_reference(causal):
    torch.manual_seed(0)
    mha = variants.MultiHeadAttention(32, 4, variant="full").double()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    kpm = torch.ones(2, 11, dtype=torch.bool)
    kpm[0, 7:] = False
    torch.testing.assert_close(mha(x, causal=causal, key_padding_mask=kpm), hand_written_mha(mha, x, x, x, causal, kpm))


def test_mha_cross_attention_and_gradients():
    torch.manual_seed(0)
    mha = variants.MultiHeadAttention(16, 2, variant="full_naive").double()
    x, mem = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(3, 9, 16, dtype=torch.float64)
    out = mha(x, mem)
    torch.testing.assert_close(out, hand_written_mha(mha, x, mem, mem))
    out.sum().backward()
    assert all(p.grad is not None for p in mha.parameters())


def test_mha_passes_options_and_registers_variant_parameters():
    mha = variants.MultiHeadAttention(32, 4, variant="memory_compressed", compression=2)
    assert mha.attention.compression == 2
    assert "attention.k_weight" in dict(mha.named_parameters())
    mha = variants.MultiHeadAttention(32, 4, variant="sliding_window", window=3)
    assert mha.attention.window == 3


def test_the_output_gate_multiplies_the_heads_by_a_sigmoid_of_the_query():
    """Qwen3-Next's gated attention: W_o (attention(x) ⊙ σ(x W_g + b_g)), written out; a gate held open is the
    ungated module."""
    torch.manual_seed(0)
    gated = variants.MultiHeadAttention(32, 4, variant="full", output_gate=True).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    plain = variants.MultiHeadAttention(32, 4, variant="full").double()
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("gate_proj")})
    heads = (hand_written_mha(plain, x, x, x, True) - plain.out_proj.bias) @ torch.linalg.inv(plain.out_proj.weight.T)
    gate = torch.sigmoid(x @ gated.gate_proj.weight.T + gated.gate_proj.bias)
    want = (heads * gate) @ gated.out_proj.weight.T + gated.out_proj.bias
    torch.testing.assert_close(gated(x, causal=True), want)
    with torch.no_grad():
        gated.gate_proj.weight.zero_(), gated.gate_proj.bias.fill_(50.0)  # σ(50) = 1 in float64 to 1e-21
    torch.testing.assert_close(gated(x, causal=True), plain(x, causal=True))
    with pytest.raises(ValueError, match=r"output_gate must be a bool, got 'yes'"):
        variants.MultiHeadAttention(32, 4, output_gate="yes")


@pytest.mark.parametrize("variant", ["full", "forgetting", "kda", "linear", "window_linear"])
def test_a_block_with_the_output_gate_trains_with_any_variant(variant):
    torch.manual_seed(0)
    block = variants.TransformerBlock(16, 2, 32, variant=variant, output_gate=True)
    block(torch.randn(2, 7, 16), causal=True).sum().backward()
    assert block.attn.gate_proj.weight.grad is not None and block.attn.gate_proj.weight.grad.abs().sum() > 0


def test_mha_bad_arguments():
    with pytest.raises(ValueError, match=r"d_model=30 must be divisible by num_heads=4"):
        variants.MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match=r"unknown variant 'fast'"):
        variants.MultiHeadAttention(32, 4, variant="fast")
    mha = variants.MultiHeadAttention(32, 4)
    with pytest.raises(
        ValueError, match=r"query must be a float tensor of shape \(B, N, d_model=32\), got \(2, 5, 16\)"
    ):
        mha(torch.randn(2, 5, 16))


def test_sinusoidal_positional_encoding_formula():
    pe = variants.SinusoidalPositionalEncoding(6, max_len=50)
    out = pe(torch.zeros(1, 50, 6))[0]
    for pos in (0, 1, 17, 49):
        for i in range(3):
            angle = pos / 10000 ** (2 * i / 6)
            assert out[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert out[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    with pytest.raises(ValueError, match=r"sequence length 51 exceeds max_len=50"):
        pe(torch.zeros(1, 51, 6))
    assert variants.SinusoidalPositionalEncoding(5, 10)(torch.zeros(1, 3, 5)).shape == (1, 3, 5)  # odd d_model


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize(
    "variant, options", [("full", {}), ("sliding_window", {"window": 2}), ("linear", {}), ("memory_compressed", {})]
)
def test_transformer_block_runs_and_trains(variant, options, norm):
    torch.manual_seed(0)
    block = variants.TransformerBlock(16, 2, 32, variant=variant, norm=norm, **options)
    x = torch.randn(2, 10, 16)
    y = block(x, causal=True)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    assert all(p.grad is not None for p in block.parameters())


def test_transformer_block_pre_norm_formula():
    torch.manual_seed(0)
    block = variants.TransformerBlock(16, 2, 32, norm="pre").double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    h = x + block.attn(block.norm1(x))
    torch.testing.assert_close(block(x), h + block.ff(block.norm2(h)))
    with pytest.raises(ValueError, match=r"norm must be 'pre' or 'post', got 'mid'"):
        variants.TransformerBlock(16, 2, 32, norm="mid")


# -- swap_attention ------------------------------------------------------------------------------


def _encoder(batch_first=True):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).double()


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
def test_swap_full_equals_original_encoder(batch_first, train):
    model = _encoder(batch_first).train(train)
    x = torch.randn(3, 12, 32, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1)
    pad = torch.zeros(3, 12, dtype=torch.bool)
    pad[0, 9:] = True  # torch's convention: True = padding
    causal = nn.Transformer.generate_square_subsequent_mask(12, dtype=torch.float64)
    with torch.no_grad():
        want_plain = model(x)
        want_pad = model(x, src_key_padding_mask=pad)
        want_causal = model(x, mask=causal, is_causal=True)
    swapped = variants.swap_attention(model, "full")
    assert not any(isinstance(m, nn.MultiheadAttention) for m in swapped.modules())
    with torch.no_grad():
        torch.testing.assert_close(swapped(x), want_plain, atol=1e-5, rtol=1e-5)
        got_pad = swapped(x, src_key_padding_mask=pad)
        if not batch_first:
            got_pad, want_pad = got_pad.transpose(0, 1), want_pad.transpose(0, 1)
        # real tokens agree; torch's eval fast path writes zeros at padded positions, whose outputs are meaningless
        torch.testing.assert_close(got_pad[~pad], want_pad[~pad], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(swapped(x, mask=causal, is_causal=True), want_causal, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            swapped(x, mask=causal), want_causal, atol=1e-5, rtol=1e-5
        )  # mask recognized as causal


def test_swap_reuses_weights_and_trains():
    model = _encoder()
    before = {id(p) for p in model.parameters()}
    swapped = variants.swap_attention(model, "sliding_window", window=3)
    assert {id(p) for p in swapped.parameters()} == before
    out = swapped(torch.randn(2, 20, 32, dtype=torch.float64))
    out.sum().backward()
    assert swapped.layers[0].self_attn.in_proj_weight.grad is not None


def test_swap_rejects_arbitrary_masks():
    swapped = variants.swap_attention(_encoder(), "full")
    mask = torch.zeros(5, 5, dtype=torch.bool)
    mask[0, 3] = True
    with pytest.raises(ValueError, match=r"accept only a causal attn_mask"):
        swapped(torch.randn(1, 5, 32, dtype=torch.float64), mask=mask)


def test_swap_bare_multihead_attention():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    want, _ = mha(x, x, x, need_weights=False)
    got, weights = variants.swap_attention(mha, "full")(x, x, x)
    torch.testing.assert_close(got, want)
    assert weights is None


@pytest.mark.parametrize("page", ["README.md", "docs/transformers.md"])
def test_readme_snippet_runs(page):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, f"{page} has no python example"
    for code in blocks:
        if "transformers" in code:
            pytest.importorskip("transformers")  # the hf extra's snippet (CI installs it)
        exec(compile(code, page, "exec"), {})
