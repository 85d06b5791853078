"""The correctness gate every variant passes before it is timed: its output and gradients against the float64
definition, within twice the error of the dense definition in the run's dtype (FlashAttention's criterion)."""

from __future__ import annotations

import math

import torch

from harness.core.calls import make_inputs

# The correctness gate, FlashAttention's criterion: the variant's error against the float64 definition
# may be at most twice the error of the dense definition computed in the run's dtype, plus a small
# allowance (relative to max |reference|) for the rounding a different order of summation brings.
GATE_ALLOWANCE = {"float64": 1e-9, "float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}  # about 16, 1 and 1 ulp at 1.0
# used alone where the dense definition itself overflows in the run's dtype (no bound to double)
FALLBACK_TOLERANCE = {"float64": 1e-6, "float32": 1e-3, "float16": 2e-2, "bfloat16": 8e-2}
CHECK_BATCH = 2  # the gate checks a batch of 2, so broadcasting over the batch is exercised


DECODE_CHECK_STEPS = 3  # positions the gate decodes one at a time (after a prefill of the rest)


def gate_length(attn, default: int, longest: int) -> int:
    """N of the gate: `default`, raised to what the variant needs to exercise its sparse paths
    (`attn.check_length`, e.g. 2w + 3 tiles for a band) but never past `longest` (the longest N measured),
    or lowered to what it takes at most (linformer's max_len)."""
    wanted = attn.check_length(default)
    return wanted if wanted < default else max(default, min(wanted, longest))


def gate(
    attn,
    batch: int,
    heads: int,
    n: int,
    head_dim: int,
    dtype: str,
    device,
    *,
    causal: bool,
    backward: bool,
    decode: bool = False,
    kv_heads: int | None = None,
) -> dict:
    """The variant (in `dtype`, on `device`) against its dense float64 definition, outputs and gradients
    (and, `decode`, the outputs of its last DECODE_CHECK_STEPS positions decoded one step at a time after a prefill).

    Passes when, for the output and each gradient, error(variant) <= 2 * error(dense definition in
    `dtype`) + GATE_ALLOWANCE * max |reference|, and the output is neither non-finite nor all zero.
    Returns {"ok", "max_error", "check_len", "message"}.
    """
    import copy

    dev = torch.device(device)
    _warm_kernels(dtype, dev)
    ref_attn = copy.deepcopy(attn).to(torch.float64)
    q, k, v = make_inputs(batch, heads, n, head_dim, dtype, dev, backward, kv_heads=kv_heads)
    out = attn(q, k, v, causal=causal)
    q64, k64, v64 = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    ref = ref_attn.reference(q64, k64, v64, causal=causal)
    qd, kd, vd = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))
    ref_dtype = attn.reference(qd, kd, vd, causal=causal)  # the same definition, computed in the run's dtype
    pairs = {"output": (out, ref_dtype, ref)}
    if backward:
        grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dev)
        got = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
        low = torch.autograd.grad(ref_dtype, (qd, kd, vd), grad_out.to(out.dtype))
        want = torch.autograd.grad(ref, (q64, k64, v64), grad_out)
        pairs.update({label: triple for label, triple in zip(("dq", "dk", "dv"), zip(got, low, want))})
    if decode:
        with torch.no_grad():
            steps = min(DECODE_CHECK_STEPS, n - 1)
            start = n - steps
            state = attn.prefill(
                *(t.detach()[:, :, :start] for t in (q, k, v)),
                attn.init_state(batch, heads, head_dim, head_dim, q.dtype, dev, kv_heads=kv_heads),
            )
            outs = []
            for i in range(start, n):
                out_i, state = attn.step(*(t.detach()[:, :, i : i + 1] for t in (q, k, v)), state)
                outs.append(out_i)
        pairs["decoded steps"] = (torch.cat(outs, dim=2), ref_dtype[:, :, start:], ref[:, :, start:])
    verdicts = {label: gate_verdict(a, b, c, dtype) for label, (a, b, c) in pairs.items()}
    # how far the method is from the softmax attention it replaces, on these inputs (at its scale, or D^-½)
    scale = attn.scale if attn.scale is not None else head_dim**-0.5
    with torch.no_grad():
        exact = exact_softmax_attention(q64.detach(), k64.detach(), v64.detach(), causal, scale)
    softmax_error = ((out.detach().double() - exact).norm() / exact.norm().clamp_min(1e-12)).item()  # Frobenius
    exact_n = attn.softmax_equivalent_length()
    if exact_n is not None:  # where the definition is plain softmax attention, check against our own as well
        m = min(exact_n, n)
        with torch.no_grad():
            qs, ks, vs = (t.detach()[..., :m, :] for t in (q, k, v))
            got = attn(qs, ks, vs, causal=causal)
            low = exact_softmax_attention(qs, ks, vs, causal, attn._scale(qs))
            want = exact_softmax_attention(qs.double(), ks.double(), vs.double(), causal, attn._scale(qs))
        verdicts[f"exact softmax at N={m}"] = gate_verdict(got, low, want, dtype)
    ok = all(v["ok"] for v in verdicts.values())
    worst = max(verdicts.values(), key=lambda v: v["error"] / v["bound"] if v["bound"] else math.inf)
    detail = "; ".join(f"{label} {v['describe']}" for label, v in verdicts.items())
    return {
        "ok": ok,
        "max_error": worst["error"],
        "check_len": n,
        "softmax_error": softmax_error,
        "message": f"relative error vs dense float64 at B={batch}, N={n}: {detail}",
    }


