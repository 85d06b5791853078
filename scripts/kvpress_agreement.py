"""Do attnbench's KV-cache policies keep the positions kvpress's presses keep? (issue 64)

    python scripts/kvpress_agreement.py --kvpress-python /work/kvenv/bin/python

One passkey prompt (SmolLM2-135M, --length tokens, the key at 50%) goes through kvpress's presses in their own
environment (kvpress pins transformers < 5.3: make it with `python -m venv --system-site-packages ENV &&
ENV/bin/pip install kvpress "transformers<5.3"`), which records each layer's scores and budget; the same
prompt goes through variants.kvcache here. Printed: per policy, the share of (layer, K/V head) whose kept
sets are identical, and the mean overlap of the kept sets. Exit 1 where a share is below --goal.
"""

from __future__ import annotations

import argparse
import sys

from kvpress_side import run_side

PRESSES = {  # our policy: kvpress's press
    "snapkv": "SnapKVPress",
    "streaming_llm": "StreamingLLMPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "expected_attention": "ExpectedAttentionPress",
    "pyramidkv": "PyramidKVPress",
}

KVPRESS_SIDE = r"""
import json, sys, torch, transformers, kvpress
from kvpress.presses.pyramidkv_press import PyramidKVPress
folder, gguf, ids_file, ratio, out_file = sys.argv[1:6]
ids = torch.tensor(json.load(open(ids_file)))[None]
model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
kept = {}
for name in sys.argv[6:]:
    press = getattr(kvpress, name)(compression_ratio=float(ratio))
    layers = {}
    score = press.score
    def recording(module, hidden_states, keys, values, attentions, kwargs, score=score, layers=layers, press=press):
        s = score(module, hidden_states, keys, values, attentions, kwargs)
        n = press.get_layer_budget(module, keys.shape[2]) if isinstance(press, PyramidKVPress) else \
            kvpress.utils.compute_n_kept(keys.shape[2], press.compression_ratio)
        layers[module.layer_idx] = s.topk(n, dim=-1).indices.sort(-1).values[0].tolist()
        return s
    press.score = recording
    with press(model), torch.no_grad():
        model(ids, past_key_values=transformers.DynamicCache(), use_cache=True)
    kept[name] = [layers[i] for i in sorted(layers)]
json.dump({"transformers": transformers.__version__, "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "?", "kept": kept}, open(out_file, "w"))
"""


def ours(ids, ratio: float) -> dict:
    import torch

    import variants.hf.kvcache as hk
    from harness.lm.model import load, locate
    from variants import kvcache

    model, _ = load(*locate(None))
    _, _, prompts = hk.prefill(model, torch.tensor(ids)[None])
    out = {}
    for name in PRESSES:
        policy = kvcache.build(name)
        out[name] = [policy.keep(p, ratio)[0].tolist() for p in prompts]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvpress-python", required=True, help="the python of an environment with kvpress")
    parser.add_argument("--length", type=int, default=1024, help="the prompt's tokens")
    parser.add_argument("--ratio", type=float, default=0.5, help="the compression ratio")
    parser.add_argument("--goal", type=float, default=0.99, help="the share of (layer, head) that must agree")
    args = parser.parse_args()
    from harness.lm.model import load, locate
    from harness.lm.tasks import passkey_prompt

    folder, gguf = locate(None)
    _, tokenizer = load(folder, gguf)
    ids = passkey_prompt(tokenizer, args.length, 50, "863891").tolist()
    theirs = run_side(
        args.kvpress_python,
        KVPRESS_SIDE,
        {"ids": ids},
        [str(folder), gguf, "{ids}", str(args.ratio), "{out}", *PRESSES.values()],
    )
    if theirs is None:
        return 2
    mine = ours(ids, args.ratio)
    print(f"kvpress with transformers {theirs['transformers']}; SmolLM2-135M, {args.length} tokens, ratio {args.ratio}")
    print(f"{'policy':<20}{'same kept set':>16}{'mean overlap':>15}")
    failed = False
    for name, press in PRESSES.items():
        pairs = [
            (set(a), set(b))
            for layer_a, layer_b in zip(mine[name], theirs["kept"][press])
            for a, b in zip(layer_a, layer_b)
        ]
        same = sum(a == b for a, b in pairs) / len(pairs)
        overlap = sum(len(a & b) / max(len(b), 1) for a, b in pairs) / len(pairs)
        print(f"{name:<20}{same:>15.1%} {overlap:>14.2%}   ({len(pairs)} layer-heads)")
        failed |= same < args.goal
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
