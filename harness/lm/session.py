"""An lm run opened: a new one checked against the model and the text before anything is written, or one
to resume with the same model file; the model loaded once.

`bench lm` is `open_lm`, then `run.run_session` under a progress bar, then the report. What the command
line asks is checked here, before anything is written."""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch

import variants.hf as vh
from harness.lm import kv, ruler
from harness.lm.config import DECODE_STEPS, OWN, RESULTS, RULER_SUBTASKS, SCORED_FROM, TASKS, LMConfig, Recipe
from harness.lm.config import Setting, shortest_length
from harness.lm.model import corpus_text, corpus_tokens, load, locate, model_hash, parse_setting, switch
from harness.lm.model import text_hash, with_distilled, with_linearized
from harness.lm.stages import check_projections, peft_module
from harness.lm.tasks import disjoint_window_starts, passkey_prompt
from harness.lm.training_text import check_disjoint, training_sequences, training_text
from harness.options import ArgumentError, parse_lengths, parse_list
from harness.store import rundir
from harness.store.storage import read_rows


@dataclass(frozen=True)
class LMRequest:
    """What `bench lm` was asked: the command line's texts (`build`: model, variants, lengths, depths,
    windows, keys, seed, text, tasks, threads, distill, distill_lr, linearize; ignored when resuming) and where
    the run goes."""

    build: dict = field(default_factory=dict)
    resume: Path | None = None
    out: Path | None = None


def lm_config(
    *,
    model: str | None,
    variants: list[str],
    lengths: str,
    depths: str,
    windows: int,
    keys: int,
    seed: int,
    text: str | None,
    tasks: str,
    threads: int,
    distill: int,
    distill_lr: float,
    linearize: dict,
    scored_tokens: int,
    kv_policies: list[str],
    ratios: str,
    kv_modes: str,
) -> LMConfig:
    """The run's configuration from the command line's texts (every default is the command's); ArgumentError
    naming a bad one. `linearize`: Recipe's fields as given (--linearize, --lora, --linearize-lr, --lora-lr,
    --lora-rank, --train-length, --train-text, --position-offsets, --accumulate, --eval-every); no recipe when
    both step counts are 0."""
    recipe = Recipe(**linearize)
    rates = {"--distill-lr": distill_lr, "--linearize-lr": recipe.transfer_lr, "--lora-lr": recipe.lora_lr}
    for option, rate in rates.items():
        if not (rate > 0 and rate < 1):
            raise ArgumentError(f"{option} {rate}: a learning rate between 0 and 1 (e.g. 1e-3)")
    return LMConfig(
        model=model or "smollm2",
        settings=tuple(parse_setting(v) for v in variants),
        lengths=parse_lengths(lengths),
        depths=parse_depths(depths),
        windows=windows,
        keys=keys,
        seed=seed,
        text=text,
        tasks=parse_list(tasks, "--tasks", TASKS),
        threads=threads,
        distill=distill,
        distill_lr=distill_lr,
        linearize=recipe if recipe.transfer_steps or recipe.lora_steps else None,
        scored_from=SCORED_FROM,
        scored_tokens=scored_tokens,
        answer_inside=True,
        kv_policies=tuple(kv_policies),
        ratios=parse_ratios(ratios),
        kv_modes=tuple(m.strip() for m in kv_modes.split(",") if m.strip()),
    )


