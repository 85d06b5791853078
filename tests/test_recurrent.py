"""The gated recurrences (retention, mamba2, gla, deltanet, gated_deltanet) and moba: their inputs against the
textbook recurrence, chunk and group boundaries, decoding one position after another, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

import variants
from conftest import assert_close_with_grads, build_case, make_padding, make_qkv, ref_moba, ref_recurrence, shipped
from variants.methods import _recurrence

RECURRENT = [name for name in shipped() if hasattr(variants.variant_class(name), "recurrence_inputs")]
CAUSAL_ONLY = [name for name in shipped() if not variants.variant_class(name).spec.supports_non_causal]


def test_the_family_is_registered():
    assert set(RECURRENT) == {"retention", "mamba2", "gla", "deltanet", "gated_deltanet", "kda"}
    causal = {"moba", "window_linear", "forgetting", "dsa", "log_linear", "rwkv7"}
    assert set(CAUSAL_ONLY) == set(RECURRENT) | causal


@pytest.mark.parametrize("n_q", [13, 5], ids=["Nq13", "Nq5-bottom-right"])
@pytest.mark.parametrize("name", RECURRENT)
def test_output_is_the_textbook_recurrence_of_its_inputs(name, n_q):
    # what recurrence_inputs says the method computes, run step by step, is what the chunked form returns
    attn = build_case(name, {"chunk_size": 4})
    q, k, v = make_qkv(b=2, h=2, n_q=n_q, n_k=13, d=8)
    kpm = make_padding(2, 13)
    x = attn.recurrence_inputs(torch.nn.functional.pad(q, (0, 0, 13 - n_q, 0)), k, v, kpm)
    assert set(x) >= {"q", "k", "v", "scale"}
    assert ("beta" in x) == attn.delta_rule and ("log_decay" in x) == (name != "deltanet")
    want = ref_recurrence(x["q"][:, :, 13 - n_q :], x["k"], x["v"], x["scale"], x.get("log_decay"), x.get("beta"), kpm)
    assert_close_with_grads(attn(q, k, v, causal=True, key_padding_mask=kpm), want, (q, k, v))


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", RECURRENT)
def test_each_files_per_position_reference_is_the_parallel_form(name, kv_heads):
    """Each method file teaches its recurrence as a loop over positions (`step_reference`, at most 15 lines); it
    equals the parallel form (`reference`, _recurrence.py's) on the same inputs, padding, grouped K/V and Nq < Nk
    included. (The loop is not the gate's definition: in float32 it rounds so little that twice its error left
    mamba2's chunks 3.4e-6 against an allowed 2.4e-6 at N = 320.)"""
    import inspect

    cls = variants.variant_class(name)
    assert "step_reference" in vars(cls), f"{name}: its file carries no per-position step_reference()"
    assert len(inspect.getsource(cls.step_reference).splitlines()) <= 15, f"{name}: step_reference() over 15 lines"
    wide = [i + 1 for i, line in enumerate(inspect.getsource(inspect.getmodule(cls)).splitlines()) if len(line) > 120]
    assert not wide, f"{name}: lines over 120 columns (its spec included): {wide}"
    attn = build_case(name, {"chunk_size": 4, "num_heads": 2, "num_kv_heads": kv_heads})
    q, _, _ = make_qkv(b=2, h=2, n_q=5, n_k=11, d=8)
    _, k, v = make_qkv(b=2, h=kv_heads, n_q=5, n_k=11, d=8)
    kpm = make_padding(2, 11)
    loop = attn.step_reference(q, k, v, causal=True, key_padding_mask=kpm)
    torch.testing.assert_close(loop, attn.reference(q, k, v, causal=True, key_padding_mask=kpm), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", RECURRENT)
def test_chunk_and_group_boundaries_change_nothing(name, monkeypatch):
    # N = 150 over chunks of 4, 7 and the default, in groups of 32 positions (each recomputed in the backward)
    q, k, v = make_qkv(b=1, h=2, n_q=150, d=8)
    attn = build_case(name, {"chunk_size": 4})
    monkeypatch.setattr(_recurrence, "GROUP_POSITIONS", 32)
    for chunk in (4, 7, variants.effective_options(name)["chunk_size"]):
        attn.chunk_size = chunk
        assert_close_with_grads(attn(q, k, v, causal=True), attn.reference(q, k, v, causal=True), (q, k, v))
    params = list(attn.parameters())
    if params:  # the gates' parameters get the gradients of the dense form through the recomputed groups
        got = torch.autograd.grad(attn(q, k, v, causal=True).sum(), params)
        want = torch.autograd.grad(attn.reference(q, k, v, causal=True).sum(), params)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", RECURRENT)
def test_frozen_gates_still_pass_gradients_to_the_inputs(name, monkeypatch):
    # LoRA's stage freezes the variant's parameters and trains the projections: q, k, v get the dense form's
    # gradients through the recomputed groups, and no parameter asks for one
    monkeypatch.setattr(_recurrence, "GROUP_POSITIONS", 32)
    attn = build_case(name, {"chunk_size": 4, "feature_map": "hedgehog"})
    attn.requires_grad_(False)
    q, k, v = make_qkv(b=1, h=2, n_q=70, d=8)
    assert_close_with_grads(attn(q, k, v, causal=True), attn.reference(q, k, v, causal=True), (q, k, v))


def test_retention_decays_are_the_papers():
    attn = variants.build("retention")
    assert torch.allclose(
        attn.decay(4), torch.tensor([1 - 2**-5, 1 - 2**-6, 1 - 2**-7, 1 - 2**-8], dtype=torch.float64)
    )
    q, k, v = make_qkv(b=1, h=3, n_q=6, d=4, requires_grad=False)
    d = attn.decay(3)[:, None, None] ** (torch.arange(6)[:, None] - torch.arange(6)[None, :]).clamp_min(0).double()
    want = torch.matmul((q @ k.transpose(-1, -2)) * 0.5 * d.tril(), v)  # (Q Kᵀ ⊙ D) V, D_ts = γ^(t−s)
    torch.testing.assert_close(attn(q, k, v, causal=True), want)


def test_deltanet_replaces_the_value_of_a_key_written_twice():
    # with β = 1 the delta rule overwrites: read back at the same key, the state returns the last value
    attn = build_case("deltanet", {}, heads=1, head_dim=4)
    with torch.no_grad():
        attn.beta.b.fill_(50.0)  # σ(50) = 1
        attn.beta.w.zero_()
    k = torch.tensor([[[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [1.0, 0, 0, 0]]]], dtype=torch.float64)
    v = torch.tensor([[[[1.0, 2, 3, 4], [5.0, 6, 7, 8], [9.0, 10, 11, 12]]]], dtype=torch.float64)
    out = attn(k, k, v, causal=True, key_padding_mask=None)  # q = k: read each key back
    torch.testing.assert_close(out[0, 0, -1] * 2, v[0, 0, -1])  # scale D^-½ = 1/2; the first value is gone
    linear_sum = build_case("retention", {}, heads=1, head_dim=4)(k, k, v, causal=True)[0, 0, -1] * 2
    assert not torch.allclose(linear_sum, v[0, 0, -1])  # an additive state keeps both values


def test_gla_floor_keeps_strong_gates_finite_in_float32():
    attn = build_case("gla", {}, heads=2, head_dim=8, dtype=torch.float32)
    with torch.no_grad():
        attn.b_alpha.fill_(-200.0)  # σ(−200)^(1/16): log α = −12.5, floored at −5
    q, k, v = make_qkv(b=1, h=2, n_q=64, d=8, dtype=torch.float32)
    out = attn(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    want = attn.double().reference(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", CAUSAL_ONLY)
def test_strided_inputs_as_a_models_projections_give_them(name):
    # (B, N, H, D) projections transposed to (B, H, N, D): views, not contiguous (moba's backward once failed on them)
    attn = build_case(name, variants.variant_class(name).spec.example_options()[0])
    q, k, v = (
        t.transpose(1, 2).contiguous().transpose(1, 2).detach().requires_grad_()
        for t in make_qkv(b=2, h=2, n_q=24, d=8)
    )
    assert not q.is_contiguous()
    assert_close_with_grads(attn(q, k, v, causal=True), attn.reference(q, k, v, causal=True), (q, k, v))


@pytest.mark.parametrize("name", CAUSAL_ONLY)
def test_half_precision_is_computed_in_float32(name):
    attn = build_case(name, {}, heads=2, head_dim=16, dtype=torch.float32)
    q, k, v = make_qkv(b=1, h=2, n_q=1024, d=16, dtype=torch.float32, requires_grad=False)
    want = attn(q, k, v, causal=True)
    got = attn.to(torch.bfloat16)(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert ((got.float() - want).norm() / want.norm()) < 0.05


def test_moba_selects_top_k_earlier_blocks_by_mean_key():
    attn = variants.build("moba", block=4, top_k=2)
    q, k, v = make_qkv(b=1, h=2, n_q=20, d=8, requires_grad=False)
    chosen = attn.selected_blocks(q, k)  # (B, H, Nq, 5)
    assert chosen.shape == (1, 2, 20, 5) and chosen.dtype == torch.bool
    own = torch.arange(20) // 4
    assert (chosen.sum(-1) == own.clamp_max(2)).all()  # two earlier blocks where there are two, all before that
    assert not (chosen & (torch.arange(5)[None, :] >= own[:, None])).any()  # never the own block or a later one
    means = k.unflatten(2, (5, 4)).mean(3)  # (B, H, 5, D)
    gates = torch.einsum("bhid,bhjd->bhij", q, means).masked_fill(torch.arange(5)[None, :] >= own[:, None], -math.inf)
    best = gates.argmax(-1)
    assert chosen.gather(-1, best[..., None])[..., 0][:, :, own >= 1].all()  # the best earlier block is always chosen
    torch.testing.assert_close(attn(q, k, v, causal=True), ref_moba(q, k, v, 4, 2))


def test_moba_breaks_tied_gates_one_way_in_the_forward_the_reference_and_every_step():
    # an all-zero query scores every earlier block 0: the earlier block wins everywhere (topk's pick among ties
    # depended on how many blocks the call held, so a step chose other blocks than the forward: 1.41 apart)
    attn = build_case("moba", {"block": 4, "top_k": 1}, heads=1)
    q, k, v = make_qkv(b=1, h=1, n_q=17, d=8, requires_grad=False)
    q[:, :, 9:] = 0
    want = attn(q, k, v, causal=True)
    torch.testing.assert_close(want, attn.reference(q, k, v, causal=True))
    chosen = attn.selected_blocks(q, k)[0, 0, 9:]  # queries 9 ... 16: the earliest of their tied blocks
    assert all(row.nonzero().flatten().tolist() == [0] for row in chosen)
    state, outs = attn.init_state(1, 1, 8, 8, torch.float64), []
    for t in range(17):
        out, state = attn.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), want)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_moba_without_a_gradient_takes_the_fused_kernel_and_the_same_function(padded):
    # no gradient: each block's softmax comes from the CPU flash kernel (output and log-sum-exp), else written out
    q, k, v = make_qkv(b=2, h=2, n_q=41, d=8, requires_grad=False)
    kpm = make_padding(2, 41) if padded else None
    attn = variants.build("moba", block=4, top_k=2)
    with torch.no_grad():
        torch.testing.assert_close(attn(q, k, v, causal=True, key_padding_mask=kpm), ref_moba(q, k, v, 4, 2, kpm))
        torch.testing.assert_close(attn(q[:, :, 30:], k, v, causal=True), ref_moba(q[:, :, 30:], k, v, 4, 2))


def test_moba_takes_a_value_dim_other_than_the_head_dim():
    # the flash kernel needs Dv = D: the written-out softmax takes the rest (attention_matrix calls with Dv = Nk)
    q, k, _ = make_qkv(b=1, h=2, n_q=20, d=8)
    v = torch.randn(1, 2, 20, 5, dtype=torch.float64, requires_grad=True)
    attn = variants.build("moba", block=4, top_k=1)
    assert_close_with_grads(attn(q, k, v, causal=True), ref_moba(q, k, v, 4, 1), (q, k, v))
    with torch.no_grad():
        torch.testing.assert_close(attn(q, k, v, causal=True), ref_moba(q, k, v, 4, 1))
    assert attn.attention_matrix(q, k, causal=True).shape == (1, 2, 20, 20)


def test_moba_with_enough_top_k_is_exact_causal_attention():
    q, k, v = make_qkv(b=1, h=2, n_q=24, d=8, requires_grad=False)
    got = variants.build("moba", block=4, top_k=6)(q, k, v, causal=True)
    torch.testing.assert_close(got, variants.build("full")(q, k, v, causal=True))
    # what its spec says (the gate then checks it against exact softmax there): exact up to (top_k + 1) blocks, not beyond
    attn, full = variants.build("moba", block=4, top_k=2), variants.build("full")
    exact = attn.softmax_equivalent_length()
    assert exact == 12
    first = lambda n: (q[:, :, :n], k[:, :, :n], v[:, :, :n])  # noqa: E731 — the first n positions
    torch.testing.assert_close(attn(*first(exact), causal=True), full(*first(exact), causal=True))
    assert not torch.allclose(attn(*first(exact + 4), causal=True), full(*first(exact + 4), causal=True))


@pytest.mark.parametrize("tile", [6, 12, 2048])
def test_moba_written_out_backward_equals_autograd_of_the_definition(tile, monkeypatch):
    # without padding on the CPU: the forward by the flash kernel, the backward by its backward per block
    from variants.methods import moba

    monkeypatch.setattr(moba, "TILE_QUERIES", tile)
    q, k, v = make_qkv(b=2, h=2, n_q=40, d=8)
    attn = variants.build("moba", block=3, top_k=2)
    out = attn(q, k, v, causal=True)
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith("_FusedMoBA")
    assert_close_with_grads(out, ref_moba(q, k, v, 3, 2), (q, k, v))


@pytest.mark.parametrize("tile", [4, 8])
def test_moba_tiles_change_nothing(tile, monkeypatch):
    from variants.methods import moba

    q, k, v = make_qkv(b=2, h=2, n_q=37, d=8)
    kpm = make_padding(2, 37)
    attn = variants.build("moba", block=3, top_k=2)
    want = attn.reference(q, k, v, causal=True, key_padding_mask=kpm)
    monkeypatch.setattr(moba, "TILE_QUERIES", tile)
    assert_close_with_grads(attn(q, k, v, causal=True, key_padding_mask=kpm), want, (q, k, v))


# -- decoding ------------------------------------------------------------------------------------

DECODABLE = [
    name
    for name in shipped()
    if variants.variant_class(name).decode_unsupported_reason() is None
    and variants.variant_class(name).unavailable_reason("cpu") is None
]


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("name", DECODABLE)
def test_decoding_step_by_step_equals_the_causal_forward(name, step):
    cls = variants.variant_class(name)
    dtype = torch.float64 if cls.dtype_unsupported_reason("cpu", "float64") is None else torch.float32  # (flex)
    attn = build_case(name, cls.spec.example_options()[0], dtype=dtype)
    q, k, v = make_qkv(b=2, h=2, n_q=14, d=8, requires_grad=False, dtype=dtype)
    want = attn(q, k, v, causal=True)
    state = attn.init_state(2, 2, 8, 8, dtype)
    outs, sizes = [], []
    for start in range(0, 14, step):
        sl = slice(start, start + step)
        out, state = attn.step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state)
        outs.append(out)
        sizes.append(state.nbytes())
    torch.testing.assert_close(torch.cat(outs, dim=2), want)
    assert state.length == 14 and state.kind == attn.state_kind
    # a prefill (no outputs) of the first 11 positions leaves the state the steps left: the last 3 equal the forward
    filled = attn.prefill(q[:, :, :11], k[:, :, :11], v[:, :, :11], attn.init_state(2, 2, 8, 8, dtype))
    assert (
        filled.length == 11
        and filled.nbytes()
        == attn.step(q[:, :, :11], k[:, :, :11], v[:, :, :11], attn.init_state(2, 2, 8, 8, dtype))[1].nbytes()
    )
    torch.testing.assert_close(attn.step(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], filled)[0], want[:, :, 11:])
    if state.kind == "recurrent":  # a fixed size whatever N: what init_state made
        assert sizes == [attn.init_state(2, 2, 8, 8, dtype).nbytes()] * len(sizes) and sizes[0] > 0
    elif state.kind == "window":  # the g sinks and the last w positions, no more
        most = min(14, attn.global_tokens + attn.window) * 2 * 2 * (8 + 8) * q.element_size()
        assert sizes == sorted(sizes) and sizes[-1] == most
    elif state.kind == "window+recurrent":  # the last w positions and a constant F x (Dv + 1) state, no more
        most = min(14, attn.window) * 2 * 2 * (8 + 8) * q.element_size() + attn.init_state(2, 2, 8, 8, dtype).nbytes()
        assert sizes == sorted(sizes) and sizes[-1] == most
    elif state.kind == "compressed":  # the slots of the complete blocks and the raw keys of the unfinished one
        c = attn.compression  # (read by a step; the slots' buffer grows by doubling: at most twice that is held)
        assert attn.step_read_bytes(state) == (14 // c + 14 % c) * 2 * 2 * 16 * q.element_size()
        assert all(size <= 2 * (i * step // c + c) * 2 * 2 * 16 * q.element_size() for i, size in enumerate(sizes, 1))
    elif state.kind == "fenwick":  # log_linear: a D x Dv bucket for each set bit of the positions so far
        assert sizes == [
            bin(min(14, (i + 1) * step)).count("1") * 2 * 2 * 8 * 8 * q.element_size() for i in range(len(sizes))
        ]
    elif state.kind == "latent":  # mla: latent_dim + Hkv · rope_dim numbers a position, not the keys and values
        per = attn.latent_dim + 2 * attn.rope_dim
        assert sizes == [min(14, (i + 1) * step) * 2 * per * q.element_size() for i in range(len(sizes))]
    else:  # a KV cache: it grows with the positions
        assert state.kind == "kv" and sizes == sorted(sizes) and sizes[-1] > sizes[0]


@pytest.mark.parametrize("layout", ["left", "scattered"])
@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("name", DECODABLE)
def test_decoding_with_padding_equals_the_forward_with_its_mask(name, step, layout):
    # left padding (a batch generated together) and padding anywhere (every rule tried): the steps with each
    # new position's mask equal the causal forward given the whole mask, at every position (padded rows too)
    cls = variants.variant_class(name)
    dtype = torch.float64 if cls.dtype_unsupported_reason("cpu", "float64") is None else torch.float32  # (flex)
    options = dict(cls.spec.example_options()[-1])
    attn = build_case(name, options, dtype=dtype)
    n = 14
    q, k, v = make_qkv(b=3, h=2, n_q=n, d=8, requires_grad=False, dtype=dtype)
    if layout == "left":
        mask = torch.arange(n)[None, :] >= torch.tensor([[0], [5], [9]])  # 0, 5 and 9 padded positions first
    else:
        mask = make_padding(3, n, seed=4, all_padded_row=False)
        mask[0, :3] = True  # one row without padding at the start, beside rows with it
    want = attn(q, k, v, causal=True, key_padding_mask=mask)
    state = attn.init_state(3, 2, 8, 8, dtype)
    outs = []
    for start in range(0, n, step):
        sl = slice(start, start + step)
        out, state = attn.step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state, key_padding_mask=mask[:, sl])
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), want)
    # a padded prompt by prefill, then steps
    filled = attn.prefill(
        q[:, :, :11], k[:, :, :11], v[:, :, :11], attn.init_state(3, 2, 8, 8, dtype), key_padding_mask=mask[:, :11]
    )
    out, _ = attn.step(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], filled, key_padding_mask=mask[:, 11:])
    torch.testing.assert_close(out, want[:, :, 11:])
    if state.kind == "window":  # the masks kept are of the positions kept: still at most g + w of them
        assert state.tensors["mask"].shape[1] + state.tensors["sink_mask"].shape[1] <= attn.global_tokens + attn.window


def test_a_step_without_padding_keeps_no_mask():
    attn = build_case("full", {})
    q, k, v = make_qkv(b=2, h=2, n_q=4, d=8, requires_grad=False)
    _, state = attn.step(
        q, k, v, attn.init_state(2, 2, 8, 8, torch.float64), key_padding_mask=torch.ones(2, 4, dtype=torch.bool)
    )
    assert "mask" not in state.tensors
    with pytest.raises(
        TypeError, match=r"step's key_padding_mask must be a bool tensor \(True = real token\), got torch.int64"
    ):
        attn.step(q, k, v, state, key_padding_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"step's key_padding_mask must be \(B, t\) = \(2, 4\) on cpu .* got \(2, 3\)"):
        attn.step(q, k, v, state, key_padding_mask=torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.parametrize(
    "name, options",
    [
        ("linear", {}),
        ("linear", {"feature_map": "cosformer", "max_len": 4096}),
        ("performer", {"features": 16}),
        ("retention", {}),
        ("gated_deltanet", {}),
        ("sliding_window", {"window": 16, "global_tokens": 4}),
        ("window_linear", {"window": 16}),
        ("mamba2", {"feature_map": "hedgehog"}),
    ],
)
def test_a_constant_state_does_not_grow_from_n_to_8n(name, options):
    # the prefix is never re-read: after N and after 8N positions the state has the same size, and a step
    # at 8N returns the forward's output there
    attn = build_case(name, options, dtype=torch.float64)
    q, k, v = make_qkv(b=1, h=2, n_q=8 * 64 + 1, d=8, requires_grad=False, dtype=torch.float64)
    state = attn.init_state(1, 2, 8, 8, torch.float64)
    _, state = attn.step(q[:, :, :64], k[:, :, :64], v[:, :, :64], state)
    at_n = state.nbytes()
    _, state = attn.step(q[:, :, 64:-1], k[:, :, 64:-1], v[:, :, 64:-1], state)
    assert state.nbytes() == at_n and state.length == 8 * 64
    out, state = attn.step(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], state)
    torch.testing.assert_close(out, attn(q, k, v, causal=True)[:, :, -1:])


@pytest.mark.parametrize("name", ["linear", "sliding_window", "memory_compressed", "full"])
def test_a_long_step_is_taken_in_bounded_pieces(name):
    # step splits t new positions into pieces of step_positions (a prompt of N positions never forms N x N)
    attn = build_case(name, variants.variant_class(name).spec.example_options()[0])
    attn.step_positions = 4
    q, k, v = make_qkv(b=1, h=2, n_q=14, d=8, requires_grad=False)
    out, state = attn.step(q, k, v, attn.init_state(1, 2, 8, 8, torch.float64))
    torch.testing.assert_close(out, attn(q, k, v, causal=True))
    assert state.length == 14


def test_a_bounded_kv_cache_is_one_buffer_written_in_place():
    attn = build_case("full", {})
    q, k, v = make_qkv(b=1, h=2, n_q=12, d=8, requires_grad=False)
    state = attn.prefill(q[:, :, :9], k[:, :, :9], v[:, :, :9], attn.init_state(1, 2, 8, 8, torch.float64, max_len=12))
    buffer = state.tensors["k"]
    assert buffer.shape[2] == 12 and state.nbytes() == 2 * 2 * 12 * 8 * 8
    for i in range(9, 12):
        out, state = attn.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], state)
        torch.testing.assert_close(
            out, attn(q[:, :, : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], causal=True)[:, :, -1:]
        )
    assert state.tensors["k"] is buffer and torch.equal(buffer, k)  # no copy: the same buffer, every position written
    with pytest.raises(ValueError, match=r"12 \+ 1 positions pass the state's max_len=12"):
        attn.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], state)


