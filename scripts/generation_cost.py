"""Generation with each variant's own decoding state (variants.hf.state_cache) in a tiny random Llama:
per-token time and the states' bytes against the number of generated tokens, and the peak extra memory
of generating G tokens for several G (each in a process of its own). No download: the model is built here.

    python scripts/generation_cost.py results/generation-cpu.json [--tokens 2048] [--variants full,linear,...]

Writes one JSON record per (variant, G) and prints a table. The model: hidden 256, 4 heads of D = 64
(2 K/V heads), 2 layers, prompt 64 random tokens, greedy, B = 1, float32, CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
import warnings

DEFAULT_VARIANTS = "full,linear,sliding_window,retention,gated_deltanet,memory_compressed"
OPTIONS = {"sliding_window": {"window": 128, "global_tokens": 4}, "memory_compressed": {"compression": 4}}
PROMPT = 64


def _model(variant: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import variants.hf as vh

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    return vh.use(LlamaForCausalLM(config).eval(), variant, **OPTIONS.get(variant, {}))


def one_generation(variant: str, tokens: int) -> dict:
    """In a process of its own: generate `tokens` after the prompt; per-token times, state bytes, peak extra RSS."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    import variants.hf as vh
    from harness.core.memory import measure_peak, pin_mmap_threshold

    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", message="`past_key_values` is deprecated")
    model = _model(variant)
    ids = torch.randint(0, 512, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    stamps, sizes = [], []

    class Clock(LogitsProcessor):  # called once per generated token, after the forward that made it
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            sizes.append(sum(layer.state.nbytes() for layer in cache.layers if layer.state is not None))
            return scores

    def generate():
        with torch.no_grad():
            model.generate(
                ids,
                past_key_values=cache,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([Clock()]),
                pad_token_id=0,
            )

    cache = vh.state_cache(model)
    generate()  # warm-up (and the timed stamps)
    per_token = [b - a for a, b in zip(stamps, stamps[1:])]
    first, last = per_token[: len(per_token) // 8], per_token[-(len(per_token) // 8) :]
    sizes_seen = list(sizes)
    stamps.clear()
    sizes.clear()
    cache = vh.state_cache(model)
    pin_mmap_threshold()
    peak = measure_peak(generate, torch.device("cpu"))["peak_bytes"]
    return {
        "variant": variant,
        "tokens": tokens,
        "prompt": PROMPT,
        "ms_per_token_first_eighth": 1e3 * statistics.median(first),
        "ms_per_token_last_eighth": 1e3 * statistics.median(last),
        "state_bytes_first": sizes_seen[0],
        "state_bytes_last": sizes_seen[-1],
        "peak_bytes": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", default="512,2048", help="generated lengths G, comma-separated")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    args = parser.parse_args()
    records = []
    ctx = mp.get_context("spawn")
    for variant in args.variants.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            with ctx.Pool(1) as pool:
                record = pool.apply(one_generation, (variant, tokens))
            records.append(record)
            print(
                f"{variant:18s} G={tokens:5d}  ms/token first 1/8 {record['ms_per_token_first_eighth']:6.2f}  "
                f"last 1/8 {record['ms_per_token_last_eighth']:6.2f}  state {record['state_bytes_first'] / 2**10:8.1f} -> "
                f"{record['state_bytes_last'] / 2**10:8.1f} KiB  peak {record['peak_bytes'] / 2**20:6.1f} MiB",
                flush=True,
            )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
