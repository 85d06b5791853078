"""The KV sweep of `bench lm --kv-policy`: each prompt prefilled once with exact attention, then every policy
at every ratio and mode compressing a branch of that cache (variants.hf.kvcache), and the answer or the
continuation measured on the branch: accuracy or perplexity, the kept cache's bytes, a decoded token's time.

    branches = Branches(config, model, tokenizer, tokens)
    row = branches.row(key)      # a cell of config.kv_cells; the prefill is redone only when the prompt changes

Query-aware: the question is part of the prefill and compressed with it (the first answer token comes from
the exact forward, as kvpress's hooks give it). Query-agnostic: the context alone is compressed, then the
question is fed through the compressed cache. Continuation: a window of L tokens, its first L − CONTINUATION
compressed, its last CONTINUATION fed teacher-forced and scored (every position inside L, as the other tasks).
"""

from __future__ import annotations

import math
import time

import torch

import variants.hf.kvcache as hk
from harness.core.timing import timing_stats
from harness.lm import ruler
from harness.lm.config import (
    CONTINUATION,
    KV_MODES,
    KV_TASKS,
    PASSKEY_DIGITS,
    PASSKEY_EXTRA_TOKENS,
    RULER_SUBTASKS,
    LMConfig,
    kv_branches,
)
from harness.lm.tasks import QUESTION, disjoint_window_starts, passkey_key, passkey_prompt
from harness.options import ArgumentError
from variants import kvcache

TIMED_STEPS = 4  # generated tokens timed at least (an answer stops early once it is settled, past these)


class Branches:
    """One prompt's exact prefill (and its query-aware extension), kept while that prompt's branches run."""

    def __init__(self, config: LMConfig, model, tokenizer, tokens: torch.Tensor):
        self.config, self.model, self.tokenizer, self.tokens = config, model, tokenizer, tokens
        self.policies = {name: kvcache.build(name) for name in config.kv_policies}
        self.current = None

    def row(self, key: tuple) -> dict:
        task, label, length, window, depth, index = key
        if (task, length, window, depth, index) != self.current:
            self._prepare(task, length, window, depth, index)
        _, policy, ratio, mode = next(b for b in kv_branches(self.config, task) if b[0] == label)
        row = {"policy": policy or "none", "ratio": ratio, "mode": mode, **self.about}
        with hk.kv_attention(self.model):
            started = time.perf_counter()
            if task == KV_TASKS["perplexity"] or (policy is not None and mode == "agnostic"):
                (cache, prompts), first = self.context, None
            else:
                cache, prompts, first = self._aware()
            if policy is None:
                kept = hk.branch(cache)
            else:
                kept = hk.compressed(cache, self._index(policy, mode, prompts, ratio))
            row.update(state_bytes=hk.cache_bytes(kept), full_bytes=hk.cache_bytes(cache))
            row.update(compress_s=time.perf_counter() - started)
            row.update(self._continuation(kept) if task == KV_TASKS["perplexity"] else self._answer(kept, first))
        return row

    # -- the prompt --------------------------------------------------------------------------------------

    def _prepare(self, task, length, window, depth, index) -> None:
        config, tokenizer = self.config, self.tokenizer
        if task == KV_TASKS["perplexity"]:
            span = length + 1  # (the window and the token its last position predicts)
            start = disjoint_window_starts(len(self.tokens), span, config.keys, config.seed)[window]
            ids, question, self.about = self.tokens[start : start + span][None], 0, {"window": window, "start": start}
            self.expected = None
        elif task == KV_TASKS["passkey"]:
            secret = passkey_key(config.seed, length, depth, index)
            prompt = passkey_prompt(tokenizer, config.prompt_length("passkey", length), depth, secret)
            ids, question = prompt[None], len(tokenizer(QUESTION, add_special_tokens=False)["input_ids"])
            self.expected, self.new = [secret], PASSKEY_DIGITS + PASSKEY_EXTRA_TOKENS
            self.about = {"depth": depth, "key_index": index, "key": secret, "prompt_tokens": ids.shape[1]}
        else:
            subtask = task.split(":", 2)[2]
            listed, self.expected, question = ruler.prompt_parts(
                tokenizer, subtask, config.prompt_length("ruler", length), config.seed, index
            )
            ids, self.new = torch.tensor(listed, dtype=torch.long)[None], ruler.NEW_TOKENS[subtask]
            self.about = {"key_index": index, "expected": self.expected, "prompt_tokens": ids.shape[1]}
        self.ids = ids
        context = ids[:, : length - CONTINUATION] if task == KV_TASKS["perplexity"] else ids[:, :-question]
        began = time.perf_counter()
        with hk.kv_attention(self.model):
            _, cache, prompts = hk.prefill(self.model, context)
        self.about["prefill_s"] = time.perf_counter() - began
        self.context, self.aware, self.scores = (cache, prompts), None, {}
        self.current = (task, length, window, depth, index)

    def _aware(self):
        """(the exact cache of context + question, its prompts, the question's last logits), made once."""
        if self.aware is None:
            cache, prompts = self.context
            n = cache.layers[0].keys.shape[2]
            whole = hk.branch(cache)
            logits, queries = hk.feed(self.model, self.ids[:, n:], whole, n, record=True)
            joined = [torch.cat([p.queries, q], dim=2) for p, q in zip(prompts, queries)]
            self.aware = (whole, hk.prompts(self.model, whole, joined), logits[:, -1])
        return self.aware

    def _index(self, policy: str, mode: str, prompts, ratio: float) -> list[torch.Tensor]:
        """Each layer's kept positions; the scores computed once per (policy, mode) and reused at every ratio."""
        chosen = self.policies[policy]
        if (policy, mode) not in self.scores:
            self.scores[(policy, mode)] = [chosen.scores(p) for p in prompts]
        return [chosen.top(s, p, ratio) for s, p in zip(self.scores[(policy, mode)], prompts)]

    # -- what is measured on a branch -----------------------------------------------------------------------

    def _answer(self, cache, first) -> dict:
        """Greedy answer on `cache`, after the question's exact logits `first` (query-aware) or, None, after the
        question fed through the cache (query-agnostic); each further token timed."""
        if first is None:
            start = self.context[0].layers[0].keys.shape[2]
            first = hk.feed(self.model, self.ids[:, start:], cache, start)[:, -1]
        out, times, position = [int(first.argmax(-1))], [], self.ids.shape[1]
        for step in range(self.new - 1):
            if len(times) >= TIMED_STEPS and (out[-1] == self.tokenizer.eos_token_id or self._settled(out)):
                break  # (the answer cannot change: it holds every expected string, or the model ended it)
            began = time.perf_counter()
            logits = hk.feed(self.model, torch.tensor([[out[-1]]]), cache, position + step)
            times.append(time.perf_counter() - began)
            out.append(int(logits[0, -1].argmax()))
        answer = self.tokenizer.decode(out, skip_special_tokens=True)
        stats = timing_stats(times)
        return {
            "answer": answer,
            "correct": ruler.correct(answer, self.expected),
            "token_s": stats["time_median_s"],
            "token_iqr_s": stats["time_iqr_s"],
            "steps": len(times),
        }

    def _settled(self, out: list[int]) -> bool:
        return ruler.correct(self.tokenizer.decode(out, skip_special_tokens=True), self.expected)

    def _continuation(self, cache) -> dict:
        n = self.context[0].layers[0].keys.shape[2]
        fed, targets = self.ids[:, n : n + CONTINUATION], self.ids[0, n + 1 : n + CONTINUATION + 1]
        began = time.perf_counter()
        logits = hk.feed(self.model, fed, cache, n)
        seconds = time.perf_counter() - began
        nll = float(torch.nn.functional.cross_entropy(logits[0].float(), targets))
        return {"nll": nll, "ppl": math.exp(nll), "scored": CONTINUATION, "forward_s": seconds}


