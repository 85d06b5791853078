"""CUDA paths: every variant on the GPU against its dense definition, and a tiny CUDA sweep.

Skipped where no CUDA device is present (the project's CI machines have none).
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import variants
from harness.cli import app

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

OPTIONS = {
    "full": {}, "full_naive": {}, "full_xformers": {}, "sliding_window": {"window": 16, "global_tokens": 2},
    "sliding_window_flex": {"window": 16, "global_tokens": 2}, "linear": {},
    "memory_compressed": {"compression": 3, "num_heads": 2, "head_dim": 64},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
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


def test_cuda_sweep_runs_and_records_gpu(tmp_path):
    out = tmp_path / "cuda"
    result = CliRunner().invoke(app, ["run", "--devices", "cuda", "--variants", "full,sliding_window,linear", "--lengths", "256,1024",
                                      "--dtype", "bfloat16", "--out", str(out), "--check-len", "128", "--repeats", "3"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    import pandas as pd

    rows = pd.read_json(out / "results.jsonl", lines=True)
    assert set(rows["status"]) == {"ok"}
    assert rows["reserved_bytes"].notna().all()
    from harness.storage import read_metadata

    assert read_metadata(out)["machine"]["gpu"]["name"]