def test_decoding_refuses_what_its_state_cannot_equal():
    with pytest.raises(ValueError, match=r"feature_map='cosformer' decodes only with max_len given"):
        build_case("linear", {"feature_map": "cosformer"}).init_state(1, 2, 8, 8)
    cosformer = build_case("linear", {"feature_map": "cosformer", "max_len": 4})
    state = cosformer.init_state(1, 2, 8, 8)
    x = torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"cannot step to 5 positions: positions up to 5 pass cosformer's max_len=4"):
        cosformer.step(x, x, x, state)
    with pytest.raises(ValueError, match=r"performer: decoding needs eps=0 \(got eps=0.1\)"):
        build_case("performer", {"eps": 0.1}).init_state(1, 2, 8, 8)


def test_methods_that_cannot_decode_say_why():
    for name in ("linformer", "nystrom"):
        attn = build_case(name, variants.variant_class(name).spec.example_options()[0])
        with pytest.raises(
            ValueError, match=rf"{name} cannot decode: {name} does not support causal attention: .*decoding is causal"
        ):
            attn.init_state(1, 2, 8, 8)


@pytest.mark.parametrize("name", DECODABLE)
def test_a_state_for_other_heads_or_head_dim_than_the_variant_was_built_for_is_refused(name):
    # as the forward refuses them, with its message (the gates of mamba2, gla, the delta rules and additive's
    # projections are sized by them: a raw size mismatch before; retention took 3 heads built for 2)
    cls = variants.variant_class(name)
    dtype = torch.float64 if cls.dtype_unsupported_reason("cpu", "float64") is None else torch.float32
    attn = build_case(name, cls.spec.example_options()[0], dtype=dtype)  # built for 2 heads of 8
    with pytest.raises(ValueError, match=rf"{name}: built for num_heads=2, got H=3"):
        attn.init_state(1, 3, 8, 8, dtype)
    with pytest.raises(ValueError, match=rf"{name}: built for head_dim=8, got D=4"):
        attn.init_state(1, 2, 4, 4, dtype)
    q = torch.zeros(1, 3, 1, 8, dtype=dtype)
    with pytest.raises(ValueError, match=rf"{name}: built for num_heads=2, got H=3"):
        attn(q, q, q, causal=True)