def parse_depths(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ArgumentError(
            f"--depths {text!r}: not a comma-separated list of whole percentages (e.g. 0,50,100)"
        ) from None
    if not depths or any(not 0 <= d <= 100 for d in depths):
        raise ArgumentError(f"--depths {text!r}: depths are percentages of the filler before the key, from 0 to 100")
    return depths


def parse_ratios(text: str) -> tuple[float, ...]:
    try:
        ratios = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ArgumentError(f"--ratios {text!r}: not a comma-separated list of numbers (e.g. 0.25,0.5)") from None
    if not ratios:
        raise ArgumentError(f"--ratios {text!r}: no ratio given")
    return ratios


@dataclass
class LMSession:
    run_dir: Path
    config: LMConfig
    model: object
    tokenizer: object
    tokens: object

    @property
    def resume_command(self) -> str:
        return rundir.resume_command("lm", self.run_dir)

    def kept(self) -> str:
        return f"finished rows are kept in {self.run_dir / RESULTS}"


def open_lm(
    request: LMRequest,
    say: Callable[[str], None] = print,
    status: Callable[[str], ContextManager] = lambda text: nullcontext(),
) -> LMSession:
    """Open the lm run `request` asks for and load its model; ArgumentError for a value that is not allowed."""
    if request.resume is not None:
        metadata = rundir.open_to_resume(request.resume, "lm", [])
        config = LMConfig.from_json(metadata["config"], lambda: _labels(request.resume))
        run_dir = request.resume
    else:
        config = lm_config(**request.build)
        corpus_text(config.text)  # (an absent or empty file is refused before the model loads)
        run_dir = rundir.new_run_dir(request.out, "lm-")
    folder, gguf = locate(None if config.model == "smollm2" else config.model)
    with status(f"loading {folder / gguf if gguf else folder}"):
        net, tokenizer = load(folder, gguf, config.threads)
        tokens = corpus_tokens(tokenizer, config.text)
        digest = model_hash(folder, gguf)
    if request.resume is not None:
        if metadata.get("machine", {}).get("model", {}).get("sha256") != digest:
            raise ArgumentError(
                f"--resume: {run_dir} was measured with another model file (sha256 differs); start a new run"
            )
        say(f"resuming {run_dir} with its original options (other options given now are ignored)")
    else:
        check_config(config, net, tokenizer, tokens)
        config, nothing = with_distilled(config, net)
        if nothing:
            say(
                f"--distill: nothing to train in {', '.join(nothing)} (no parameters of their own): evaluated as they are"
            )
        if config.linearize is not None:
            check_linearize(config, net, tokenizer, tokens)
            config, unlinearized = with_linearized(config, net)
            if unlinearized:
                say(
                    f"--linearize: nothing to linearize in {', '.join(unlinearized)} (no parameters of their own; "
                    f"try feature_map=hedgehog): evaluated zero-shot only"
                )
        about = {
            "model": {
                "name": type(net).__name__,
                "path": str(folder / gguf if gguf else folder),
                "sha256": digest,
                "layers": net.config.num_hidden_layers,
                "context": getattr(net.config, "max_position_embeddings", None),
            },
            "corpus": {
                "source": config.text or "pydoc_data.topics",
                "sha256": text_hash(config.text),
                "tokens": len(tokens),
            },
        }
        if config.distill:
            about["distill"] = {"nothing_to_train": nothing}
        if config.linearize is not None:
            about["linearize"] = {
                "nothing_to_linearize": unlinearized,
                "train_text": config.linearize.text or "the standard library's docstrings",
                "train_text_sha256": hashlib.sha256(
                    training_text(config.linearize.text, corpus_text(config.text)).encode()
                ).hexdigest(),
            }
        rundir.start(run_dir, "lm", config.to_json(), machine=about)
    return LMSession(run_dir, config, net, tokenizer, tokens)


def _labels(run_dir: Path) -> set[str]:
    """The attentions' labels in a run's rows (none before its first row)."""
    rows = read_rows(run_dir, RESULTS, quiet=True) if (run_dir / RESULTS).exists() else []
    return {row["setting"] for row in rows}


def check_linearize(config: LMConfig, model, tokenizer, tokens) -> None:
    """ArgumentError, before anything is written or trained, for a linearization that could not run: peft
    missing (LoRA), a model without q, k, v, o projections, a training length past the model's context, a
    training text missing, empty, too short or overlapping the scored text."""
    recipe = config.linearize
    context = getattr(model.config, "max_position_embeddings", None)
    if recipe.length < 2 or (context and recipe.length > context):
        raise ArgumentError(
            f"--train-length {recipe.length}: tokens a training sequence, from 2 to the model's context ({context})"
        )
    if recipe.position_offsets and context and recipe.position_offsets + recipe.length > context:
        raise ArgumentError(
            f"--position-offsets {recipe.position_offsets}: a {recipe.length}-token training sequence starting there "
            f"ends past the model's context ({context}); at most {context - recipe.length}"
        )
    if recipe.lora_steps:
        peft_module()
        check_projections(model)
    scored = corpus_text(config.text)
    training_sequences(tokenizer, recipe, scored)  # (enough of it)
    check_disjoint(training_text(recipe.text, scored), scored, recipe.text or "the standard library's docstrings")


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
