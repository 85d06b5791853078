"""Linearizing a pretrained model (LoLCATs' recipe, Zhang et al. 2025): what a subquadratic attention keeps of
the model once it is trained the way people convert models, not swapped in zero-shot.

    recipe = Recipe(transfer_steps=200, lora_steps=300)
    record = linearize(model, train, held_out, recipe, folder)   # the model already switched by variants.hf.use

Stage 1, attention transfer: the model runs the training text with its own softmax attention (every layer's
variant output replaced by exact causal softmax of the same q, k, v, so each layer sees the original hidden
states); at each layer the variant's own parameters (feature maps, gates, the hybrid's window factor) are
trained on the mean squared difference between its output and the softmax output (the layers independent,
nothing back-propagated through the model). Stage 2, LoRA (`peft`): low-rank adapters on the attention's
q, k, v, o projections, trained on next-token loss with the variant in place (its own parameters frozen).
The adapters are then merged, and the model is saved with `save_pretrained` (the variant's parameters are
part of its state dict; `variants.hf.use` on the reloaded model restores them).

`sdpa` (the model's own attention) takes stage 2 alone: the control that tells what the same LoRA budget on
this text does to the model without any linearization.

The training text is the docstrings of the standard library's own sources (read with `ast`, nothing imported),
less every docstring that shares a run of OVERLAP words with the text perplexity is scored on (the pydoc
topics by default: pdb's docstrings repeat its documentation), or a file, which must share no such run. Training resumes from its last checkpoint (written every CHECKPOINT_S seconds): an interrupted
run loses at most that much work, and the time it reports is the training's own, summed over its sittings.
"""

from __future__ import annotations

import ast
import functools
import json
import sysconfig
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import variants.hf as vh
from harness.lm import distill as transfer
from harness.options import ArgumentError, read_text_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the projections LoRA adapts (LoLCATs: all four)
OVERLAP = (
    12  # words: a training text sharing a run this long with the scored text is refused (the default one is cleaned)
)
CHECKPOINT_S = 60.0  # seconds of training between checkpoints
HELD_OUT = 2  # training-text sequences held out (the errors and losses before and after each stage)
PEFT_INSTALL = "pip install -e '.[lm]'  (or: pip install peft)"
SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "pydoc_data",
    "site-packages",
    "turtledemo",
    "ensurepip",
    "tkinter",
    "venv",
    "__pycache__",
}  # of the standard library: tests, tools, and pydoc_data (the scored text)
MIN_DOCSTRING = 200  # characters: shorter docstrings are mostly signatures


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

    def to_json(self) -> dict:
        return asdict(self)


# -- the training text ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def stdlib_docstrings(avoid: str) -> str:
    """The docstrings (over MIN_DOCSTRING characters) of the standard library's modules, classes and functions,
    read from the source files with `ast` in path order (nothing is imported, so nothing runs), less those that
    share a run of OVERLAP words with `avoid` (the scored text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen = _runs(avoid)
    parts = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > MIN_DOCSTRING and _shared_run(doc, seen) is None:
                parts.append(doc)
    return "\n\n".join(parts)


def _runs(text: str) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + OVERLAP]) for i in range(max(0, len(words) - OVERLAP + 1))}


def _shared_run(text: str, seen: set) -> str | None:
    """The first run of OVERLAP words of `text` that is in `seen`, or None."""
    words = text.split()
    for i in range(len(words) - OVERLAP + 1):
        if tuple(words[i : i + OVERLAP]) in seen:
            return " ".join(words[i : i + OVERLAP])
    return None


def training_text(path: str | None, scored: str) -> str:
    """The training text: the file, or the standard library's docstrings that share nothing with `scored`."""
    return stdlib_docstrings(scored) if path is None else read_text_file(path, "--train-text")