def test_step_refuses_what_does_not_fit_its_state():
    attn = build_case("retention", {})
    other = build_case("deltanet", {})
    state = attn.init_state(1, 2, 8, 8, torch.float64)
    x = torch.zeros(1, 2, 1, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="step needs the state init_state returned"):
        attn.step(x, x, x, None)
    with pytest.raises(ValueError, match="this state was made by 'deltanet', not 'retention'"):
        attn.step(x, x, x, other.init_state(1, 2, 8, 8, torch.float64))
    with pytest.raises(ValueError, match=r"step needs t >= 1 new positions, got t = 0"):
        attn.step(x[:, :, :0], x[:, :, :0], x[:, :, :0], state)
    with pytest.raises(
        ValueError, match=r"step's k has shape \(1, 3, 1, 8\); the state is for \(B, H, t, ·\) = \(1, 2, 1, 8\)"
    ):
        attn.step(x, torch.zeros(1, 3, 1, 8, dtype=torch.float64), x, state)
    with pytest.raises(ValueError, match=r"step's q is torch.float32 on cpu; the state holds torch.float64"):
        attn.step(x.float(), x, x, state)
    bounded = attn.init_state(1, 2, 8, 8, torch.float64, max_len=2)
    _, bounded = attn.step(x, x, x, bounded)
    with pytest.raises(ValueError, match=r"1 \+ 2 positions pass the state's max_len=2"):
        attn.step(*(torch.zeros(1, 2, 2, 8, dtype=torch.float64),) * 3, bounded)
    with pytest.raises(ValueError, match=r"option batch=0 is invalid; expected an int >= 1"):
        attn.init_state(0, 2, 8, 8)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CAUSAL_ONLY)
