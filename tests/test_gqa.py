"""Grouped-query attention: k and v with Hkv heads serving groups of H / Hkv query heads. Every variant either
computes it natively (no K/V repeated in memory; a decoding state of Hkv heads) or repeats K and V with the
reason its spec gives; each against the independent references (outputs and gradients) and decoding."""

from __future__ import annotations

import pytest
import torch

import variants
from conftest import assert_close_with_grads, independent_reference, make_padding, make_qkv, shipped
from helpers import peak_bytes, side_by_side

CPU = [name for name in shipped() if variants.variant_class(name).unavailable_reason("cpu") is None]


@pytest.fixture(autouse=True)
def _fresh_compiler(request):
    """sliding_window_flex compiles per shape: the shapes tried here must not use up the recompile limit of the
    compiled kernel the later tests count on."""
    yield
    if "sliding_window_flex" in request.node.name:
        torch._dynamo.reset()


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["H6-Hkv2", "H6-Hkv1"])
@pytest.mark.parametrize("name", CPU)
def test_grouped_inputs_match_the_independent_reference(name, kv_heads):
    cls = variants.variant_class(name)
    dtype = torch.float64 if cls.dtype_unsupported_reason("cpu", "float64") is None else torch.float32  # (flex)
    modes = [causal for causal in (False, True) if cls.mode_unsupported_reason(causal) is None]
    for options in cls.spec.example_options():
        attn = variants.build(name, num_heads=6, num_kv_heads=kv_heads, head_dim=8, **options).to(dtype)
        q, _, _ = make_qkv(b=2, h=6, n_q=13, d=8, dtype=dtype)
        _, k, v = make_qkv(b=2, h=kv_heads, n_q=13, d=8, seed=1, dtype=dtype)
        kpm = make_padding(2, 13, seed=3, all_padded_row=False)
        for causal in modes:
            if cls.backward_unsupported_reason("cpu"):
                with torch.no_grad():
                    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
                torch.testing.assert_close(
                    out.double(), independent_reference(name, attn, q, k, v, causal, kpm), atol=2e-5, rtol=2e-5
                )
                continue
            out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
            assert_close_with_grads(out, independent_reference(name, attn, q, k, v, causal, kpm), (q, k, v))


@pytest.mark.parametrize("name", [n for n in CPU if variants.variant_class(n).decode_unsupported_reason() is None])
def test_grouped_decoding_equals_the_forward_and_keeps_kv_heads_where_native(name):
    cls = variants.variant_class(name)
    dtype = torch.float64 if cls.dtype_unsupported_reason("cpu", "float64") is None else torch.float32
    attn = variants.build(name, num_heads=6, num_kv_heads=2, head_dim=8, **cls.spec.example_options()[0]).to(dtype)
    q, _, _ = make_qkv(b=2, h=6, n_q=14, d=8, dtype=dtype, requires_grad=False)
    _, k, v = make_qkv(b=2, h=2, n_q=14, d=8, dtype=dtype, seed=1, requires_grad=False)
    want = attn(q, k, v, causal=True)
    state, outs = attn.init_state(2, 6, 8, 8, dtype, kv_heads=2), []
    for t in range(0, 14, 3):
        out, state = attn.step(q[:, :, t : t + 3], k[:, :, t : t + 3], v[:, :, t : t + 3], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), want)
    # what the state holds per head: one per K/V head where the state is native, one per query head where it repeats
    heads = 6 if attn.state_repeats_kv_reason() else 2
    shared = getattr(attn, "shared_state", ())  # (mla's latents: one a position for every head)
    assert all(t.shape[1] == heads for n, t in state.tensors.items() if t.dim() >= 3 and n not in shared), {
        n: t.shape for n, t in state.tensors.items()
    }


