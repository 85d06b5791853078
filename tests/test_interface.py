"""The one interface: registry, build, input validation, all-masked rows, shapes and dtypes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import variants
from conftest import (
    build_case,
    independent_reference,
    make_padding,
    make_qkv,
    natural_causal,
    registry_cases,
    shipped,
    skip_unless_causal,
)

# every registered variant that runs on the CPU with a backward, once per option set of its spec's examples
CASES = registry_cases()
CASE_NAMES = {case.values[0] for case in CASES}

# registered CPU variants without a CPU backward are left out of the shared tests above (they cannot
# train there); each is named here with where it is tested instead
NOT_IN_SHARED_TESTS = {
    "sliding_window_flex": "compiled per shape (seconds each) and forward-only on CPU; tests/test_sliding_window.py "
    "checks it against the same dense references"
}


def test_every_cpu_variant_is_in_the_shared_tests():
    # the contract guard: a variant registered from a file in variants/methods/ is in CASES by its spec;
    # one that runs on the CPU but cannot be in them must say where it is tested instead
    on_cpu = [name for name in shipped() if variants.variant_class(name).unavailable_reason("cpu") is None]
    missing = sorted(set(on_cpu) - CASE_NAMES - set(NOT_IN_SHARED_TESTS))
    assert not missing, (
        f"registered CPU variants without a CPU backward, so not in the shared tests: {missing}; name each in "
        "NOT_IN_SHARED_TESTS in tests/test_interface.py with the test file that checks it instead"
    )
    assert not set(NOT_IN_SHARED_TESTS) & CASE_NAMES


def test_every_option_is_documented():
    # bench list shows these: every option of every shipped variant has an `Args:` line
    for name in variants.available():
        if variants.variant_class(name).__module__.startswith("variants."):
            undocumented = [option for option, doc in variants.option_docs(name).items() if not doc]
            assert not undocumented, f"{name}: options without an Args: entry in an __init__ docstring: {undocumented}"


@pytest.mark.parametrize("name", shipped())
def test_spec_facts_name_real_variants_and_options(name):
    # what the harness reads instead of tables keyed by names must point at things that exist
    spec = variants.variant_class(name).spec
    taken = set(variants.option_names(name))
    assert spec.same_function_as is None or (
        spec.same_function_as in variants.available() and spec.same_function_as != name
    )
    assert spec.reach_option is None or spec.reach_option in spec.function_options
    assert set(spec.function_options) <= taken, (
        f"{name}: function_options not taken: {set(spec.function_options) - taken}"
    )
    assert spec.examples, f"{name}: examples must hold at least one option set (() for the defaults)"
    assert all(step in ("export", "compile", "onnx") and why for step, why in spec.not_deployable)
    assert spec.max_len_option is None or spec.max_len_option in taken
    assert spec.supports_causal or spec.why_not_causal, f"{name}: a method that is not causal says why (why_not_causal)"
    assert spec.style is None or (len(spec.style) == 2 and spec.style[0].startswith("#"))
    for options in spec.example_options():
        assert set(options) <= taken, f"{name}: example options not taken: {set(options) - taken}"
        if variants.variant_class(name).unavailable_reason("cpu") is None:
            build_case(name, options)


def test_every_shipped_variant_has_a_style_of_its_own():
    styles = {name: variants.variant_class(name).spec.style for name in shipped()}
    assert None not in styles.values(), [name for name, style in styles.items() if style is None]
    assert len(set(styles.values())) == len(styles), "two variants share a colour and marker in the figures"


@pytest.mark.parametrize("name", [n for n in shipped() if variants.variant_class(n).spec.same_function_as])
def test_same_function_as_is_true(name):
    # a variant that says another computes its function gets that one's accuracy in bench advise: check it
    target = variants.variant_class(name).spec.same_function_as
    for who in (name, target):
        reason = variants.variant_class(who).unavailable_reason("cpu")
        if reason:
            pytest.skip(reason)
    q, k, v = make_qkv(n_q=13, dtype=torch.float32, requires_grad=False)
    kpm = make_padding(2, 13, all_padded_row=False)
    for options in variants.variant_class(name).spec.example_options():
        shared = variants.options_taken(target, options)
        attn = build_case(name, options, dtype=torch.float32)
        same = build_case(target, {**shared, "scale": attn._scale(q)}, dtype=torch.float32)  # the scale it applies, too
        with torch.no_grad():
            for causal in (False, True):
                got = attn(q, k, v, causal=causal, key_padding_mask=kpm)
                torch.testing.assert_close(
                    got, same(q, k, v, causal=causal, key_padding_mask=kpm), atol=2e-5, rtol=2e-5
                )


def build_cpu(name, options, **extra):
    """The case's variant in float64, built for inputs of H = 2, D = 8 unless `extra` says otherwise."""
    return build_case(name, {**options, **extra})