def check_kv(config: LMConfig, model, tokenizer, tokens: torch.Tensor) -> None:
    """ArgumentError, before any prefill, for a KV sweep that could not run: an unknown policy, a ratio outside
    (0, 1), an unknown mode, a model the policies cannot hook, a compressed prompt shorter than a policy reads
    (SnapKV's window), a text too short for the continuations."""
    for name in config.kv_policies:
        if name not in kvcache.available():
            raise ArgumentError(f"--kv-policy {name}: unknown; choose from {', '.join(kvcache.available())}")
    for ratio in config.ratios:
        try:
            kvcache.check_ratio(ratio, "--ratios")
        except ValueError as err:
            raise ArgumentError(str(err)) from None
    for mode in config.kv_modes:
        if mode not in KV_MODES:
            raise ArgumentError(f"--kv-modes {mode}: choose from {', '.join(KV_MODES)}")
    if not {"passkey", "ruler", "perplexity"} & set(config.tasks):
        raise ArgumentError("--kv-policy: the KV sweep measures --tasks passkey, ruler or perplexity; none is asked")
    if "expected_attention" in config.kv_policies and hk.rope_of(model) is None:
        raise ArgumentError("--kv-policy expected_attention: the model has no rotary embedding (rotary_emb) to read")
    try:
        with torch.no_grad():
            hk.prefill(model, tokens[:8][None])
    except Exception as err:  # (a model whose layers do not go through the attention interface)
        raise ArgumentError(f"--kv-policy: {type(model).__name__} cannot be hooked: {err}") from None
    shortest = max(kvcache.build(name).shortest_prompt for name in config.kv_policies)
    n = min(config.lengths)
    compressed = {"perplexity": n - CONTINUATION}  # (the tokens each task's compressed prompt holds at length n)
    if "passkey" in config.tasks:
        question = len(tokenizer(QUESTION, add_special_tokens=False)["input_ids"])
        compressed["passkey"] = config.prompt_length("passkey", n) - question
    if "ruler" in config.tasks:
        parts = [
            ruler.prompt_parts(tokenizer, t, config.prompt_length("ruler", n), config.seed, 0) for t in RULER_SUBTASKS
        ]
        compressed["ruler"] = min(len(ids) - question for ids, _, question in parts)
    for task, size in compressed.items():
        if task in config.tasks and size < shortest:
            raise ArgumentError(
                f"--lengths {n}: --tasks {task} compresses a prompt of {size} tokens there; --kv-policy "
                f"{', '.join(config.kv_policies)} needs at least {shortest} (SnapKV and PyramidKV read a window of 64)"
            )
    if "perplexity" in config.tasks:
        for length in config.lengths:
            disjoint_window_starts(len(tokens), length + 1, config.keys, config.seed)