def test_every_variant_computes_grouped_inputs_natively_or_says_why_it_repeats():
    native = sorted(name for name in shipped() if not variants.variant_class(name).spec.repeats_kv)
    assert {"full", "full_naive", "bilinear", "retention", "mamba2", "gla", "deltanet", "gated_deltanet"} <= set(native)
    for name in shipped():
        reason = variants.variant_class(name).spec.repeats_kv
        assert reason == "" or len(reason.split()) >= 5, (name, reason)  # a reason a user can read
    attn = variants.build(
        "mamba2", num_heads=4, head_dim=8, feature_map="hedgehog"
    )  # options can make a variant repeat
    assert "per query head" in attn.repeats_kv_reason()


def test_heads_that_do_not_divide_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"num_heads=9 is not a multiple of num_kv_heads=2"):
        variants.build("full", num_heads=9, num_kv_heads=2)
    attn = variants.build("mamba2", num_heads=6, head_dim=8)
    with pytest.raises(ValueError, match=r"H=6 query heads is not a multiple of Hkv=4 K/V heads"):
        attn.init_state(1, 6, 8, 8, kv_heads=4)
    attn = variants.build("retention", num_heads=6, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"built for num_kv_heads=2, got Hkv=3"):
        attn(*(torch.randn(1, h, 4, 8) for h in (6, 3, 3)), causal=True)
    attn = variants.build("mamba2", num_heads=6, head_dim=8)  # gates for 6 K/V heads: grouped inputs need the hint
    with pytest.raises(
        ValueError, match=r"Hkv=2 heads are not supported: its gates are built for 6 K/V heads .* num_kv_heads=2"
    ):
        attn(*(torch.randn(1, h, 4, 8) for h in (6, 2, 2)), causal=True)


NATIVE_MEMORY = ["full", "retention", "mamba2", "gated_deltanet"]  # (full_naive's N x N scores hide a K/V copy)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 1)], ids=["H9-Hkv3", "H8-Hkv1"])
@pytest.mark.parametrize("name", NATIVE_MEMORY)
def test_native_grouping_costs_no_memory_beyond_the_query_heads_work(name, heads, kv_heads):
    # the same queries on fewer K/V heads: a native variant's peak extra memory is no larger than with one K/V
    # head per query head (a repeat would add 2 x N x H x D of copies)
    n = 2048
    grouped, plain = side_by_side(
        [
            lambda hkv=hkv: peak_bytes(
                name, [n], False, causal=[True], threads=1, num_heads=heads, num_kv_heads=hkv, head_dim=32, kv_heads=hkv
            )[0]
            for hkv in (kv_heads, heads)
        ]
    )
    copies = 2 * n * heads * 32 * 4
    assert grouped <= plain + copies // 4, (grouped, plain, copies)


NATIVE_STATE = [name for name in CPU if variants.variant_class(name).decode_unsupported_reason() is None]


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 1)], ids=["H9-Hkv3", "H8-Hkv1"])
@pytest.mark.parametrize("name", NATIVE_STATE)
def test_a_state_kept_per_kv_head_does_not_grow_with_the_group_factor(name, heads, kv_heads):
    # every option set: where the state says it keeps one head a K/V head, 20 grouped steps leave exactly the bytes
    # of a model with Hkv query heads, and the outputs equal the forward's; where it repeats, H heads and a reason
    cls = variants.variant_class(name)
    dtype = torch.float64 if cls.dtype_unsupported_reason("cpu", "float64") is None else torch.float32
    for options in cls.spec.example_options():
        attn = variants.build(name, num_heads=heads, num_kv_heads=kv_heads, head_dim=8, **options).to(dtype)
        reason = attn.state_repeats_kv_reason()
        q, _, _ = make_qkv(b=2, h=heads, n_q=20, d=8, dtype=dtype, requires_grad=False)
        _, k, v = make_qkv(b=2, h=kv_heads, n_q=20, d=8, dtype=dtype, seed=1, requires_grad=False)
        kpm = make_padding(2, 20, seed=4, all_padded_row=False) if cls.spec.supports_key_padding_mask else None
        cut = (lambda lo, hi: None) if kpm is None else (lambda lo, hi: kpm[:, lo:hi])  # noqa: E731
        state = attn.prefill(
            q[:, :, :12],
            k[:, :, :12],
            v[:, :, :12],
            attn.init_state(2, heads, 8, 8, dtype, kv_heads=kv_heads),
            key_padding_mask=cut(0, 12),
        )
        outs = []
        for t in range(12, 20):
            out, state = attn.step(
                q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, key_padding_mask=cut(t, t + 1)
            )
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, dim=2), attn(q, k, v, causal=True, key_padding_mask=kpm)[:, :, 12:])
        if reason:
            assert len(reason.split()) >= 5, (name, options, reason)
            continue
        alone = variants.build(name, num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=8, **options).to(dtype)
        plain = alone.prefill(
            q[:, :kv_heads], k, v, alone.init_state(2, kv_heads, 8, 8, dtype, kv_heads=kv_heads), key_padding_mask=kpm
        )
        assert state.nbytes() == plain.nbytes(), (name, options, state.nbytes(), plain.nbytes())


