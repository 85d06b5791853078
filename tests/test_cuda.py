"""CUDA paths: every variant on the GPU against its dense definition, and a tiny CUDA sweep.

Skipped where no CUDA device is present (the project's CI machines have none).
"""

from __future__ import annotations

import pytest
import torch

import variants
from conftest import shipped
from helpers import bench

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_cases() -> dict[str, dict]:
    """Every registered variant that runs on CUDA, with the last (richest) example of its spec and the
    shape hints of these tests' inputs (H = 2, D = 64)."""
    found = {}
    for name in shipped():
        spec = variants.variant_class(name).spec
        if "cuda" in spec.devices:
            found[name] = {"num_heads": 2, "head_dim": 64, **spec.example_options()[-1]}
    return found


OPTIONS = cuda_cases()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_variant_on_cuda_matches_definition(name, causal, dtype):
    reason = variants.variant_class(name).unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    attn = variants.build(name, device="cuda", **OPTIONS[name]).to(dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 300, 64, generator=g).to("cuda", dtype).requires_grad_() for _ in range(3))
    kpm = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    kpm[1, 250:] = False
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    ref_attn = variants.build(name, device="cuda", **OPTIONS[name]).double()
    ref_attn.load_state_dict(attn.state_dict())
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = ref_attn.reference(q64, k64, v64, causal=causal, key_padding_mask=kpm)
    tol = 2e-3 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=tol * 5, rtol=tol * 5)


@pytest.mark.parametrize("n_q", [1, 3, 100])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_variant_on_cuda_bottom_right_causal(name, n_q):
    # causal with Nq < Nk: the queries are the last Nq of 300 positions (decoding with a KV cache)
    reason = variants.variant_class(name).unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    attn = variants.build(name, device="cuda", **OPTIONS[name])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, n_q, 64, generator=g).to("cuda")
    k, v = (torch.randn(2, 2, 300, 64, generator=g).to("cuda") for _ in range(2))
    kpm = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    kpm[1, :40] = False  # left padding
    with torch.no_grad():
        out = attn(q, k, v, causal=True, key_padding_mask=kpm)
        ref_attn = variants.build(name, device="cuda", **OPTIONS[name]).double()
        ref_attn.load_state_dict(attn.state_dict())
        ref = ref_attn.reference(q.double(), k.double(), v.double(), causal=True, key_padding_mask=kpm)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def _bench(*args):
    return bench("run", "--devices", "cuda", *args)


def test_cuda_sweep_runs_and_records_gpu(tmp_path):
    import pandas as pd

    out = tmp_path / "cuda"
    names = ["full", "sliding_window", "sliding_window_flex", "linear", "memory_compressed"]
    if variants.variant_class("full_xformers").unavailable_reason("cuda") is None:
        names.append("full_xformers")
    result = _bench(
        "--variants",
        ",".join(names),
        "--lengths",
        "256,1024",
        "--dtype",
        "bfloat16",
        "--out",
        str(out),
        "--check-len",
        "128",
        "--repeats",
        "3",
        "--causal",
        "both",
    )
    assert result.exit_code == 0, result.output
    rows = pd.read_json(out / "results.jsonl", lines=True)
    assert set(rows["status"]) == {"ok"}, rows[rows["status"] != "ok"][["variant", "pass", "message"]].to_string()
    assert rows["reserved_bytes"].notna().all() and set(rows["memory_kind"]) == {"allocator"}
    small = rows[(rows["n"] == 256) & (rows["variant"] == "full") & (rows["pass"] == "fwd")]
    assert (small["calls_per_sample"] > 1).all()  # microsecond kernels: several calls per event pair
    assert rows[rows["variant"] == "full"]["kernel"].notna().all()
    if "full_xformers" in names:
        assert rows[rows["variant"] == "full_xformers"]["kernel"].notna().all()
    from harness.store.storage import read_metadata

    machine = read_metadata(out)["machine"]
    gpu = machine["gpu"]
    assert gpu["name"] and gpu["sm_count"] > 0 and "error" not in gpu["nvidia_smi"], gpu
    assert "TF32" in machine["matmul_peak_precision"]["cuda/float32"]


def test_cuda_oom_is_recorded_as_oom(tmp_path):
    import pandas as pd

    out = tmp_path / "oom"
    result = _bench(
        "--import",
        "fault_variants",
        "--variants",
        "test_hog,full",
        "--lengths",
        "32,65536",
        "--passes",
        "fwd",
        "--memory-budget",
        "256MiB",
        "--out",
        str(out),
        "--check-len",
        "32",
        "--repeats",
        "2",
    )
    assert result.exit_code == 0, result.output
    rows = pd.read_json(out / "results.jsonl", lines=True).set_index(["variant", "n"])
    assert rows.loc[("test_hog", 32), "status"] == "ok"
    assert rows.loc[("test_hog", 65536), "status"] == "oom", rows.loc[("test_hog", 65536), "message"]  # 4 GiB > 256 MiB


def test_flex_on_cuda_uses_its_own_compiled_kernel():
    from variants.methods.sliding_window_flex import compiled_flex_attention

    assert compiled_flex_attention("cuda") is not compiled_flex_attention("cpu")
    attn = variants.build("sliding_window_flex", device="cuda", window=300, global_tokens=130)
    q, k, v = (torch.randn(1, 2, 1000, 8, device="cuda", requires_grad=True) for _ in range(3))  # D=8: padded to 16
    out = attn(q, k, v, causal=True)
    ref = attn.reference(*(t.detach().double() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