def test_available_lists_every_variant_sorted():
    names = variants.available()
    assert names == sorted(names)
    assert {
        "full",
        "full_naive",
        "full_xformers",
        "sliding_window",
        "sliding_window_flex",
        "linear",
        "memory_compressed",
    } <= set(names)


def test_importing_variants_does_not_import_xformers():
    code = "import sys, variants; variants.available(); print('xformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert "xformers" not in out.stderr.lower()


def test_build_unknown_variant_lists_available():
    with pytest.raises(ValueError, match=r"unknown variant 'nope'; available: .*full.*sliding_window"):
        variants.build("nope")


@pytest.mark.parametrize(
    "name, options, pattern",
    [
        ("sliding_window", {"window": 0}, r"window=0 is invalid; expected an int >= 1"),
        ("sliding_window", {"global_tokens": -1}, r"global_tokens=-1 is invalid"),
        (
            "linear",
            {"feature_map": "softmax"},
            r"feature_map='softmax' is invalid; allowed: 'elu', 'relu', 'taylor', 'cosformer'",
        ),
        ("linear", {"chunk_size": 0}, r"chunk_size=0 is invalid"),
        ("memory_compressed", {"compression": 0, "num_heads": 2, "head_dim": 8}, r"compression=0 is invalid"),
        ("memory_compressed", {}, r"num_heads and head_dim are required"),
        ("full", {"scale": -1.0}, r"scale=-1.0 is invalid"),
    ],
    ids=["window0", "global-neg", "feature-map", "chunk0", "compression0", "mc-no-shape", "scale-neg"],
)
def test_build_invalid_option_value(name, options, pattern):
    with pytest.raises(ValueError, match=pattern):
        variants.build(name, **options)


def test_build_unknown_option_names_allowed_ones():
    with pytest.raises(
        TypeError, match=r"invalid options \['backend'\].*allowed options: window, global_tokens, block_size, scale"
    ):
        variants.build("sliding_window", backend="cuda-magic")


def test_xformers_unavailable_on_cpu_says_why():
    with pytest.raises(RuntimeError, match=r"'full_xformers' is unavailable: full_xformers runs on cuda, not cpu"):
        variants.build("full_xformers", device="cpu")
    if not torch.cuda.is_available():  # without a device: unavailable on every device it runs on
        with pytest.raises(RuntimeError, match=r"'full_xformers' is unavailable: no CUDA device is available"):
            variants.build("full_xformers")
    assert "runs on cuda" in variants.variant_class("full_xformers").unavailable_reason("cpu")


def test_spec_is_frozen_and_complete():
    for name in variants.available():
        spec = variants.variant_class(name).spec
        assert spec.name == name and spec.summary and spec.reference
        assert spec.time_complexity and spec.memory_complexity
        with pytest.raises(AttributeError):
            spec.name = "x"


# -- input validation ---------------------------------------------------------------------------


def _qkv(**kw):
    return make_qkv(b=2, h=2, n_q=6, d=8, requires_grad=False, **kw)


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda q, k, v: (q[0], k, v), r"q must have 4 dims \(B, H, N, D\), got shape \(2, 6, 8\)"),
        (lambda q, k, v: (q, k[:1], v[:1]), r"q, k, v must share the batch dim, and k, v their heads"),
        (
            lambda q, k, v: (q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)),
            r"q has H=2 heads, k and v Hkv=3: grouped-query attention needs H a multiple of Hkv",
        ),
        (lambda q, k, v: (q, k[..., :7], v), r"q and k must share the head dim D, got q D=8, k D=7"),
        (lambda q, k, v: (q, k, v[:, :, :5]), r"k and v must share the key length Nk, got k Nk=6, v Nk=5"),
        (lambda q, k, v: (q.long(), k, v), r"q must be a floating-point tensor, got dtype torch.int64"),
        (lambda q, k, v: (q, k.float(), v), r"q, k, v must share one dtype"),
        (lambda q, k, v: (q.tolist(), k, v), r"q must be a torch.Tensor"),
    ],
    ids=["rank", "batch-heads", "kv-heads", "head-dim", "key-length", "int-dtype", "mixed-dtype", "not-tensor"],
)
@pytest.mark.parametrize("name, options", CASES)
def test_bad_tensors_raise_clear_errors(name, options, make, pattern):
    attn = build_cpu(name, options)
    with pytest.raises((ValueError, TypeError), match=pattern):
        attn(*make(*_qkv()))


