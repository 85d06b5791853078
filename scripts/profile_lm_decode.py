"""Where a generated token's time goes inside SmolLM2 after a long prompt: the operators of a few decoding steps,
the model's own sdpa + DynamicCache against `full` through variants.hf + its state cache, under torch.profiler.

    python scripts/profile_lm_decode.py [LENGTH] [STEPS]     # defaults: 8192 tokens, 5 profiled steps

Each attention gets the same prompt (the first LENGTH tokens of the pydoc topics), 3 unprofiled warm-up steps,
then STEPS profiled ones; the table lists the operators by their own CPU time.
"""

from __future__ import annotations

import sys

import torch

import variants.hf as vh
from harness.lm.model import corpus_tokens, load, locate


def profile(model, ids: torch.Tensor, length: int, steps: int, cache) -> torch.profiler.profile:
    passed = {vh.cache_argument(model) or "past_key_values": cache}
    with torch.no_grad():
        model(ids[:, :length], **passed, use_cache=True, logits_to_keep=1)
        for i in range(length, length + 3):
            model(ids[:, i : i + 1], **passed, use_cache=True)
        with torch.profiler.profile() as prof:
            for i in range(length + 3, length + 3 + steps):
                model(ids[:, i : i + 1], **passed, use_cache=True)
    return prof


def main(length: int = 8192, steps: int = 5) -> None:
    import transformers

    model, tokenizer = load(*locate(None))
    ids = corpus_tokens(tokenizer, None)[: length + 3 + steps][None]
    for name in ("sdpa", "full"):
        if name != "sdpa":
            vh.use(model, name)
        cache = transformers.DynamicCache() if name == "sdpa" else vh.state_cache(model)
        prof = profile(model, ids, length, steps, cache)
        total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
        print(f"== {name}: {steps} steps after {length} tokens, {total:.0f} ms of CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
