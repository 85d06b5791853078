"""The deployment step: `MultiHeadAttention` with each registered variant exports with `torch.export`, runs
under `torch.compile`, and exports to ONNX (onnxruntime's outputs equal to eager), or its spec says why not."""

from __future__ import annotations

import pytest
import torch

import variants
from conftest import shipped

D_MODEL, HEADS, N = 16, 2, 12


def deploy_cases() -> list:
    """One pytest param per shipped variant that runs on the CPU, with the first option set of its spec's examples."""
    return [
        pytest.param(name, variants.variant_class(name).spec.example_options()[0], id=name)
        for name in shipped()
        if variants.variant_class(name).unavailable_reason("cpu") is None
    ]


class Causal(torch.nn.Module):
    """The layer as a model calls it: x (B, N, d_model), causal where the method is."""

    def __init__(self, mha, causal):
        super().__init__()
        self.mha, self.causal = mha, causal

    def forward(self, x, key_padding_mask):
        return self.mha(x, causal=self.causal, key_padding_mask=key_padding_mask)


def layer(name, options):
    torch.manual_seed(0)
    mha = variants.MultiHeadAttention(D_MODEL, HEADS, variant=name, **options).eval()
    x = torch.randn(2, N, D_MODEL)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, -3:] = False  # right padding on one row
    return Causal(mha, mha.attention.spec.supports_causal), (x, mask)


def declared(name, step):
    """The spec's reason the variant cannot take `step` ("export", "compile", "onnx"), or None."""
    return dict(variants.variant_class(name).spec.not_deployable).get(step)


@pytest.mark.parametrize("name, options", deploy_cases())
def test_torch_export_equals_eager(name, options):
    model, args = layer(name, options)
    with torch.no_grad():
        want = model(*args)
        if declared(name, "export"):  # the spec says it cannot: hold it to that
            with pytest.raises(Exception):
                torch.export.export(model, args)
            return
        exported = torch.export.export(model, args)
        torch.testing.assert_close(exported.module()(*args), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, options", deploy_cases())
def test_torch_compile_equals_eager(name, options):
    model, args = layer(name, options)
    with torch.no_grad():
        want = model(*args)
        torch._dynamo.reset()
        if declared(name, "compile"):
            with pytest.raises(Exception):
                torch.compile(model, fullgraph=True)(*args)
            return
        got = torch.compile(model)(*args)  # inductor: what a deployment compiles with
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, options", deploy_cases())
def test_onnx_export_runs_in_onnxruntime(name, options, tmp_path):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model, args = layer(name, options)
    with torch.no_grad():
        want = model(*args)
        if declared(name, "onnx"):
            with pytest.raises(Exception):
                torch.onnx.export(model, args, dynamo=True, verbose=False)
            return
        program = torch.onnx.export(model, args, dynamo=True, verbose=False)
    path = tmp_path / f"{name}.onnx"
    program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    got = torch.from_numpy(session.run(None, inputs)[0])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