def training_sequences(tokenizer, recipe: Recipe, scored: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(train (S, length), held out (HELD_OUT, length)): consecutive pieces of the training text, the last
    HELD_OUT held out. ArgumentError when the text holds fewer than HELD_OUT + 1 sequences."""
    ids = tokenizer(training_text(recipe.text, scored), add_special_tokens=False)["input_ids"]
    count = len(ids) // recipe.length
    where = recipe.text or "the standard library's docstrings"
    if count < HELD_OUT + 1:
        raise ArgumentError(
            f"--train-text: {where} holds {len(ids)} tokens, fewer than {HELD_OUT + 1} sequences of "
            f"--train-length {recipe.length}"
        )
    seqs = torch.tensor(ids[: count * recipe.length], dtype=torch.long).view(count, recipe.length)
    return seqs[:-HELD_OUT], seqs[-HELD_OUT:]


def check_disjoint(train: str, scored: str, where: str) -> None:
    """ArgumentError when the training text shares a run of OVERLAP words with the scored text: a model trained
    on what it is scored on would report a perplexity it did not earn."""
    run = _shared_run(train, _runs(scored))
    if run is not None:
        raise ArgumentError(
            f"--train-text: {where} shares a run of {OVERLAP} words with the text perplexity is scored "
            f"on (--text): {run[:120]!r}; train on a text disjoint from it"
        )


def check_projections(model) -> None:
    """ArgumentError naming a layer without the q, k, v, o projections LoRA adapts."""
    for path, layer in vh.attention_layers(model).items():
        missing = [name for name in TARGETS if not isinstance(getattr(layer, name, None), torch.nn.Linear)]
        if missing:
            raise ArgumentError(
                f"--lora: {type(model).__name__}.{path} ({type(layer).__name__}) has no "
                f"{', '.join(missing)} linear projection{'s' if len(missing) > 1 else ''} (LoRA adapts "
                f"{', '.join(TARGETS)}); use --lora 0 for attention transfer alone"
            )


def peft_module():
    try:
        import peft
    except ImportError:
        raise ArgumentError(f"--lora: LoRA needs the peft package: {PEFT_INSTALL}") from None
    return peft


# -- checkpoints ----------------------------------------------------------------------------------------------


class Checkpoint:
    """A linearization's progress in FOLDER/checkpoint.pt (written atomically): the stage, its step, the trained
    tensors, the optimizer, the seconds trained so far and what each finished stage measured."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / "checkpoint.pt"

    def load(self) -> dict | None:
        return torch.load(self.path, weights_only=False) if self.path.exists() else None

    def save(self, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_suffix(".part")
        torch.save(state, part)
        part.replace(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


# -- stage 1: attention transfer ------------------------------------------------------------------------------


def _variants(model) -> dict[str, torch.nn.Module]:
    return transfer._attached(model)


def _variant_parameters(model) -> list[torch.nn.Parameter]:
    return [p for m in _variants(model).values() for p in m.parameters()]


def attention_error(model, sequences: torch.Tensor) -> float:
    """Held-out error of the attached variants against the softmax: per layer MSE / the softmax output's mean
    square, averaged over the sequences and the layers (1.0: as far as predicting zero)."""
    errors: dict[str, list[float]] = {}

    def on_layer(path, module, q, k, v, target, causal):
        out = module.forward(q, k, v, causal=causal)  # (not module(...): its teacher hook would run again)
        errors.setdefault(path, []).append(float(F.mse_loss(out, target) / target.pow(2).mean()))

    with transfer.softmax_teacher(model, on_layer), torch.no_grad():
        for ids in sequences:
            model(ids[None], use_cache=False, logits_to_keep=1)
    return sum(sum(e) / len(e) for e in errors.values()) / len(errors)


def _transfer_step(model, ids: torch.Tensor) -> float:
    """One forward of the softmax model over `ids`; at every layer the variant's MSE against the softmax output,
    back-propagated into the variant's parameters only (each layer's graph freed at once). The mean loss."""
    losses = []
    layers = len(_variants(model))

    def on_layer(path, module, q, k, v, target, causal):
        with torch.enable_grad():
            loss = F.mse_loss(module.forward(q, k, v, causal=causal), target)
            (loss / layers).backward()
        losses.append(float(loss.detach()))

    with transfer.softmax_teacher(model, on_layer), torch.no_grad():
        model(ids[None], use_cache=False, logits_to_keep=1)
    return sum(losses) / len(losses)


# -- stage 2: LoRA --------------------------------------------------------------------------------------------


def next_token_loss(model, sequences: torch.Tensor) -> float:
    """Mean next-token cross-entropy over the sequences (nats a token)."""
    with torch.no_grad():
        return sum(
            float(model(input_ids=ids[None], labels=ids[None], use_cache=False).loss) for ids in sequences
        ) / len(sequences)


def _with_lora(model, rank: int):
    peft = peft_module()
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", target_modules=list(TARGETS))
    with warnings.catch_warnings():  # (transformers' deprecation of a name peft still reads)
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def _lora_state(wrapped) -> dict:
    state = peft_module().get_peft_model_state_dict(wrapped, save_embedding_layers=False)
    return {k: v.detach().clone() for k, v in state.items()}


# -- the whole recipe -----------------------------------------------------------------------------------------


def _stage_loop(
    step_fn,
    optimizer,
    params,
    steps: int,
    start: int,
    seconds: float,
    losses: list,
    save: Callable,
    on_step: Callable | None,
    clip: float | None = None,
) -> float:
    """Steps start .. steps - 1 of one stage; a checkpoint every CHECKPOINT_S seconds of training. Returns the
    stage's seconds (those of earlier sittings included)."""
    began, last_save = time.perf_counter(), time.perf_counter()
    for step in range(start, steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_fn(step))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        if on_step:
            on_step(step + 1, steps, losses[-1])
        if time.perf_counter() - last_save >= CHECKPOINT_S and step + 1 < steps:
            save(step + 1, seconds + time.perf_counter() - began)
            last_save = time.perf_counter()
    return seconds + time.perf_counter() - began


def linearize(
    model,
    train: torch.Tensor,
    held_out: torch.Tensor,
    recipe: Recipe,
    folder: Path,
    own: bool = False,
    on_step: Callable | None = None,
) -> tuple[object, dict]:
    """Linearize `model` (already switched to its variant by variants.hf.use; `own`: its own sdpa, LoRA only) by
    `recipe` on the training sequences, resuming from FOLDER/checkpoint.pt, and save it to FOLDER/model.
    Returns (the model, with the adapters merged; the record of the run's `linearize` row)."""
    folder = Path(folder)
    checkpoint = Checkpoint(folder)
    saved = checkpoint.load() or {}
    record = saved.get("record", {"transfer": None, "lora": None})
    for p in model.parameters():
        p.requires_grad_(False)
    if saved.get("variant_state"):
        transfer.load_attached_state(model, saved["variant_state"])

    # stage 1
    if not own and record["transfer"] is None and recipe.transfer_steps:
        params = _variant_parameters(model)
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, lr=recipe.transfer_lr, weight_decay=0.0)
        resumed = saved.get("stage") == "transfer"
        if resumed:
            optimizer.load_state_dict(saved["optimizer"])
        before = saved["error_before"] if resumed else attention_error(model, held_out)
        losses = list(saved["losses"]) if resumed else []

        def save(step, seconds):
            checkpoint.save(
                {
                    "stage": "transfer",
                    "step": step,
                    "seconds": seconds,
                    "losses": losses,
                    "error_before": before,
                    "variant_state": transfer.attached_state(model),
                    "optimizer": optimizer.state_dict(),
                    "record": record,
                }
            )

        seconds = _stage_loop(
            lambda step: _transfer_step(model, train[step % len(train)]),
            optimizer,
            params,
            recipe.transfer_steps,
            saved.get("step", 0) if resumed else 0,
            saved.get("seconds", 0.0) if resumed else 0.0,
            losses,
            save,
            None if on_step is None else lambda s, n, loss: on_step("attention transfer", s, n, loss),
        )
        for p in params:
            p.requires_grad_(False)
        record["transfer"] = {
            "steps": recipe.transfer_steps,
            "lr": recipe.transfer_lr,
            "tokens": recipe.transfer_steps * recipe.length,
            "parameters": sum(p.numel() for p in params),
            "seconds": seconds,
            "losses": losses,
            "error_before": before,
            "error_after": attention_error(model, held_out),
        }
        saved = {"variant_state": transfer.attached_state(model), "record": record}
        checkpoint.save(saved)

    # stage 2
    if record["lora"] is None and recipe.lora_steps:
        wrapped = _with_lora(model, recipe.lora_rank)
        params = [p for p in wrapped.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=recipe.lora_lr, weight_decay=0.0)
        resumed = saved.get("stage") == "lora"
        if resumed:
            peft_module().set_peft_model_state_dict(wrapped, saved["lora_state"])
            optimizer.load_state_dict(saved["optimizer"])
        before = saved["nll_before"] if resumed else next_token_loss(wrapped, held_out)
        losses = list(saved["losses"]) if resumed else []
        variant_state = saved.get("variant_state")

        def save(step, seconds):
            checkpoint.save(
                {
                    "stage": "lora",
                    "step": step,
                    "seconds": seconds,
                    "losses": losses,
                    "nll_before": before,
                    "variant_state": variant_state,
                    "lora_state": _lora_state(wrapped),
                    "optimizer": optimizer.state_dict(),
                    "record": record,
                }
            )

        def lora_step(step):
            ids = train[step % len(train)][None]
            loss = wrapped(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return float(loss.detach())

        seconds = _stage_loop(
            lora_step,
            optimizer,
            params,
            recipe.lora_steps,
            saved.get("step", 0) if resumed else 0,
            saved.get("seconds", 0.0) if resumed else 0.0,
            losses,
            save,
            None if on_step is None else lambda s, n, loss: on_step("LoRA", s, n, loss),
            clip=1.0,
        )
        after = next_token_loss(wrapped, held_out)
        record["lora"] = {
            "steps": recipe.lora_steps,
            "lr": recipe.lora_lr,
            "rank": recipe.lora_rank,
            "tokens": recipe.lora_steps * recipe.length,
            "parameters": sum(p.numel() for p in params),
            "seconds": seconds,
            "losses": losses,
            "nll_before": before,
            "nll_after": after,
        }
        model = wrapped.merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(False)
    save_dequantized(model, folder / "model")
    (folder / "linearized.json").write_text(json.dumps(record))
    checkpoint.remove()
    return model, row_of(record, folder)


def save_dequantized(model, folder: Path) -> None:
    """`save_pretrained` of a model whose weights are plain floats, also one loaded from a GGUF file (transformers
    marks it quantized, and refuses to save it, although it dequantized every weight on loading): the mark is lifted
    while it saves, so the checkpoint reloads as an ordinary float model."""
    quantizer = getattr(model, "hf_quantizer", None)
    config = model.config.__dict__.pop("quantization_config", None)
    try:
        model.hf_quantizer = None
        model.save_pretrained(folder)
    finally:
        model.hf_quantizer = quantizer
        if config is not None:
            model.config.quantization_config = config


def row_of(record: dict, folder: Path) -> dict:
    """The `linearize` row's fields: each stage's record with its first and last losses (means of up to 10
    steps), the training's seconds and tokens in all, where the model was saved."""
    out = {}
    for stage in ("transfer", "lora"):
        data = record.get(stage)
        if data:
            losses = data["losses"]
            window = max(1, min(10, len(losses) // 2))
            data = {**data, "loss_first": sum(losses[:window]) / window, "loss_last": sum(losses[-window:]) / window}
        out[stage] = data
    stages = [s for s in out.values() if s]
    return {
        **out,
        "seconds": sum(s["seconds"] for s in stages),
        "tokens": sum(s["tokens"] for s in stages),
        "saved": str(Path(folder) / "model"),
    }


def summary_of(folder: Path) -> dict:
    """The row of a linearization that finished (saved) before its row was written."""
    return row_of(finished(folder), folder)


def finished(folder: Path) -> dict | None:
    """The record of a linearization saved in FOLDER, or None while it has not finished."""
    marker = Path(folder) / "linearized.json"
    return json.loads(marker.read_text()) if marker.exists() and (Path(folder) / "model").is_dir() else None


def load_linearized(model, folder: Path) -> None:
    """Put a saved linearization's weights (merged projections, the variant's parameters) into `model`, already
    switched to the same attention (variants.hf.use with the same variant and options, or its own sdpa)."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted((Path(folder) / "model").glob("*.safetensors")):
        state.update(load_file(file))
    missing = [
        name for name in state if name not in dict(model.named_parameters()) and name not in dict(model.named_buffers())
    ]
    if missing:
        raise ValueError(
            f"{folder}: the saved model holds {missing[0]}, which this model has not (saved with another "
            f"variant or options)"
        )
    model.load_state_dict(state, strict=False)
