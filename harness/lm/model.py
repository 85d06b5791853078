"""The model and the text of a `bench lm` run: loading the GGUF checkpoint, the corpus, and switching the
model from one attention to the next (distilled or linearized ones trained the first time)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
from pathlib import Path

import torch

import variants.hf as vh
from harness.lm import distill as transfer
from harness.lm import linearize as lin
from harness.lm.checkpoints import finished, load_linearized
from harness.lm.config import INSTALL, LINEARIZED_DIR, OWN, LMConfig, Setting, distill_length, slug
from harness.lm.stages import TARGETS
from harness.lm.training_text import training_sequences
from harness.options import ArgumentError, read_text_file


def load(folder: Path, gguf: str | None, threads: int = 0):
    """(model in float32 with its own sdpa attention, eval mode; tokenizer). ArgumentError when it is not a
    causal LM or does not load."""
    import transformers

    if threads:
        torch.set_num_threads(threads)
    where = folder / gguf if gguf else folder
    if gguf:
        missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
        if missing:
            raise ArgumentError(f"--model {where}: loading a GGUF file needs {' and '.join(missing)}: {INSTALL}")
    kwargs = {"gguf_file": gguf} if gguf else {}
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # (the GGUF dequantization's bar, inside bench lm's own)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, **kwargs)
        if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ArgumentError(f"--model {where}: a {type(config).__name__[:-6]} model, not a causal language model")
        with contextlib.redirect_stderr(
            io.StringIO()
        ):  # (the GGUF loader's own tqdm bar, which ignores transformers' switch)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="sdpa", **kwargs
            )
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
        both_ways = [
            path
            for path, layer in vh.attention_layers(model).items()
            if getattr(layer, "is_causal", True) is False and not vh.is_cross_attention(path, layer)
        ]
        if both_ways:
            raise ArgumentError(
                f"--model {where}: not a causal language model: {type(model).__name__}'s attention layers "
                f"are bidirectional ({both_ways[0]}: an encoder's, e.g. BERT without is_decoder)"
            )
    except ArgumentError:
        raise
    except Exception as err:  # a file that is not a model, a format transformers cannot read
        raise ArgumentError(
            f"--model {where}: does not load as a causal language model ({type(err).__name__}: {str(err)[:200]})"
        ) from None
    return model.eval(), tokenizer


def model_hash(folder: Path, gguf: str | None) -> str:
    """sha256 of the GGUF file, or of the checkpoint's weight files (what the run's numbers come from)."""
    digest = hashlib.sha256()
    files = (
        [folder / gguf]
        if gguf
        else sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    )
    for path in files:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(2**20), b""):
                digest.update(block)
    return digest.hexdigest()


def corpus_text(text: str | None) -> str:
    """The text perplexity is measured on: a file, or the standard library's pydoc topics (every Python has them)."""
    if text is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics))
    return read_text_file(text, "--text")


def corpus_tokens(tokenizer, text: str | None) -> torch.Tensor:
    return torch.tensor(tokenizer(corpus_text(text), add_special_tokens=False)["input_ids"], dtype=torch.long)


def text_hash(text: str | None) -> str:
    return hashlib.sha256(corpus_text(text).encode()).hexdigest()


# -- switching from one attention to the next --------------------------------------------------------------


def switch(model, setting: Setting, seed: int):
    """The model with `setting`'s attention: its own sdpa, or the variant (parameters drawn from the seed)."""
    if setting.variant == OWN:
        model.set_attn_implementation("sdpa")
        return model
    torch.manual_seed(seed)
    return vh.use(model, setting.variant, reinit=True, **setting.options)


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
                train, held_out = training_sequences(self.tokenizer, self.config.recipe, corpus_text(self.config.text))
                on_step = (
                    None
                    if self.on_train is None
                    else lambda stage, step, steps, loss: self.on_train(setting.label, stage, step, steps, loss)
                )
                self.model, self.last_linearization = lin.linearize(
                    self.model, train, held_out, self.config.recipe, folder, own=setting.variant == OWN, on_step=on_step
                )
            else:
                load_linearized(self.model, folder)
            self.changed = True
        return self.model


def with_linearized(config: LMConfig, model) -> tuple[LMConfig, list[str]]:
    """With --linearize: each attention whose variant has parameters of its own followed by its linearized twin,
    and the model's own sdpa by its LoRA-only control (when the recipe has LoRA steps); also the labels of those
    with nothing to linearize (no parameters of their own: evaluated zero-shot only)."""
    recipe = config.recipe
    if recipe is None:
        return config, []
    settings, nothing = [], []
    for setting in config.settings:
        settings.append(setting)
        if setting.linearized or setting.distill:
            continue
        if setting.variant == OWN:
            if recipe.lora_steps:
                settings.append(Setting(OWN, linearized=True))
            continue
        switch(model, setting, config.seed)
        if transfer.trainable_parameters(model):
            settings.append(Setting(setting.variant, setting.options, linearized=True))
        else:
            nothing.append(setting.label)
    switch(model, Setting(OWN), config.seed)
    return LMConfig(**{**config.__dict__, "settings": tuple(settings)}), nothing


def with_distilled(config: LMConfig, model) -> tuple[LMConfig, list[str]]:
    """With --distill: each attention whose variant has parameters of its own followed by its distilled twin;
    also the labels of those with nothing to train (evaluated as they are)."""
    if not config.distill:
        return config, []
    settings, nothing = [], []
    for setting in config.settings:
        settings.append(setting)
        if setting.variant == OWN or setting.distill:
            continue
        switch(model, setting, config.seed)
        if transfer.trainable_parameters(model):
            settings.append(Setting(setting.variant, setting.options, config.distill))
        else:
            nothing.append(setting.label)
    switch(model, Setting(OWN), config.seed)
    return LMConfig(**{**config.__dict__, "settings": tuple(settings)}), nothing
