"""What a `bench lm` run is, torch-free: its settings (an attention and how it was trained), its
configuration, the tasks and their constants, and the cells it measures in order."""

from __future__ import annotations

import itertools
import math
import random
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from harness.store.storage import LM_RESULTS

OWN = "sdpa"  # the model's own attention, measured beside the variants

TASKS = ("perplexity", "passkey", "ruler", "cost", "decode")

RULER_SUBTASKS = ("multikey", "multivalue", "vartrack")  # --tasks ruler: each a row task "ruler:<name>" (ruler.py)
RULER_NEW_TOKENS = 48  # the most greedy tokens a RULER answer generates (ruler.NEW_TOKENS)

DEFAULT_TASKS = ("perplexity", "passkey", "cost")  # (decode: asked for by name, its own timed run)

KV_MODES = ("aware", "agnostic")  # the question inside the compressed prompt, or appended after compression
KV_RATIOS = (0.25, 0.5, 0.75, 0.875)  # kvpress's leaderboard: the fraction of the prompt's positions removed
KV_TASKS = {"passkey": "kv:passkey", "perplexity": "kv:continuation"}  # (ruler: "kv:ruler:<subtask>")
FULL_CACHE = "full cache"  # the KV sweep's baseline: the exact cache of the same prefill, nothing removed
CONTINUATION = 256  # a window's last tokens: its first L - 256 are compressed, these fed after and scored

DECODE_STEPS = 16  # generated tokens timed after the prompt (the median is the per-token time)

SCORED = 128  # tokens scored at the end of every context (runs made before SCORED_FROM)

SCORED_FROM = 0.5  # perplexity scores every token of a window's second half: each has at least L / 2 of context

PASSKEY_DIGITS = 6  # a passkey has 5 or 6 digits
PASSKEY_EXTRA_TOKENS = 4  # greedy tokens generated past the key's digits (spaces, punctuation around the answer)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "  # (RULER's too)


def tokens_after_prompt(task: str) -> int:
    """Tokens a task feeds the model after its prompt: decode's timed steps; a generated answer's tokens but the
    last, which is never fed back (passkey, RULER)."""
    if task == "decode":
        return DECODE_STEPS
    if task == "passkey":
        return PASSKEY_DIGITS + PASSKEY_EXTRA_TOKENS - 1
    return RULER_NEW_TOKENS - 1 if task == "ruler" else 0


def shortest_length(task: str) -> int:
    """The shortest context a task measures anything in: perplexity's first token has no prefix to be predicted
    from, so it scores a token only from L = 2 on."""
    return 2 if task == "perplexity" else 1


COST_REPEATS, COST_MIN_S = 7, 3.0  # a forward's timed samples: at most 7, or 3 once this many seconds were timed

DISTILL_MAX_LENGTH = 512  # tokens a distillation sequence (or the run's shortest length)
RESULTS = LM_RESULTS

LINEARIZED_LABEL, LORA_LABEL = (
    " + linearized",
    " + LoRA",
)  # a linearized attention's label; the model's own with LoRA alone

LINEARIZED_DIR = "linearized"  # RUN_DIR/linearized/<attention>/: checkpoints and the saved models


