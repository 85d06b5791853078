"""Linearizing a pretrained model (LoLCATs' recipe, Zhang et al. 2025): what a subquadratic attention keeps of
the model once it is trained the way people convert models, not swapped in zero-shot.

    recipe = Recipe(transfer_steps=200, lora_steps=300)
    record = linearize(model, train, held_out, recipe, folder)   # the model already switched by variants.hf.use

Stage 1, attention transfer: each layer's variant trained on the softmax output of the same q, k, v (the model
runs on softmax, so each layer sees the original hidden states). Stage 2, LoRA: adapters on q, k, v, o trained
on next-token loss with the variant in place (stages.py). The adapters are merged and the model saved with
`save_pretrained`; `sdpa` takes stage 2 alone, the control for what LoRA on this text does by itself.
The text: training_text.py. Training resumes from its last checkpoint (every CHECKPOINT_S seconds): an
interrupted run loses at most that much, and reports the training's own time summed over its sittings.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from harness.lm import distill as transfer
from harness.lm.checkpoints import Checkpoint, row_of, save_dequantized
from harness.lm.config import Recipe
from harness.lm.stages import (
    attention_error,
    error_by_position,
    older_shares,
    lora_state,
    next_token_loss,
    peft_module,
    positions,
    transfer_step,
    variant_parameters,
    with_lora,
)

CHECKPOINT_S = 60.0  # seconds of training between checkpoints
# --eval-every: the rate times PLATEAU_FACTOR after PLATEAU_PATIENCE evaluations without a new best, down to
# PLATEAU_MIN_LR (LoLCATs' stage-1 reduce_lr_on_plateau), the best evaluated state kept at the end
PLATEAU_FACTOR, PLATEAU_PATIENCE, PLATEAU_MIN_LR = 0.1, 10, 1e-5


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
    after: Callable | None = None,
) -> float:
    """Steps start .. steps - 1 of one stage (`after(steps done)` once each step is taken); a checkpoint every
    CHECKPOINT_S seconds of training. Returns the stage's seconds (those of earlier sittings included)."""
    began, last_save = time.perf_counter(), time.perf_counter()
    for step in range(start, steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_fn(step))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        if after:
            after(step + 1)
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
        params = variant_parameters(model)
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, lr=recipe.transfer_lr, weight_decay=0.0)
        resumed = saved.get("stage") == "transfer"
        if resumed:
            optimizer.load_state_dict(saved["optimizer"])
        before = saved["error_before"] if resumed else attention_error(model, held_out)
        losses = list(saved["losses"]) if resumed else []
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=PLATEAU_FACTOR, patience=PLATEAU_PATIENCE, min_lr=PLATEAU_MIN_LR
        )
        start = transfer.attached_state(model) if recipe.eval_every else None
        best = {"evals": [], "error": before, "step": 0, "state": start}  # (the start counts: step 0)
        if resumed and "plateau" in saved:
            plateau.load_state_dict(saved["plateau"])
            best = saved["best"]

        def evaluate(done):  # --eval-every: the held-out error, the plateau schedule, the best state
            if not recipe.eval_every or done % recipe.eval_every:
                return
            error = attention_error(model, held_out)
            best["evals"].append([done, error, optimizer.param_groups[0]["lr"]])
            plateau.step(error)
            if error < best["error"]:
                best.update(error=error, step=done, state=transfer.attached_state(model))

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
                    "plateau": plateau.state_dict(),
                    "best": best,
                    "record": record,
                }
            )

        seconds = _stage_loop(
            lambda step: (
                sum(
                    transfer_step(model, train[i % len(train)], recipe.start_position(i), 1 / recipe.accumulate)
                    for i in recipe.sequences(step)
                )
                / recipe.accumulate
            ),
            optimizer,
            params,
            recipe.transfer_steps,
            saved.get("step", 0) if resumed else 0,
            saved.get("seconds", 0.0) if resumed else 0.0,
            losses,
            save,
            None if on_step is None else lambda s, n, loss: on_step("attention transfer", s, n, loss),
            after=evaluate,
        )
        if recipe.eval_every and best["step"] != recipe.transfer_steps:  # the best evaluated state, not the last
            transfer.load_attached_state(model, best["state"])
        for p in params:
            p.requires_grad_(False)
        context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        record["transfer"] = {
            "steps": recipe.transfer_steps,
            "lr": recipe.transfer_lr,
            "tokens": recipe.transfer_steps * recipe.accumulate * recipe.length,
            "accumulate": recipe.accumulate,
            "position_offsets": recipe.position_offsets,
            "parameters": sum(p.numel() for p in params),
            "seconds": seconds,
            "losses": losses,
            "error_before": before,
            "error_after": attention_error(model, held_out),
            "error_by_position": error_by_position(model, held_out, context),
            # (the training text's last tokens: the held-out sequences and those before them)
            "older_share": older_shares(model, torch.cat([train.flatten(), held_out.flatten()]), context),
            "eval_every": recipe.eval_every,
            "evals": best["evals"],  # [step, held-out error, learning rate before the schedule's step]
            "kept_step": best["step"] if recipe.eval_every else recipe.transfer_steps,
        }
        saved = {"variant_state": transfer.attached_state(model), "record": record}
        checkpoint.save(saved)

    # stage 2
    if record["lora"] is None and recipe.lora_steps:
        wrapped = with_lora(model, recipe.lora_rank)
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
                    "lora_state": lora_state(wrapped),
                    "optimizer": optimizer.state_dict(),
                    "record": record,
                }
            )

        def lora_step(step):
            total = 0.0
            for i in recipe.sequences(step):  # (gradients summed over the step's sequences)
                ids = train[i % len(train)][None]
                at = positions(ids, recipe.start_position(i))
                loss = wrapped(input_ids=ids, position_ids=at, labels=ids, use_cache=False).loss
                (loss / recipe.accumulate).backward()
                total += float(loss.detach())
            return total / recipe.accumulate

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
            "tokens": recipe.lora_steps * recipe.accumulate * recipe.length,
            "accumulate": recipe.accumulate,
            "position_offsets": recipe.position_offsets,
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