def _warm_kernels(dtype: str, device) -> None:
    """One small masked attention through torch's kernels before the checked call. On a 2-core AMX Xeon with
    torch 2.13, the first masked float32 attention of a process came out 6e-5 (relative) off in 8 of 16 fresh
    processes and exact on every later call; after this call, the gate passed in 24 of 24. Torch's first call, not
    the variant's: the variant is not called here."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 8, generator=g).to(device=device, dtype=getattr(torch, dtype)) for _ in "qkv")
    i = torch.arange(16, device=device)
    scores = torch.matmul(q, k.transpose(-1, -2)).masked_fill((i[:, None] - i[None, :]).abs() > 4, float("-inf"))
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    torch.matmul(p / p.sum(dim=-1, keepdim=True), v)


def exact_softmax_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v written here, independently of every variant's code (k, v of fewer heads than q
    serve groups of query heads)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (
        torch.matmul(q, k.transpose(-1, -2)).float() * scale
        if q.dtype in (torch.float16, torch.bfloat16)
        else torch.matmul(q, k.transpose(-1, -2)) * scale
    )
    if causal:
        n_q, n_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def gate_verdict(got: torch.Tensor, low: torch.Tensor, want: torch.Tensor, dtype: str) -> dict:
    """One tensor's verdict: relative errors of the variant (got) and of the dense definition in the run's
    dtype (low) against float64 (want), the bound, and whether the output is degenerate."""
    got, low, want = got.detach().double(), low.detach().double(), want.detach().double()
    error = _relative_error(got, want)
    low_error = _relative_error(low, want)
    if math.isfinite(low_error):
        bound = 2 * low_error + GATE_ALLOWANCE[dtype]
        how = f"allowed {bound:.1e} = 2 x {low_error:.1e} (dense {dtype}) + {GATE_ALLOWANCE[dtype]:g}"
    else:  # the dense definition overflows in this dtype: no bound to double, use the fixed tolerance
        bound = FALLBACK_TOLERANCE[dtype]
        how = f"allowed {bound:g}: the dense {dtype} definition overflows"
    degenerate = ""  # the gate's inputs are finite random numbers: no attention gives NaN or all zeros on them
    if not torch.isfinite(got).all():
        degenerate = "non-finite values"
    elif not got.abs().max().item():
        degenerate = "all zeros"
    ok = not degenerate and error <= bound
    describe = f"degenerate ({degenerate})" if degenerate else f"{error:.1e} ({how})"
    return {"ok": ok, "error": error, "bound": bound, "describe": describe + ("" if ok else " FAILED")}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