@pytest.mark.parametrize("name, options", CASES)
def test_bad_mask_raises_clear_errors(name, options):
    attn = build_cpu(name, options)
    q, k, v = _qkv()
    causal = natural_causal(name)
    with pytest.raises(
        TypeError, match=r"key_padding_mask must be a bool tensor \(True = real token\), got torch.float32"
    ):
        attn(q, k, v, causal=causal, key_padding_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, Nk\) = \(2, 6\), got \(2, 5\)"):
        attn(q, k, v, causal=causal, key_padding_mask=torch.ones(2, 5, dtype=torch.bool))


def test_cross_attention_rejected_where_unsupported():
    q, _, _ = _qkv()
    _, k, v = make_qkv(b=2, h=2, n_q=9, d=8, requires_grad=False)
    with pytest.raises(
        ValueError, match=r"sliding_window: cross-attention \(Nq=6 != Nk=9, causal=False\) is not supported"
    ):
        build_cpu("sliding_window", {})(q, k, v)


def test_causal_with_more_queries_than_keys_rejected():
    _, k, v = _qkv()
    q, _, _ = make_qkv(b=2, h=2, n_q=9, d=8, requires_grad=False)
    with pytest.raises(
        ValueError,
        match=r"causal=True needs Nq <= Nk \(the queries are the last Nq of the Nk positions\), got Nq=9, Nk=6",
    ):
        build_cpu("full", {})(q, k, v, causal=True)


def test_shape_hints_are_checked():
    attn = variants.build("full", num_heads=3)
    with pytest.raises(ValueError, match=r"built for num_heads=3, got H=2"):
        attn(*_qkv())