def test_the_window_and_the_fixed_feature_maps_decode_per_kv_head():
    # their forward kernels repeat K/V (each spec says why), their decoding states need K and V only
    for name, options in (
        ("sliding_window", {}),
        ("sliding_window", {"global_tokens": 2}),
        ("linear", {}),
        ("linear", {"feature_map": "taylor"}),
    ):
        attn = variants.build(name, num_heads=9, num_kv_heads=3, head_dim=8, **options)
        assert attn.repeats_kv_reason() and attn.state_repeats_kv_reason() == "", (name, options)
    hedgehog = variants.build("linear", num_heads=9, num_kv_heads=3, head_dim=8, feature_map="hedgehog")
    assert "per query head" in hedgehog.state_repeats_kv_reason()


def _gate_cases():
    for name in CPU:
        cls = variants.variant_class(name)
        for i, options in enumerate(cls.spec.example_options()):
            yield pytest.param(name, options, id=f"{name}-ex{i}")


@pytest.mark.parametrize("name, options", list(_gate_cases()))
def test_the_gate_passes_every_variant_on_grouped_kv(name, options):
    # bench run --kv-heads: the gate calls the variant's reference() with K/V of fewer heads than q; every reference
    # takes them (8 of 18 once failed every cell with "size of tensor a (4) must match (2)")
    from harness.core.gate import gate, gate_length

    cls = variants.variant_class(name)
    causal = cls.causal_unsupported_reason() is None
    attn = variants.build(name, num_heads=4, num_kv_heads=2, head_dim=8, **options)
    backward = attn.backward_unsupported_reason("cpu") is None
    decode = causal and attn.decode_unsupported_reason() is None
    n = gate_length(attn, 16, 64)
    verdict = gate(attn, 2, 4, n, 8, "float32", "cpu", causal=causal, backward=backward, decode=decode, kv_heads=2)
    assert verdict["ok"], verdict["message"]


def test_retention_decays_follow_the_kv_heads_with_or_without_a_feature_map():
    # one rule: query head h decays with γ of its K/V head h // (H / Hkv), whether K is repeated (hedgehog) or not
    q, k, v = make_qkv(b=1, h=4, n_q=5, d=8, requires_grad=False)
    k, v = k[:, :2], v[:, :2]
    plain = variants.build("retention", num_heads=4, num_kv_heads=2, head_dim=8).double()
    mapped = variants.build("retention", num_heads=4, num_kv_heads=2, head_dim=8, feature_map="hedgehog").double()
    own = plain.recurrence_inputs(q, k, v)["log_decay"][0, :, 0]  # (Hkv,): the state is per K/V head
    repeated = mapped.recurrence_inputs(q, *mapped._grouped_kv(q, k, v))["log_decay"][0, :, 0]  # (H,)
    torch.testing.assert_close(repeated, own.repeat_interleave(2))
    unhinted = variants.build("retention", num_heads=4, head_dim=8, feature_map="hedgehog").double()
    with pytest.raises(ValueError, match=r"decays follow the K/V heads.*num_kv_heads=2"):
        unhinted(q, k, v, causal=True)