@dataclass(frozen=True)
class Recipe:
    """How a model is linearized (the defaults are LoLCATs' where the CPU allows)."""

    transfer_steps: int  # stage 1: attention-transfer steps (one training sequence a step, all layers at once)
    lora_steps: int = 0  # stage 2: LoRA steps (0: stage 1 only)
    transfer_lr: float = 1e-2  # LoLCATs' stage-1 rate (AdamW, no weight decay)
    lora_lr: float = 1e-4  # LoLCATs' stage-2 rate
    lora_rank: int = 8  # r (alpha = 2r, LoLCATs' 8 and 16)
    length: int = 1024  # tokens a training sequence (LoLCATs packs Alpaca into 1024-token chunks)
    text: str | None = None  # a training text file; None: the standard library's docstrings
    position_offsets: int = 0  # each training sequence starts at a position drawn from 0 .. this (0: at 0)
    accumulate: int = 1  # sequences an optimizer step, their gradients summed (LoLCATs' stage 1: 8)
    eval_every: int = 0  # stage 1's held-out error every this many steps, the plateau schedule (linearize.py); 0: off

    def sequences(self, step: int) -> range:
        """The indices of the training sequences optimizer step `step` reads (`accumulate` of them, in order)."""
        return range(step * self.accumulate, (step + 1) * self.accumulate)

    def to_json(self) -> dict:
        return asdict(self)

    def start_position(self, sequence: int) -> int:
        """Where training sequence number `sequence` starts: uniform over 0 .. position_offsets, drawn from a
        generator seeded by the number (a resumed run draws the same); 0 without offsets."""
        if not self.position_offsets:
            return 0
        return random.Random(sequence).randint(0, self.position_offsets)


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
    linearize: Recipe | None = None  # --linearize: the recipe each variant with parameters is also measured after
    # perplexity: every token from position ⌊scored_from · L⌋ on is scored; None (runs made before): the last
    # min(SCORED, L // 2) tokens of each window
    scored_from: float | None = None
    scored_tokens: int = 0  # with windows 0: windows enough to score this many tokens at each length
    # passkey and RULER prompts leave room inside L for their answer (RULER's convention: L counts the tokens to
    # generate), so L = the model's context runs; False (runs made before): prompts of L tokens, the answer past them
    answer_inside: bool = False
    # --kv-policy: the KV-cache policies (variants/kvcache/) swept on one exact prefill per prompt, at each ratio
    # and mode; their rows' tasks start "kv:" (harness/lm/kv.py)
    kv_policies: tuple[str, ...] = ()
    ratios: tuple[float, ...] = KV_RATIOS
    kv_modes: tuple[str, ...] = KV_MODES

    def prompt_length(self, task: str, length: int) -> int:
        """Tokens of a task's prompt at length L: L, less the answer's room where the answer fits inside L."""
        inside = self.answer_inside and task in ("passkey", "ruler")
        return length - tokens_after_prompt(task) if inside else length

    def positions_needed(self, task: str, length: int) -> int:
        """Positions a task takes in the model at length L: its prompt and every token fed after it."""
        return self.prompt_length(task, length) + tokens_after_prompt(task)

    def first_scored(self, length: int) -> int:
        """The position of a window's first scored token (>= 1: the first token has no prefix to predict it)."""
        if self.scored_from is None:
            return length - min(SCORED, length // 2)
        return max(1, int(length * self.scored_from))

    def windows_at(self, length: int) -> int:
        """Windows of the text scored at `length`: `windows`, or (0) enough to score `scored_tokens`."""
        if self.windows:
            return self.windows
        return math.ceil(self.scored_tokens / (length - self.first_scored(length)))

    def to_json(self) -> dict:
        """The configuration as metadata.json keeps it; a setting's options as [name, value] pairs in the
        command line's order (its label's), which the file's sorted keys would lose."""
        data = asdict(self)
        data["settings"] = [{**asdict(s), "options": [list(kv) for kv in s.options.items()]} for s in self.settings]
        return data

    @classmethod
    def from_json(cls, data: dict, labels: Callable[[], set[str]] = set) -> "LMConfig":
        """From metadata.json's "config". Runs written before options were kept as pairs hold them as a dict
        sorted by name: a setting with two or more takes the order of the row label naming it among `labels()`
        (the run's rows, read only then)."""
        data = dict(data)
        legacy = [isinstance(s.get("options"), dict) and len(s["options"]) > 1 for s in data["settings"]]
        bases = {label.split(" + ")[0] for label in labels()} if any(legacy) else set()
        settings = []
        for stored, old in zip(data["settings"], legacy):
            options = dict(stored.get("options") or {})
            setting = Setting(stored["variant"], options, int(stored.get("distill", 0)), bool(stored.get("linearized")))
            settings.append(_labelled(setting, bases) if old else setting)
        data["settings"] = tuple(settings)
        if data.get("linearize"):
            data["linearize"] = Recipe(**data["linearize"])
        for key in ("lengths", "depths", "tasks", "kv_policies", "ratios", "kv_modes"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)


def _labelled(setting: Setting, bases: set[str]) -> Setting:
    """`setting` with its options in the order of the base label in `bases` that names them in another order."""
    for order in itertools.permutations(setting.options):
        twin = replace(setting, options={name: setting.options[name] for name in order})
        if twin.base_label in bases:
            return twin
    return setting


def row_key(row: dict) -> tuple:
    return (row["task"], row["setting"], int(row["length"]), row.get("window"), row.get("depth"), row.get("key_index"))


def distill_length(config: LMConfig) -> int:
    """Tokens in each sequence attention transfer trains on: the run's shortest length, at most 512."""
    return min(DISTILL_MAX_LENGTH, min(config.lengths))


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
                out.append(("linearize", setting.label, config.linearize.length, None, None, None))
            if "perplexity" in config.tasks:
                out += [("perplexity", setting.label, length, w, None, None) for w in range(config.windows_at(length))]
            if "passkey" in config.tasks:
                out += [
                    ("passkey", setting.label, length, None, d, i) for d in config.depths for i in range(config.keys)
                ]
            if "ruler" in config.tasks:
                out += [
                    ("ruler:" + t, setting.label, length, None, None, i)
                    for t in RULER_SUBTASKS
                    for i in range(config.keys)
                ]
            if "cost" in config.tasks:
                out.append(("cost", setting.label, length, None, None, None))
            if "decode" in config.tasks:
                out.append(("decode", setting.label, length, None, None, None))
        out += kv_cells(config, length)
    return out


def kv_label(policy: str, ratio: float, mode: str) -> str:
    return f"{policy} {ratio:g} {mode}"


def kv_branches(config: LMConfig, task: str) -> list[tuple[str, str | None, float, str]]:
    """(label, policy, ratio, mode) of every branch of one prompt's prefill: the full cache, then each policy at
    each ratio in each mode (a continuation has no question: compressed before it, "agnostic" only)."""
    modes = ("agnostic",) if task == KV_TASKS["perplexity"] else config.kv_modes
    return [(FULL_CACHE, None, 0.0, "-")] + [
        (kv_label(p, r, m), p, r, m) for m in modes for p in config.kv_policies for r in config.ratios
    ]


def kv_cells(config: LMConfig, length: int) -> list[tuple]:
    """The KV sweep's cells at `length`, prompt by prompt (each prompt's branches together: one prefill serves
    them); continuation windows: `keys` of them."""
    if not config.kv_policies:
        return []
    prompts = []
    if "passkey" in config.tasks:
        prompts += [(KV_TASKS["passkey"], None, d, i) for d in config.depths for i in range(config.keys)]
    if "ruler" in config.tasks:
        prompts += [("kv:ruler:" + t, None, None, i) for t in RULER_SUBTASKS for i in range(config.keys)]
    if "perplexity" in config.tasks:
        prompts += [(KV_TASKS["perplexity"], w, None, None) for w in range(config.keys)]
    return [
        (task, label, length, window, depth, index)
        for task, window, depth, index in prompts
        for label, *_ in kv_branches(config, task)
    ]


def slug(label: str) -> str:
    """A folder name for an attention's label: letters, digits, '.', '_' and '-' (the rest become '-')."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", label).strip("-")
