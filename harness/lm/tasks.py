"""What `bench lm` measures of a model: perplexity over a window, passkey retrieval, and the cost of a
forward and of a decoded token."""

from __future__ import annotations

import random
import time

import torch

import variants.hf as vh
from harness.core.timing import measure_time, timing_stats
from harness.core.memory import measure_peak, pin_mmap_threshold, steady_allocator
from harness.lm.config import COST_MIN_S, COST_REPEATS, DECODE_STEPS, FILLER, PASSKEY_DIGITS, PASSKEY_EXTRA_TOKENS
from harness.options import ArgumentError

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)


QUESTION = "\nWhat is the pass key? The pass key is"


def window_starts(n_tokens: int, length: int, windows: int, seed: int) -> list[int]:
    """The first token of each context of `length` tokens: drawn from (seed, length), the same for every attention."""
    rng = random.Random(f"{seed}-{length}")
    return [rng.randrange(0, n_tokens - length + 1) for _ in range(windows)]


def window_nll(model, tokens: torch.Tensor, start: int, length: int, scored: int) -> tuple[float, float]:
    """(mean negative log-likelihood of the context's last `scored` tokens, seconds of the forward)."""
    ids = tokens[start : start + length][None]
    with torch.no_grad():
        began = time.perf_counter()
        logits = model(ids, use_cache=False, logits_to_keep=scored + 1).logits[0, :-1].float()
        seconds = time.perf_counter() - began
    nll = torch.nn.functional.cross_entropy(logits, ids[0, -scored:], reduction="mean")
    return float(nll), seconds


def disjoint_window_starts(n_tokens: int, length: int, windows: int, seed: int) -> list[int]:
    """The first token of each of `windows` windows of `length` tokens that share no token: slots of the text drawn
    without replacement from (seed, length), the same for every attention; ArgumentError when the text holds fewer."""
    slots = n_tokens // length
    if windows > slots:
        raise ArgumentError(
            f"--lengths {length}: {windows} windows of {length} tokens are needed (--windows, --scored-tokens), "
            f"and the text holds {slots} that share no token ({n_tokens} tokens); give a longer --text or fewer"
        )
    rng = random.Random(f"disjoint-{seed}-{length}")
    return [slot * length for slot in rng.sample(range(slots), windows)]


def position_buckets(length: int) -> list[tuple[int, int]]:
    """Log-spaced buckets of token positions [lo, hi): 1-2, 2-4, 4-8, ... up to `length` (position 0 is never
    predicted)."""
    out, lo = [], 1
    while lo < length:
        out.append((lo, min(2 * lo, length)))
        lo *= 2
    return out


def window_scores(model, tokens: torch.Tensor, start: int, length: int, first: int) -> dict:
    """One window's negative log-likelihoods: the mean over its tokens from position `first` on (`nll`, `scored`),
    the sum and count in each log-spaced position bucket (`position_nll`: [lo, hi, sum, count]), and the seconds of
    the forward (every position's logits: the buckets need them)."""
    ids = tokens[start : start + length][None]
    with torch.no_grad():
        began = time.perf_counter()
        logits = model(ids, use_cache=False).logits[0, :-1]  # (L - 1, V): position p + 1 predicted from 0..p
        seconds = time.perf_counter() - began
        nll = torch.cat(  # in chunks: the log-softmax of every position at once would double the logits' memory
            [
                torch.nn.functional.cross_entropy(chunk.float(), target, reduction="none")
                for chunk, target in zip(logits.split(1024), ids[0, 1:].split(1024))
            ]
        ).double()
    # nll[p - 1] is position p's: a bucket [lo, hi) is the slice nll[lo - 1 : hi - 1]
    buckets = [[lo, hi, float(nll[lo - 1 : hi - 1].sum()), hi - lo] for lo, hi in position_buckets(length)]
    scored = nll[first - 1 :]
    return {"nll": float(scored.mean()), "scored": int(scored.numel()), "position_nll": buckets, "forward_s": seconds}


