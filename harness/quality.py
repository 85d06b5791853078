"""Quality: train the same small decoder with each attention variant on copy and recall, and score it.

Every variant gets the same model size, steps, learning rate and data; only the attention differs.
`bench quality` sweeps tasks x variants x lengths; each evaluation row is appended to
RUN_DIR/quality.jsonl the moment it exists, so an interrupted run keeps what finished and
`--resume` retrains only the (task, variant, length) runs that had not finished.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import variants
from harness.config import BASELINE, QualityConfig, TrainConfig
from harness.storage import QUALITY_RESULTS, RowWriter, drop_torn_tail, read_rows, rewrite_rows
from harness.tasks import make_task

__all__ = ["TrainConfig", "TinyDecoder", "train_one", "sweep_quality", "trainable_variants", "cannot_train_reason"]


class TinyDecoder(nn.Module):
    """Token embedding + sinusoidal positions + pre-norm TransformerBlocks (causal) + LM head."""

    def __init__(self, vocab_size: int, cfg: TrainConfig, variant: str, max_len: int, **variant_options):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.pos = variants.SinusoidalPositionalEncoding(cfg.d_model, max_len)
        self.blocks = nn.ModuleList(
            variants.TransformerBlock(cfg.d_model, cfg.heads, 4 * cfg.d_model, variant=variant, norm="pre", **variant_options)
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        h = self.pos(self.embed(tokens))
        for block in self.blocks:
            h = block(h, causal=True)
        return self.head(self.norm(h))


def lr_factor(step: int, total: int, warmup_fraction: float) -> float:
    """Linear warm-up to 1, then cosine decay to 0."""
    warm = max(1, int(total * warmup_fraction))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


@torch.no_grad()
def evaluate(model: nn.Module, task, cfg: TrainConfig) -> dict:
    """Token accuracy (and exact match of whole answers) on a fixed held-out set, model in eval mode."""
    model.eval()
    g = torch.Generator().manual_seed(10_000 + cfg.seed)  # a stream of its own: never a training batch
    inputs, targets, mask = task.batch(cfg.eval_examples, g)
    pred = model(inputs).argmax(-1)
    right = (pred == targets) & mask
    model.train()
    return {
        "eval_accuracy": right.sum().item() / mask.sum().item(),
        "eval_exact_match": (right.sum(1) == mask.sum(1)).float().mean().item(),
    }


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite: the training is abandoned, not scored."""


def train_one(task_name: str, length: int, variant: str, options: dict, cfg: TrainConfig, on_eval=None) -> list[dict]:
    """Train one model; returns the rows (one per evaluation). on_eval(row) is called as each exists."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    task = make_task(task_name, length)
    model = TinyDecoder(task.vocab_size, cfg, variant, max_len=task.seq_len + 1, **options)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    g = torch.Generator().manual_seed(cfg.seed)
    rows, start, loss_sum, loss_count = [], time.perf_counter(), 0.0, 0
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(step - 1, cfg.steps, cfg.warmup)
        inputs, targets, mask = task.batch(cfg.batch, g)
        logits = model(inputs)
        loss = F.cross_entropy(logits[mask], targets[mask], label_smoothing=cfg.label_smoothing)
        if not torch.isfinite(loss):  # an accuracy after this would describe a broken model
            raise TrainingDiverged(f"{task_name} L={length} {variant}: the training loss became {loss.item()} at step {step} "
                                   f"(lr={cfg.lr}); no accuracy is reported for it")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row = {"task": task_name, "variant": variant, "options": options, "length": length, "step": step,
                   "final": step == cfg.steps, "train_loss": loss_sum / loss_count, **evaluate(model, task, cfg),
                   "wall_s": round(time.perf_counter() - start, 2), "parameters": params, **{f"cfg_{k}": v for k, v in asdict(cfg).items()}}
            loss_sum, loss_count = 0.0, 0
            rows.append(row)
            if on_eval:
                on_eval(row)
    return rows


# implementations of a function another variant already computes (tested equal to float precision):
# training them again would only repeat that variant's row
SAME_FUNCTION_AS = {"full_naive": BASELINE, "full_xformers": BASELINE}


def cannot_train_reason(name: str, device: str = "cpu") -> str | None:
    """Why variant `name` cannot train the (causal) decoder on `device`, or None."""
    cls = variants.variant_class(name)
    if not cls.spec.supports_causal:
        return f"{name} does not support causal attention, which the decoder needs"
    return cls.unavailable_reason(device) or cls.backward_unsupported_reason(device)


def trainable_variants(device: str = "cpu") -> list[str]:
    """Every registered variant that trains on `device` — one per attention function (`SAME_FUNCTION_AS`)."""
    return [name for name in variants.available() if name not in SAME_FUNCTION_AS and cannot_train_reason(name, device) is None]


def run_key(row: dict) -> tuple:
    return (row["task"], row["variant"], int(row["length"]))


def keep_finished_runs(run_dir: Path) -> set[tuple]:
    """Drop the rows of trainings that did not finish (they are redone whole); return the finished keys."""
    drop_torn_tail(run_dir, QUALITY_RESULTS)
    rows = read_rows(run_dir, QUALITY_RESULTS)
    finished = {run_key(r) for r in rows if r.get("final")}
    kept = [r for r in rows if run_key(r) in finished]
    if len(kept) != len(rows):
        rewrite_rows(run_dir, kept, QUALITY_RESULTS)
    return finished


def sweep_quality(run_dir: Path, config: QualityConfig, on_eval=None, on_start=None, finished: set[tuple] | None = None) -> list[dict]:
    """Train every (task, length, variant) not finished yet; rows are appended as they exist.

    finished: the result of `keep_finished_runs(run_dir)` when the caller already called it.
    """
    finished = keep_finished_runs(run_dir) if finished is None else finished
    options, cfg = config.options, config.train
    with RowWriter(run_dir, QUALITY_RESULTS) as writer:
        for task in config.tasks:
            for length in config.lengths:
                for name in config.variants:
                    if (task, name, length) in finished:
                        continue
                    if on_start:
                        on_start(task, length, name)

                    def record(row):
                        writer.append(row)
                        if on_eval:
                            on_eval(row)

                    train_one(task, length, name, variants.options_taken(name, options), cfg, on_eval=record)
    return read_rows(run_dir, QUALITY_RESULTS)
