"""Is a policy's passkey failure the policy's, or attnbench's? kvpress answers the same prompts end to end.

    python scripts/kvpress_end_to_end.py --kvpress-python /work/kvenv/bin/python --run results/lm-smollm2-kv-lengths

The --run's query-aware passkey prompts at --length (its seed, depth 50, every key) go through kvpress's own
presses in their environment (as scripts/kvpress_agreement.py: kvpress pins transformers < 5.3): the whole
prompt prefilled under the press (the cache pruned layer by layer), then the answer decoded greedily from the
pruned cache. Printed per press: kvpress's exact-match count, the run's count for the same policy, ratio and
prompts (its `aware` rows), and on how many prompts the two agree (right or wrong).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpress_side import run_side

PRESSES = {  # our policy: kvpress's press (None: no press, the full cache)
    "none": None,
    "snapkv": "SnapKVPress",
    "pyramidkv": "PyramidKVPress",
    "expected_attention": "ExpectedAttentionPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "streaming_llm": "StreamingLLMPress",
}
NEW_TOKENS = 9  # the first answer token from the prefill, then these

KVPRESS_SIDE = r"""
import json, sys, torch, transformers, kvpress
folder, gguf, prompts_file, ratio, out_file, new = sys.argv[1:7]
prompts = json.load(open(prompts_file))
model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
answers = {}
for name in sys.argv[7:]:
    answers[name] = []
    for ids in prompts:
        ids, cache = torch.tensor(ids)[None], transformers.DynamicCache()
        with torch.no_grad():
            if name == "none":
                out = model(ids, past_key_values=cache, use_cache=True)
            else:
                with getattr(kvpress, name)(compression_ratio=float(ratio))(model):
                    out = model(ids, past_key_values=cache, use_cache=True)
            tokens, position = [int(out.logits[0, -1].argmax())], ids.shape[1]
            for _ in range(int(new)):  # (the pruned cache is shorter than the positions: give them)
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                            position_ids=torch.tensor([[position]]), cache_position=torch.tensor([position]))
                tokens.append(int(out.logits[0, -1].argmax()))
                position += 1
        answers[name].append(tokens)
json.dump({"transformers": transformers.__version__, "answers": answers}, open(out_file, "w"))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvpress-python", required=True, help="the python of an environment with kvpress")
    parser.add_argument("--run", required=True, help="a bench lm --kv-policy run with passkey rows at --length")
    parser.add_argument("--length", type=int, default=1024, help="the prompts' length (the run's --lengths)")
    parser.add_argument("--ratio", type=float, default=0.25, help="the compression ratio")
    args = parser.parse_args()
    import pandas as pd

    from harness.lm.config import LMConfig
    from harness.lm.model import load, locate
    from harness.lm.tasks import passkey_key, passkey_prompt
    from harness.store.storage import read_metadata

    config = LMConfig.from_json(read_metadata(Path(args.run))["config"])
    folder, gguf = locate(None)
    _, tokenizer = load(folder, gguf)
    secrets = [passkey_key(config.seed, args.length, 50, i) for i in range(config.keys)]
    prompts = [passkey_prompt(tokenizer, config.prompt_length("passkey", args.length), 50, s).tolist() for s in secrets]
    theirs = run_side(
        args.kvpress_python,
        KVPRESS_SIDE,
        {"prompts": prompts},
        [str(folder), gguf, "{prompts}", str(args.ratio), "{out}", str(NEW_TOKENS)]
        + [press or "none" for press in PRESSES.values()],
    )
    if theirs is None:
        return 2
    rows = pd.read_json(Path(args.run) / "lm.jsonl", lines=True)
    rows = rows[(rows["task"] == "kv:passkey") & (rows["length"] == args.length) & (rows["depth"] == 50)]
    print(
        f"kvpress (transformers {theirs['transformers']}) and {args.run}: SmolLM2-135M, {args.length}-token passkey "
        f"prompts (query-aware), ratio {args.ratio}, {len(prompts)} keys"
    )
    print(f"{'policy':<20}{'kvpress':>9}{'attnbench':>11}{'agree':>7}")
    for ours, press in PRESSES.items():
        right = [
            s in tokenizer.decode(t, skip_special_tokens=True)
            for s, t in zip(secrets, theirs["answers"][press or "none"])
        ]
        mine = (
            rows[rows["policy"] == ours]
            if press is None
            else rows[(rows["policy"] == ours) & (rows["mode"] == "aware") & (rows["ratio"] == args.ratio)]
        )
        by_key = {int(r.key_index): bool(r.correct) for r in mine.itertuples()}
        agree = sum(by_key.get(i) == r for i, r in enumerate(right))
        print(f"{ours:<20}{sum(right):>6}/{len(right)}{sum(by_key.values()):>8}/{len(by_key)}{agree:>5}/{len(right)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
