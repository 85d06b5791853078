"""The calls a cell times: inputs of a shape and dtype, a forward (and backward) pass, a decoding step from
the state after N positions; and the CPU threads they run on."""

from __future__ import annotations

import os

import torch


def set_threads(threads: int = 0) -> int:
    """Pin torch's CPU threads: `threads`, or (0) every core this process may run on (its affinity
    mask, not os.cpu_count(): a container or `taskset` may allow fewer). Returns the count."""
    count = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(count)
    return count


def make_inputs(
    batch: int,
    heads: int,
    n: int,
    head_dim: int,
    dtype: str,
    device,
    requires_grad: bool,
    seed: int | None = None,
    kv_heads: int | None = None,
):
    """q of shape (batch, heads, n, head_dim), k and v of (batch, kv_heads or heads, n, head_dim) (grouped-query):
    standard normal, drawn on the CPU from a generator seeded by `seed` (default: n), so every device and process
    gets the same numbers."""
    g = torch.Generator(device="cpu").manual_seed(n if seed is None else seed)
    shapes = [(batch, h, n, head_dim) for h in (heads, kv_heads or heads, kv_heads or heads)]
    return tuple(
        torch.randn(shape, generator=g).to(device=device, dtype=getattr(torch, dtype)).requires_grad_(requires_grad)
        for shape in shapes
    )


def pass_call(attn, q, k, v, *, causal: bool, backward: bool, sync: bool = False):
    """The call a pass times: the forward under no_grad ("fwd"), or forward + backward of a fixed random
    output gradient ("fwdbwd"; input gradients cleared after each call). `sync`: wait for the device
    at the end of each call (for a host clock on CUDA)."""
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device) if backward else None
    cuda = q.device.type == "cuda"

    def call():
        if backward:
            attn(q, k, v, causal=causal).backward(grad_out)
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                attn(q, k, v, causal=causal)
        if sync and cuda:
            torch.cuda.synchronize(q.device)

    return call


def decode_call(
    attn,
    batch: int,
    heads: int,
    n: int,
    head_dim: int,
    dtype: str,
    device,
    sync: bool = False,
    kv_heads: int | None = None,
):
    """(the call a decode cell times: one step of one new position after N, the state after N) — the state
    built by the variant's own prefill of N positions, not timed; every call steps from that same state."""
    q, k, v = make_inputs(batch, heads, n + 1, head_dim, dtype, device, False, kv_heads=kv_heads)
    with torch.no_grad():
        # max_len: a KV cache is one buffer of N + 1 positions the step writes into (no copy of the cache per step)
        empty = attn.init_state(batch, heads, head_dim, head_dim, q.dtype, device, max_len=n + 1, kv_heads=kv_heads)
        state = attn.prefill(q[:, :, :n], k[:, :, :n], v[:, :, :n], empty)
    new = tuple(t[:, :, n:].contiguous() for t in (q, k, v))
    del q, k, v
    cuda = torch.device(device).type == "cuda"

    def call():
        with torch.no_grad():
            attn.step(*new, state)
        if sync and cuda:
            torch.cuda.synchronize(device)

    return call, state
