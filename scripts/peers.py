"""Ours against the packages people would install instead, side by side in one process: time and peak memory.

    pip install performer-pytorch linformer nystrom-attention        # the peers (not dependencies of attnbench)
    pip install --no-deps fla-core==0.6.0                            # flash-linear-attention's plain-PyTorch references
    python scripts/peers.py results/peers/cpu-16384.json             # N = 16384, B = 1, H = 8, D = 64; fwd and fwdbwd
    python scripts/peers.py OUT.json --n 4096 --passes fwd --methods retention,deltanet

What each pair compares, and how: the comment above `layer_call`. Run it alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

import variants
from harness.core.calls import make_inputs, set_threads
from harness.core.timing import measure_time, timing_stats
from harness.core.machine import environment
from harness.core.memory import measure_peak, pin_mmap_threshold, steady_allocator

D_MODEL, HEADS, HEAD_DIM = 512, 8, 64
PEER_NAMES = {
    "retention": "fla naive_chunk_simple_gla(g = log γ)",
    "mamba2": "fla naive_chunk_simple_gla(g = log a, v Δ)",
    "gla": "fla naive_recurrent_gla",
    "deltanet": "fla delta_rule_chunkwise(chunk 32)",
    "gated_deltanet": "fla naive_chunk_gated_delta_rule",
}


# Pairs, each at the same shape and settings:
#   performer  the attention alone on (B, H, N, D): `variants.build("performer", features=256)` against
#              performer-pytorch's `FastAttention(dim_heads=64, nb_features=256)` (non-causal, softmax kernel)
#   linformer  the whole layer on x (B, N, 512): `MultiHeadAttention(512, 8, "linformer", rank=256, max_len=N)`
#              against linformer's `LinformerSelfAttention(512, seq_len=N, k=256, heads=8)` (its E, F are shared
#              by the heads; ours are per head)
#   nystrom    the whole layer: `MultiHeadAttention(512, 8, "nystrom", landmarks=64)` against nystrom-attention's
#              `NystromAttention(512, dim_head=64, heads=8, num_landmarks=64, pinv_iterations=6, residual=False)`
#   retention, mamba2, gla, deltanet, gated_deltanet (causal)
#              the attention alone: ours on q, k, v against flash-linear-attention's pure-PyTorch references
#              (fla-core's `naive.py` files, loaded from their paths: the package itself needs Triton) run on the
#              exact inputs of our recurrence (`attn.recurrence_inputs`: gates computed before their timing, in
#              their layout (B, N, H, D) where they take it): naive_chunk_simple_gla (retention, mamba2),
#              naive_recurrent_gla (fla-core 0.6 has no chunked GLA in plain PyTorch), delta_rule_chunkwise
#              (deltanet, its chunk 32), naive_chunk_gated_delta_rule (gated_deltanet). Each row also records
#              the largest difference of the two outputs (an independent check of ours).
# Times: the harness's measuring core (`harness.core.timing.measure_time`); memory: `harness.core.memory.measure_peak`
# after the timing (extra bytes of one call beyond its inputs). fwdbwd: forward, then backward of a fixed
# random output gradient to the inputs and the parameters. A peer that cannot run a configuration gets its
# error recorded instead of figures. Run it alone on a quiet machine.
def layer_call(module, x, backward: bool):
    """One call of a layer on x (B, N, d_model): forward under no_grad, or forward + backward."""
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)) if backward else None

    def call():
        if backward:
            module(x).backward(grad)
            x.grad = None
            for p in module.parameters():
                p.grad = None
        else:
            with torch.no_grad():
                module(x)

    return call


def attention_call(fn, q, k, v, backward: bool):
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)) if backward else None

    def call():
        if backward:
            fn(q, k, v).backward(grad)
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                fn(q, k, v)

    return call


def builders(n: int) -> dict:
    """{method: {"ours"/"peer": (what is called, a function of backward -> the call)}}."""
    torch.manual_seed(0)
    q, k, v = make_inputs(1, HEADS, n, HEAD_DIM, "float32", "cpu", True)
    x = torch.randn(1, n, D_MODEL, requires_grad=True)

    def ours_performer():
        attn = variants.build("performer", features=256, head_dim=HEAD_DIM)
        return lambda backward: attention_call(attn, q, k, v, backward)

    def peer_performer():
        from performer_pytorch import FastAttention

        attn = FastAttention(dim_heads=HEAD_DIM, nb_features=256)
        return lambda backward: attention_call(attn, q, k, v, backward)

    def mha(variant, **options):
        module = variants.MultiHeadAttention(D_MODEL, HEADS, variant=variant, bias=False, **options)
        return lambda backward: layer_call(module, x, backward)

    def peer_linformer():
        from linformer import LinformerSelfAttention

        module = LinformerSelfAttention(D_MODEL, seq_len=n, k=256, heads=HEADS)
        return lambda backward: layer_call(module, x, backward)

    def peer_nystrom():
        from nystrom_attention import NystromAttention

        module = NystromAttention(
            D_MODEL, dim_head=HEAD_DIM, heads=HEADS, num_landmarks=64, pinv_iterations=6, residual=False
        )
        return lambda backward: layer_call(module, x, backward)

    def fla_naive(path: str, function: str):
        """A function of fla-core's plain-PyTorch references, loaded from its file (importing `fla` needs Triton)."""
        import importlib.util

        root = importlib.util.find_spec("fla")
        if root is None:
            raise ModuleNotFoundError("fla-core is not installed: pip install --no-deps fla-core==0.6.0")
        spec = importlib.util.spec_from_file_location(
            f"fla_naive_{function}", Path(root.submodule_search_locations[0]) / path
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, function)

    built = {}

    def module_of(name):
        """One module a method (its gates are random at initialisation): ours, the peer's inputs and the check share it."""
        if name not in built:
            built[name] = variants.build(name, num_heads=HEADS, head_dim=HEAD_DIM)
        return built[name]

    def ours_recurrent(name):
        attn = module_of(name)
        return lambda backward: attention_call(lambda q, k, v: attn(q, k, v, causal=True), q, k, v, backward)

    def peer_recurrent(name):
        """(the peer's call on our recurrence's inputs, its inputs): fla's layout (B, N, H, ·) where it takes it."""
        attn = module_of(name)
        with torch.no_grad():
            x = attn.recurrence_inputs(q, k, v)
        thd = name != "deltanet"
        inputs = [(x[key].transpose(1, 2) if thd else x[key]).contiguous().requires_grad_() for key in ("q", "k", "v")]
        gate = lambda key: x[key].transpose(1, 2).contiguous()
        if name in ("retention", "mamba2"):
            fn = fla_naive("ops/simple_gla/naive.py", "naive_chunk_simple_gla")
            call = lambda qt, kt, vt: fn(qt, kt, vt, gate("log_decay"), scale=x["scale"])[0]
        elif name == "gla":
            fn = fla_naive("ops/gla/naive.py", "naive_recurrent_gla")  # its scale is D^-½, ours too
            call = lambda qt, kt, vt: fn(qt, kt, vt, gate("log_decay"))[0]
        elif name == "deltanet":
            fn = fla_naive("ops/delta_rule/naive.py", "delta_rule_chunkwise")  # (B, H, N, D); its scale is D^-½
            call = lambda qt, kt, vt: fn(qt, kt, vt, x["beta"], chunk_size=32)[0]
        else:
            fn = fla_naive("ops/gated_delta_rule/naive.py", "naive_chunk_gated_delta_rule")
            call = lambda qt, kt, vt: fn(qt, kt, vt, gate("log_decay"), gate("beta"), scale=x["scale"])[0]
        return call, inputs, thd

    def peer_recurrent_call(name):
        call, inputs, _ = peer_recurrent(name)
        return lambda backward: attention_call(call, *inputs, backward)

    def difference(name):
        """max |ours − peer| / max |ours| of the forward on these inputs: an independent check of ours."""
        call, inputs, thd = peer_recurrent(name)
        with torch.no_grad():
            ours = module_of(name)(q, k, v, causal=True)
            peer = call(*inputs)
            peer = peer.transpose(1, 2) if thd else peer
        return ((ours - peer).abs().max() / ours.abs().max()).item()

    recurrent = {
        name: {
            "ours": (f"variants {name} (causal)", lambda name=name: ours_recurrent(name)),
            "peer": (PEER_NAMES[name], lambda name=name: peer_recurrent_call(name)),
            "check": lambda name=name: difference(name),
        }
        for name in PEER_NAMES
    }
    return {
        **recurrent,
        "performer": {
            "ours": ("variants performer, features=256", ours_performer),
            "peer": ("performer_pytorch.FastAttention(dim_heads=64, nb_features=256)", peer_performer),
        },
        "linformer": {
            "ours": (
                "MultiHeadAttention(512, 8, 'linformer', rank=256)",
                lambda: mha("linformer", rank=256, max_len=n),
            ),
            "peer": ("linformer.LinformerSelfAttention(512, seq_len=N, k=256, heads=8)", peer_linformer),
        },
        "nystrom": {
            "ours": ("MultiHeadAttention(512, 8, 'nystrom', landmarks=64)", lambda: mha("nystrom", landmarks=64)),
            "peer": (
                "nystrom_attention.NystromAttention(512, dim_head=64, heads=8, num_landmarks=64, residual=False)",
                peer_nystrom,
            ),
        },
    }