def test_non_causal_calls_are_refused_with_the_reason(name):
    attn = build_case(name, variants.variant_class(name).spec.example_options()[0])
    q, k, v = make_qkv(b=1, h=2, n_q=6, d=8, requires_grad=False)
    with pytest.raises(
        ValueError,
        match=rf"{name}: causal=False is not supported: the method is causal only \(.+\); call it with causal=True",
    ):
        attn(q, k, v)
    with pytest.raises(ValueError, match=rf"{name}: causal=False is not supported"):
        attn(q[:, :, :3], k, v)  # cross-attention is a non-causal call
    assert variants.variant_class(name).mode_unsupported_reason(False).startswith(f"{name} is causal only: ")
    assert variants.variant_class(name).mode_unsupported_reason(True) is None


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("retention", {"chunk_size": 0}, r"option chunk_size=0 is invalid; expected an int >= 1"),
        ("gla", {"chunk_size": 32}, r"option chunk_size=32 is invalid; expected an int in 1..16"),
        ("rwkv7", {"chunk_size": 256}, r"option chunk_size=256 is invalid; expected an int in 1..128"),
        ("rwkv7", {"chunk_size": 0}, r"option chunk_size=0 is invalid; expected an int >= 1"),
        ("mamba2", {"scale": math.inf}, r"option scale=inf is invalid; expected a positive finite number"),
        ("deltanet", {"scale": math.nan}, r"option scale=nan is invalid"),
        ("moba", {"block": 0}, r"option block=0 is invalid; expected an int >= 1"),
        ("moba", {"top_k": 0}, r"option top_k=0 is invalid; expected an int >= 1"),
        ("moba", {"top_k": 2.5}, r"option top_k=2.5 is invalid"),
    ],
)
def test_bad_options_are_named(name, options, message):
    with pytest.raises(ValueError, match=message):
        variants.build(name, num_heads=2, head_dim=8, **options)


@pytest.mark.parametrize("name", ["mamba2", "gla", "deltanet", "gated_deltanet"])
def test_gates_need_the_shape_hints(name):
    with pytest.raises(ValueError, match=rf"{name}: options num_heads and head_dim are required .*got num_heads=None"):
        variants.build(name)


def test_bench_run_skips_non_causal_cells_with_the_reason():
    from harness.sweep.fate import static_skip_reason
    from harness.sweep.config import Cell, RunConfig

    config = RunConfig(variants=("deltanet",), lengths=(64,), devices=("cpu",), passes=("fwd",), causal=(False, True))
    skip = static_skip_reason(config, Cell("cpu", "deltanet", "fwd", False, 64))
    assert skip == "deltanet is causal only: a recurrence over positions: the state at t holds positions <= t only"
    assert static_skip_reason(config, Cell("cpu", "deltanet", "fwd", True, 64)) is None