# -- behaviour every variant shares ---------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("name, options", CASES)
def test_all_masked_rows_give_zeros_not_nan(name, options, causal):
    skip_unless_causal(name, causal)
    attn = build_cpu(name, options)
    q, k, v = make_qkv(b=3, h=2, n_q=10, d=8)
    kpm = torch.ones(3, 10, dtype=torch.bool)
    kpm[1] = False  # a batch element with no real key at all
    kpm[2, :4] = False  # causal: its first 4 queries see no real key
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all()
    if causal:
        assert (out[2, :, :4] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("name", shipped())
def test_a_nan_query_or_key_reaches_its_row_at_every_short_length_and_step(name):
    # NaN propagates at N = 1 ... 32 and in the first decoding steps, never hidden as zeros: torch's CPU flash
    # kernel returns zeros for a row of NaN scores over fewer than 16 keys (full, bilinear, moba, memory_compressed
    # and linformer took it). The poisoned position's own row sees it in every pattern; the other head does not.
    cls = variants.variant_class(name)
    if cls.unavailable_reason("cpu"):
        pytest.skip(cls.unavailable_reason("cpu"))
    attn = build_case(name, cls.spec.example_options()[0], dtype=torch.float32)
    causal = natural_causal(name)
    for n in range(1, 33):
        for where in "qk":
            q, k, v = make_qkv(b=1, h=2, n_q=n, d=8, requires_grad=False, dtype=torch.float32, seed=n)
            {"q": q, "k": k}[where][0, 0, n - 1] = float("nan")
            with torch.no_grad():
                out = attn(q, k, v, causal=causal)
            assert out[0, 0, n - 1].isnan().any(), (
                f"N={n}, NaN in {where}: its row came out {out[0, 0, n - 1].tolist()}"
            )
            if not getattr(attn, "mixes_kv_heads", False):  # (mla: every head reads every K/V head's latent)
                assert torch.isfinite(out[0, 1]).all()
    if cls.decode_unsupported_reason():
        return
    q, k, v = make_qkv(b=1, h=2, n_q=20, d=8, requires_grad=False, dtype=torch.float32)
    for t in range(20):
        for where in "qk":
            state = attn.init_state(1, 2, 8, 8, torch.float32)
            if t:
                state = attn.prefill(q[:, :, :t], k[:, :, :t], v[:, :, :t], state)
            new = [x[:, :, t : t + 1].clone() for x in (q, k, v)]
            new["qk".index(where)][0, 0] = float("nan")
            out, _ = attn.step(*new, state)
            assert out[0, 0, 0].isnan().any(), (
                f"step {t + 1}, NaN in {where}: its output came out {out[0, 0, 0].tolist()}"
            )


@pytest.mark.parametrize("name, options", CASES)
def test_length_one_and_odd_lengths(name, options):
    attn = build_cpu(name, options)
    causal = attn.spec.supports_causal
    for n in (1, 7):
        q, k, v = make_qkv(b=1, h=2, n_q=n, d=8, requires_grad=False)
        if attn.length_unsupported_reason(n, n):  # e.g. more landmarks than positions: a clear error
            with pytest.raises(ValueError, match=rf"{name}: Nq={n}, Nk={n} is not supported: "):
                attn(q, k, v, causal=causal)
            continue
        out = attn(q, k, v, causal=causal)
        assert out.shape == (1, 2, n, 8)
        torch.testing.assert_close(out, attn.reference(q, k, v, causal=causal))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name, options", CASES)
def test_lower_precision_close_to_float64(name, options, dtype):
    attn = build_case(name, options, dtype=dtype)
    q, k, v = make_qkv(b=1, h=2, n_q=33, d=8, dtype=dtype, requires_grad=False)
    kpm = make_padding(1, 33, all_padded_row=False)
    causal = attn.spec.supports_causal
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    assert out.dtype == dtype
    ref = attn.double().reference(q.double(), k.double(), v.double(), causal=causal, key_padding_mask=kpm)
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name, options", CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_reference_method_matches_independent_reference(name, options, causal):
    # the variants' own dense references (the harness's gate uses them) agree with the tests' independent ones
    skip_unless_causal(name, causal)
    attn = build_cpu(name, options)
    q, k, v = make_qkv(requires_grad=False)
    kpm = make_padding(2, 16)
    torch.testing.assert_close(
        attn.reference(q, k, v, causal=causal, key_padding_mask=kpm),
        independent_reference(name, attn, q, k, v, causal=causal, kpm=kpm),
    )


@pytest.mark.parametrize("name, options", CASES)
def test_gradcheck_float64(name, options):
    d = 4 if options.get("feature_inputs") == "pre_rope" or options.get("rope_dim") else 3  # (RoPE turns pairs)
    attn = build_cpu(name, options, num_heads=1, head_dim=d)
    q, k, v = make_qkv(b=1, h=1, n_q=5, d=d)
    kpm = torch.tensor([[True, False, True, True, True]])
    causal = attn.spec.supports_causal
    assert torch.autograd.gradcheck(lambda q, k, v: attn(q, k, v, causal=causal, key_padding_mask=kpm), (q, k, v))
    if attn.spec.supports_non_causal:
        assert torch.autograd.gradcheck(lambda q, k, v: attn(q, k, v), (q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("name, options", CASES)
def test_scale_is_honoured(name, options, causal):
    # a model's layer may scale scores by other than D ** -0.5 (transformers passes its `scaling`): scale s
    # on q must equal the default on q rescaled by s over what scale=None stands for (`default_scale`:
    # D ** -0.5 for the softmax variants, 1 for the feature-map ones, which apply no scale by default) —
    # and equal the variant's own definition
    skip_unless_causal(name, causal)
    s = 0.37
    attn = build_cpu(name, options, scale=s)
    plain = build_cpu(name, options)
    plain.load_state_dict(attn.state_dict())
    q, k, v = make_qkv(b=2, h=2, n_q=10, d=8, requires_grad=False)
    kpm = make_padding(2, 10, seed=2, all_padded_row=False)
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    if not getattr(attn, "query_scaled", True):  # a learned map reading q unscaled (LoLCATs'): only a softmax part
        torch.testing.assert_close(out, attn.reference(q, k, v, causal=causal, key_padding_mask=kpm))
        unscaled = plain(q, k, v, causal=causal, key_padding_mask=kpm)  # (window_linear's window) or an output
        if name == "window_linear" or not attn.spec.scale_is_query_factor:  # factor (the delta rules) reads it
            assert not torch.allclose(out, unscaled)
        else:
            torch.testing.assert_close(out, unscaled)  # nothing reads it
        return
    if attn.spec.scale_is_query_factor:
        torch.testing.assert_close(
            out, plain(q * (s / plain.default_scale(q.shape[-1])), k, v, causal=causal, key_padding_mask=kpm)
        )
    torch.testing.assert_close(out, attn.reference(q, k, v, causal=causal, key_padding_mask=kpm))
    unscaled = plain(q, k, v, causal=causal, key_padding_mask=kpm)
    if (
        torch.allclose(plain(q * 3, k, v, causal=causal, key_padding_mask=kpm), unscaled)
        and attn.spec.scale_is_query_factor
    ):
        return  # the function ignores a scale of q (relu features are homogeneous: it cancels in the ratio)
    assert not torch.allclose(out, unscaled)