def measure_one(make_call, min_time: float) -> dict:
    call = make_call()
    timing = measure_time(call, torch.device("cpu"), warmup=1, repeats=5, min_time=min_time)
    pin_mmap_threshold()
    peak = measure_peak(call, torch.device("cpu"))["peak_bytes"]
    steady_allocator()
    return {
        "time_median_s": timing_stats(timing.times)["time_median_s"],
        "samples": len(timing.times),
        "peak_bytes": peak,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--passes", default="fwd,fwdbwd")
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument(
        "--methods",
        default="all",
        help="comma-separated: " + ", ".join(["all", *PEER_NAMES, "performer", "linformer", "nystrom"]),
    )
    args = parser.parse_args(argv)
    passes = args.passes.split(",")
    if not set(passes) <= {"fwd", "fwdbwd"}:
        parser.error(f"--passes {args.passes}: each of fwd, fwdbwd")
    set_threads()
    results, started = [], time.time()
    pairs = builders(args.n)
    wanted = list(pairs) if args.methods == "all" else args.methods.split(",")
    if set(wanted) - set(pairs):
        parser.error(f"--methods {args.methods}: unknown {sorted(set(wanted) - set(pairs))}; known: {', '.join(pairs)}")
    for method in wanted:
        pair = pairs[method]
        for pass_ in passes:
            row = {"method": method, "pass": pass_, "n": args.n}
            for who in ("ours", "peer"):  # one after the other in one process, the same inputs
                what, build = pair[who]
                row[f"{who}_what"] = what
                try:
                    factory = build()
                    row[who] = measure_one(lambda: factory(pass_ == "fwdbwd"), args.min_time)
                except Exception as err:  # noqa: BLE001 — a peer that cannot run a configuration: say why
                    row[who] = {
                        "error": f"{type(err).__name__}: {err}"[:300],
                        "trace": traceback.format_exc(limit=2)[-600:],
                    }
            if "check" in pair and pass_ == passes[0]:
                row["output_difference"] = pair["check"]()  # relative to max |ours|
            if "time_median_s" in row["ours"] and "time_median_s" in row["peer"]:
                row["time_ours_over_peer"] = row["ours"]["time_median_s"] / row["peer"]["time_median_s"]
                row["memory_ours_over_peer"] = row["ours"]["peak_bytes"] / max(row["peer"]["peak_bytes"], 1)
            results.append(row)
            ours, peer = row["ours"], row["peer"]
            describe = lambda r: (
                f"{r['time_median_s'] * 1e3:9.1f} ms {r['peak_bytes'] / 2**20:8.1f} MiB"
                if "time_median_s" in r
                else r["error"][:60]
            )
            print(f"{method:10s} {pass_:7s} ours {describe(ours)} | peer {describe(peer)}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python scripts/peers.py " + " ".join(argv),
                "seconds": round(time.time() - started, 1),
                "environment": environment(sys.argv),
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
