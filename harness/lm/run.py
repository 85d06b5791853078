"""Measuring an lm run's cells: each attention switched in turn (a distilled or linearized one trained the
first time it is asked for, under RUN_DIR/linearized/), then its rows made and written as they exist, under the
run's lock. `bench lm` is `session.open_lm`, then `run_session` under a progress bar, then the report.

Perplexity: each context of L tokens is a window of the corpus, its start drawn from a seed (the same windows
for every attention); the tokens of its second half are scored. Passkey (RULER-style): a 5-6 digit key said
once at a depth of the filler, then asked for at the end; greedy generation, exact match. "sdpa" stands for
the model's own attention, the baseline of every figure.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from harness.lm import distill as transfer
from harness.lm import kv, ruler
from harness.lm import linearize as lin
from harness.lm.checkpoints import finished, load_linearized, summary_of
from harness.lm.config import (
    LINEARIZED_DIR,
    OWN,
    RESULTS,
    SCORED,
    LMConfig,
    Setting,
    cells,
    distill_length,
    row_key,
    slug,
)
from harness.lm.model import corpus_text, switch
from harness.lm.stages import TARGETS
from harness.lm.tasks import (
    decode_cost,
    disjoint_window_starts,
    forward_peak,
    forward_time,
    greedy_answer,
    passkey_answer,
    passkey_key,
    passkey_prompt,
    window_nll,
    window_scores,
    window_starts,
)
from harness.lm.training_text import training_sequences
from harness.store.storage import RowWriter, RunLock, read_rows


class Attentions:
    """Switches the model from one attention of the run to the next; a distilled one is trained the first time
    it is asked for and kept (its variants' parameters) for the later lengths; a linearized one is trained the
    first time (resuming from its checkpoint), saved to RUN_DIR/linearized/, and loaded from there later. The
    model's own weights, which a linearization's merged adapters change, are put back for every other attention."""

    def __init__(self, config: LMConfig, model, tokenizer, run_dir: Path | None = None, on_train=None):
        self.config, self.model, self.tokenizer, self.run_dir, self.on_train = (
            config,
            model,
            tokenizer,
            run_dir,
            on_train,
        )
        self.current, self.kept, self.last_distillation, self.last_linearization = None, {}, None, None
        self.pristine = None  # the projections' weights before any linearization changed them
        if any(s.linearized for s in config.settings):
            self.pristine = {
                name: p.detach().clone() for name, p in model.named_parameters() if name.rsplit(".", 2)[-2] in TARGETS
            }
        self.changed = False

    def folder(self, setting: Setting) -> Path:
        return Path(self.run_dir) / LINEARIZED_DIR / slug(setting.label)

    def switch(self, setting: Setting):
        if self.current == setting.label:
            return self.model
        if self.changed:  # the last attention was linearized: the model's own weights back first
            self.model.load_state_dict(self.pristine, strict=False)
            self.changed = False
        self.model, self.current = switch(self.model, setting, self.config.seed), setting.label
        self.last_distillation = self.last_linearization = None
        fit_key = ("fit", setting.variant, tuple(sorted(setting.options.items())))
        if fit_key in self.kept:  # (mla: its projections from the model's own keys and values, once a variant)
            transfer.load_attached_state(self.model, self.kept[fit_key])
        elif setting.variant != OWN and transfer.fittable(self.model):
            transfer.fit_to_own(self.model, transfer.distill_sequences(self.tokenizer, distill_length(self.config)))
            self.kept[fit_key] = transfer.attached_state(self.model)
        if setting.distill:
            if setting.label in self.kept:
                transfer.load_attached_state(self.model, self.kept[setting.label])
            else:
                sequences = transfer.distill_sequences(self.tokenizer, distill_length(self.config))
                self.last_distillation = transfer.transfer(
                    self.model, sequences, setting.distill, self.config.distill_lr, self.config.seed
                )
                self.kept[setting.label] = transfer.attached_state(self.model)
        if setting.linearized:
            folder = self.folder(setting)
            if finished(folder) is None:
                train, held_out = training_sequences(
                    self.tokenizer, self.config.linearize, corpus_text(self.config.text)
                )
                on_step = (
                    None
                    if self.on_train is None
                    else lambda stage, step, steps, loss: self.on_train(setting.label, stage, step, steps, loss)
                )
                self.model, self.last_linearization = lin.linearize(
                    self.model,
                    train,
                    held_out,
                    self.config.linearize,
                    folder,
                    own=setting.variant == OWN,
                    on_step=on_step,
                )
            else:
                load_linearized(self.model, folder)
            self.changed = True
        return self.model


def run_session(session, on_cell=None, before: Callable[[int], None] | None = None, on_train=None) -> None:
    """Every cell of `session` (session.open_lm's LMSession) without a row, under the run's lock; `before(cells)` once the lock is held (`on_cell`
    is called for every cell, finished ones too; `on_train(label, stage, step, steps, loss)` after each
    step of a linearization)."""
    with RunLock(session.run_dir):
        done = (
            {row_key(r) for r in read_rows(session.run_dir, RESULTS, quiet=True)}
            if (session.run_dir / RESULTS).exists()
            else set()
        )
        if before is not None:
            before(len(cells(session.config)))
        with RowWriter(session.run_dir, RESULTS) as writer:
            run_lm(
                session.config,
                session.model,
                session.tokenizer,
                session.tokens,
                done,
                writer.append,
                on_cell,
                session.run_dir,
                on_train,
            )


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
