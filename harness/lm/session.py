"""An lm run's life: open it (a new run checked against the model and the text before anything is
written, or one to resume with the same model file), the model loaded once, its lock while the cells run.

`bench lm` is `open_lm`, then `LMSession.run` under a progress bar, then the report."""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

from harness.lm import run as lmrun
from harness.lm.model import corpus_text, corpus_tokens, load, model_hash, text_hash, with_distilled, with_linearized
from harness.lm.config import RESULTS, SCORED_FROM, TASKS, LMConfig, Recipe, cells, parse_depths, row_key
from harness.lm.stages import check_projections, peft_module
from harness.lm.training_text import check_disjoint, training_sequences, training_text
from harness.options import ArgumentError, parse_lengths, parse_list
from harness.store import rundir
from harness.store.storage import RowWriter, RunLock, read_rows


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
    distill: int = 0,
    distill_lr: float = 1e-3,
    linearize: dict | None = None,
    scored_tokens: int = 0,
    kv_policies: list[str] | None = None,
    ratios: str = "0.25,0.5,0.75,0.875",
    kv_modes: str = "aware,agnostic",
) -> LMConfig:
    """The run's configuration from the command line's texts; ArgumentError naming a bad one. `linearize`: the
    recipe's fields as given (--linearize, --lora, --linearize-lr, --lora-lr, --lora-rank, --train-length,
    --train-text, --position-offsets, --accumulate, --eval-every), None or transfer_steps and lora_steps 0 for none."""
    rates = {"--distill-lr": distill_lr}
    if linearize:
        rates.update(
            {"--linearize-lr": linearize.get("transfer_lr", 1e-2), "--lora-lr": linearize.get("lora_lr", 1e-4)}
        )
    for option, rate in rates.items():
        if not (rate > 0 and rate < 1):
            raise ArgumentError(f"{option} {rate}: a learning rate between 0 and 1 (e.g. 1e-3)")
    recipe = None
    if linearize and (linearize.get("transfer_steps") or linearize.get("lora_steps")):
        recipe = Recipe(**linearize).to_json()
    return LMConfig(
        model=model or "smollm2",
        settings=tuple(lmrun.parse_setting(v) for v in variants),
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
        linearize=recipe,
        scored_from=SCORED_FROM,
        scored_tokens=scored_tokens,
        answer_inside=True,
        kv_policies=tuple(kv_policies or ()),
        ratios=parse_ratios(ratios),
        kv_modes=tuple(m.strip() for m in kv_modes.split(",") if m.strip()),
    )


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

    def run(self, on_cell=None, before: Callable[[int], None] | None = None, on_train=None) -> None:
        """Every cell without a row, under the run's lock; `before(cells)` once the lock is held (`on_cell`
        is called for every cell, finished ones too; `on_train(label, stage, step, steps, loss)` after each
        step of a linearization)."""
        with RunLock(self.run_dir):
            done = (
                {row_key(r) for r in read_rows(self.run_dir, RESULTS, quiet=True)}
                if (self.run_dir / RESULTS).exists()
                else set()
            )
            if before is not None:
                before(len(cells(self.config)))
            with RowWriter(self.run_dir, RESULTS) as writer:
                lmrun.run_lm(
                    self.config,
                    self.model,
                    self.tokenizer,
                    self.tokens,
                    done,
                    writer.append,
                    on_cell,
                    self.run_dir,
                    on_train,
                )


def open_lm(
    request: LMRequest,
    say: Callable[[str], None] = print,
    status: Callable[[str], ContextManager] = lambda text: nullcontext(),
) -> LMSession:
    """Open the lm run `request` asks for and load its model; ArgumentError for a value that is not allowed."""
    if request.resume is not None:
        metadata = rundir.open_to_resume(request.resume, "lm", [])
        config = LMConfig.from_json(metadata["config"])
        run_dir = request.resume
    else:
        config = lm_config(**request.build)
        corpus_text(config.text)  # (an absent or empty file is refused before the model loads)
        run_dir = rundir.new_run_dir(request.out, "lm-")
    folder, gguf = lmrun.locate(None if config.model == "smollm2" else config.model)
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
        lmrun.check_config(config, net, tokenizer, tokens)
        config, nothing = with_distilled(config, net)
        if nothing:
            say(
                f"--distill: nothing to train in {', '.join(nothing)} (no parameters of their own): evaluated as they are"
            )
        if config.recipe is not None:
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
        if config.recipe is not None:
            about["linearize"] = {
                "nothing_to_linearize": unlinearized,
                "train_text": config.recipe.text or "the standard library's docstrings",
                "train_text_sha256": hashlib.sha256(
                    training_text(config.recipe.text, corpus_text(config.text)).encode()
                ).hexdigest(),
            }
        rundir.start(run_dir, "lm", config.to_json(), machine=about)
    return LMSession(run_dir, config, net, tokenizer, tokens)


def check_linearize(config: LMConfig, model, tokenizer, tokens) -> None:
    """ArgumentError, before anything is written or trained, for a linearization that could not run: peft
    missing (LoRA), a model without q, k, v, o projections, a training length past the model's context, a
    training text missing, empty, too short or overlapping the scored text."""
    recipe = config.recipe
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