def passkey_prompt(tokenizer, length: int, depth: int, key: str) -> torch.Tensor:
    """Token ids of exactly `length` tokens: the intro, filler with the key said at `depth`% of it, the question."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    intro, needle, question = (
        encode(INTRO),
        encode(f" The pass key is {key}. Remember it. {key} is the pass key. "),
        encode(QUESTION),
    )
    room = length - len(intro) - len(needle) - len(question)
    if room < 0:
        raise ArgumentError(
            f"--lengths {length}: too short for the passkey prompt ({len(intro) + len(needle) + len(question)} tokens without filler)"
        )
    filler = encode(FILLER)
    filler = (filler * (room // len(filler) + 1))[:room]
    cut = round(room * depth / 100)
    return torch.tensor(intro + filler[:cut] + needle + filler[cut:] + question, dtype=torch.long)


def passkey_key(seed: int, length: int, depth: int, index: int) -> str:
    rng = random.Random(f"{seed}-{length}-{depth}-{index}")
    return str(rng.randrange(10_000, 10**PASSKEY_DIGITS))  # 5 or 6 digits


def passkey_answer(model, tokenizer, ids: torch.Tensor, key: str) -> dict:
    """Greedy generation after the prompt: the answer, whether it holds the key, the prompt's and each new
    token's time, and the decoding state's bytes after the prompt (the cache generate() kept)."""
    out = greedy_answer(model, tokenizer, ids, len(key) + PASSKEY_EXTRA_TOKENS)
    return {"answer": out["answer"], "correct": key in out["answer"].replace(" ", ""), **out}


def greedy_answer(model, tokenizer, ids: torch.Tensor, new: int) -> dict:
    """`new` greedy tokens after the prompt `ids`: the answer's text, the prompt's and each new token's time, and the
    decoding state's bytes after the prompt (the cache generate() kept)."""
    stamps = []

    class Clock:  # a logits processor: called once per generated token
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    from transformers import LogitsProcessorList

    with torch.no_grad():
        began = time.perf_counter()
        out = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids)[None],
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([Clock()]),
        )
    answer = tokenizer.decode(out.sequences[0, ids.numel() :], skip_special_tokens=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "answer": answer,
        "prefill_s": stamps[0] - began if stamps else None,
        "token_s": sorted(steps)[len(steps) // 2] if steps else None,
        "state_bytes": cache_bytes(cache),
    }


def cache_bytes(cache) -> int | None:
    """Bytes every layer's cache holds: the variants' decoding states, or the model's own keys and values."""
    if cache is None:
        return None
    total = 0
    for layer in getattr(cache, "layers", []):
        state = getattr(layer, "state", None)
        if state is not None:
            total += state.nbytes()
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def forward_time(model, tokens: torch.Tensor, length: int) -> dict:
    """A forward of `length` tokens timed as `bench run` times a cell (harness.core.timing): warm-up, then
    samples until COST_REPEATS or at least 3 lasting COST_MIN_S; the median, the fastest, the spread."""
    ids = tokens[:length][None]

    def call():
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)

    timing = measure_time(call, torch.device("cpu"), warmup=1, repeats=COST_REPEATS, min_time=COST_MIN_S)
    stats = timing_stats(timing.times)
    return {
        "forward_s": stats["time_median_s"],
        "forward_min_s": stats["time_min_s"],
        "forward_iqr_s": stats["time_iqr_s"],
        "forward_samples": len(timing.times),
    }


def decode_cost(model, tokens: torch.Tensor, length: int, steps: int = DECODE_STEPS) -> dict:
    """Decoding inside the model: a prompt of `length` tokens of the text, then `steps` tokens fed one at a time
    (the text's next ones), each a forward with the cache: the model's own KV cache (DynamicCache) for its sdpa,
    else each layer's decoding state (variants.hf.state_cache). The prompt's time, the median step (and the
    fastest, the spread), the cache's bytes after the prompt and after the steps."""
    import transformers

    own = model.config._attn_implementation != vh.IMPLEMENTATION
    cache = transformers.DynamicCache() if own else vh.state_cache(model)
    passed = {vh.cache_argument(model) or "past_key_values": cache}  # ("cache" in recent transformers)
    ids = tokens[: length + steps][None]
    times = []
    with torch.no_grad():
        began = time.perf_counter()
        model(ids[:, :length], **passed, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - began
        after_prompt = cache_bytes(cache)
        for i in range(length, length + steps):
            began = time.perf_counter()
            model(ids[:, i : i + 1], **passed, use_cache=True)
            times.append(time.perf_counter() - began)
    stats = timing_stats(times)
    return {
        "prefill_s": prefill,
        "token_s": stats["time_median_s"],
        "token_min_s": stats["time_min_s"],
        "token_iqr_s": stats["time_iqr_s"],
        "steps": steps,
        "state_bytes": after_prompt,
        "state_bytes_after": cache_bytes(cache),
    }


def forward_peak(model, tokens: torch.Tensor, length: int) -> int:
    """Peak extra bytes of one forward of `length` tokens (RSS high-water mark, mmap threshold pinned)."""
    ids = tokens[:length][None]
    pin_mmap_threshold()
    try:
        with torch.no_grad():
            return int(
                measure_peak(lambda: model(ids, use_cache=False, logits_to_keep=1), torch.device("cpu"))["peak_bytes"]
            )
    finally:
        steady_allocator()
