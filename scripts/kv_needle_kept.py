"""Which policies keep the passkey's digits? On one SmolLM2 passkey prompt (the key at 50%), the share of
(layer, K/V head) whose kept set holds every digit of the key, per policy, at one ratio (issue 64).

    python scripts/kv_needle_kept.py --length 1024 --ratio 0.25
"""

from __future__ import annotations

import argparse

import variants.hf.kvcache as hk
from harness.lm.model import load, locate
from harness.lm.tasks import passkey_prompt
from variants import kvcache

KEY = "863891"
CASES = [("snapkv", {}), ("snapkv", {"window_size": 16}), ("pyramidkv", {}), ("tova", {}), ("h2o", {})]
CASES += [("expected_attention", {}), ("knorm", {}), ("streaming_llm", {}), ("random", {})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024, help="the prompt's tokens")
    parser.add_argument("--ratio", type=float, default=0.25, help="the compression ratio")
    args = parser.parse_args()
    model, tokenizer = load(*locate(None))
    ids = passkey_prompt(tokenizer, args.length, 50, KEY)
    needle = tokenizer(f" The pass key is {KEY}. Remember it. {KEY} is the pass key. ", add_special_tokens=False)
    needle, seq = needle["input_ids"], ids.tolist()
    start = next(i for i in range(len(seq)) if seq[i : i + len(needle)] == needle)
    digits = [start + j for j, t in enumerate(needle) if tokenizer.decode([t]).strip().isdigit()]
    with hk.kv_attention(model):
        _, _, prompts = hk.prefill(model, ids[None])
    print(f"{args.length} tokens, ratio {args.ratio}, {len(digits)} digit tokens of the key said twice")
    for name, options in CASES:
        policy = kvcache.build(name, **options)
        kept = [set(row.tolist()) for p in prompts for row in policy.keep(p, args.ratio)[0]]
        share = sum(all(d in k for d in digits) for k in kept) / len(kept)
        label = name + ("" if not options else f"({', '.join(f'{k}={v}' for k, v in options.items())})")
        print(f"{label:<24} every digit kept in {share:.0%} of {len(kept)} layer-heads")


if __name__ == "__main__":
    main()
