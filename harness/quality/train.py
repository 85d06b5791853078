"""Quality: train the same small decoder with each attention variant on copy and recall, and score it.

Every variant gets the same model size, steps, learning rate and data; only the attention differs.
`bench quality` sweeps tasks x variants x lengths; each evaluation row is appended to
RUN_DIR/quality.jsonl the moment it exists, so an interrupted run keeps what finished and
`--resume` retrains only the (task, variant, length) runs that had not finished.

The model and which variants it takes: model.py; a run's trainings in order: plan.py and sweep.py.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from harness.core.timing import measure_time
from harness.core.calls import set_threads
from harness.core.memory import measure_peak, pin_mmap_threshold
from harness.quality.config import TrainConfig
from harness.quality.kept_models import model_facts, save_model
from harness.quality.model import decoder, decoding_state, resolved_options
from harness.quality.tasks import distance_buckets, make_task


def lr_factor(step: int, total: int, warmup_fraction: float) -> float:
    """Linear warm-up to 1, then cosine decay to 0."""
    warm = max(1, int(total * warmup_fraction))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


EVAL_TOKENS = 32_768  # tokens per evaluation forward: the held-out set is scored in chunks of this size


@torch.no_grad()
def evaluate(model: nn.Module, task, seed: int, cfg: TrainConfig, device: torch.device, autocast) -> dict:
    """Token accuracy, exact match of whole answers, and accuracy by distance, on a fixed held-out set."""
    model.eval()
    g = torch.Generator().manual_seed(10_000 + seed)  # a stream of its own: never a training batch
    sample = task.sample(cfg.eval_examples, g)
    chunk = max(1, EVAL_TOKENS // sample.inputs.shape[1])
    with autocast():  # the predictions at the scored positions only
        scored = [
            model(x.to(device), m.to(device)).argmax(-1).cpu()
            for x, m in zip(sample.inputs.split(chunk), sample.mask.split(chunk))
        ]
    model.train()
    pred = torch.full_like(sample.targets, -1)
    pred[sample.mask] = torch.cat(scored)
    right = (pred == sample.targets) & sample.mask
    return {
        "eval_accuracy": right.sum().item() / sample.mask.sum().item(),
        "eval_exact_match": (right.sum(1) == sample.mask.sum(1)).float().mean().item(),
        "by_distance": distance_buckets(sample.distance, pred == sample.targets, sample.mask),
    }


def longer_tasks(task_name: str, task, length: int, cfg: TrainConfig) -> list:
    """The task at each factor f of cfg.extrapolate: f·L, with the vocabulary and the pairs trained on."""
    pairs = getattr(task, "num_pairs", None)
    return [
        make_task(task_name, f * length, vocab=task.symbols, pairs=pairs, queries=cfg.queries) for f in cfg.extrapolate
    ]


def extrapolated(model: nn.Module, task_name: str, task, length: int, seed: int, cfg: TrainConfig, dev, autocast):
    """The trained model's accuracy at each factor f of cfg.extrapolate: the same task at f·L, with the
    vocabulary and the pairs it trained on (recall: the extra length is more places after the bindings, so
    answers lie farther back), on a held-out set of its own; never trained there. One dict per factor."""
    out = []
    for factor, longer in zip(cfg.extrapolate, longer_tasks(task_name, task, length, cfg)):
        scores = evaluate(model, longer, seed, cfg, dev, autocast)
        out.append(
            {
                "factor": factor,
                "length": factor * length,
                "seq_len": longer.seq_len,
                "eval_accuracy": scores["eval_accuracy"],
                "eval_exact_match": scores["eval_exact_match"],
            }
        )
    return out


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite: the training is abandoned, not scored."""


def precision(device: torch.device, dtype: str):
    """The training's precision: float32, or bfloat16 autocast (CUDA)."""
    enabled = dtype == "bfloat16"
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def _task(task_name: str, length: int, cfg: TrainConfig):
    return make_task(task_name, length, vocab=cfg.vocab, pairs=cfg.pairs, queries=cfg.queries)


def masked_loss(model, inputs, targets, mask, autocast, label_smoothing: float = 0.0):
    """Cross-entropy on the scored positions (the forward under the training's precision, the loss in float32)."""
    with autocast():
        logits = model(inputs, mask)  # (scored positions, vocab)
    return F.cross_entropy(logits.float(), targets[mask], label_smoothing=label_smoothing)


class FixedSet:
    """A task's fixed training set (cfg.train_examples sequences, drawn once), served in shuffled epochs as the
    task's own `batch` would serve fresh ones: Zoology trains on 100,000 examples for its epochs."""

    def __init__(self, task, examples: int, seed: int):
        self.task, self.seq_len = task, task.seq_len
        self.data = task.sample(examples, torch.Generator().manual_seed(20_000 + seed))[:3]  # (never the held-out set)
        self.order, self.at = torch.empty(0, dtype=torch.long), 0

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.at + size > len(self.order):  # a new epoch, in a new order (its last partial batch dropped)
            self.order, self.at = torch.randperm(len(self.data[0]), generator=generator), 0
        rows = self.order[self.at : self.at + size]
        self.at += size
        return tuple(t[rows] for t in self.data)


def _steps(model, opt, task, cfg: TrainConfig, steps: int, g, dev, autocast, what: str):
    """Train `steps` steps on batches of `task` (or of its `FixedSet`; warm-up then cosine schedule over them);
    yields (step, loss)."""
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(step - 1, steps, cfg.warmup)
        inputs, targets, mask = (t.to(dev) for t in task.batch(cfg.batch_at(task.seq_len), g))
        loss = masked_loss(model, inputs, targets, mask, autocast, cfg.label_smoothing)
        if not torch.isfinite(loss):  # an accuracy after this would describe a broken model
            raise TrainingDiverged(
                f"{what}: the training loss became {loss.item()} at step {step} (lr={cfg.lr}); "
                "no accuracy is reported for it"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        yield step, loss.item()


def train_one(
    task_name: str,
    lengths,
    variant: str,
    options: dict,
    cfg: TrainConfig,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    on_eval=None,
    save_to: Path | None = None,
    prepare=None,
) -> list[dict]:
    """Train one model at each length of `lengths` in turn and return its rows (one per evaluation);
    on_eval(row) is called as each exists; prepare(model), before the optimiser is built (a probe's changes). With `save_to`, the trained model is kept there before its final row. Without cfg.curriculum, `lengths` is one length; with it, the
    model trained at one length goes on to the next (cfg.steps steps each, the schedule restarting)."""
    lengths = (lengths,) if isinstance(lengths, int) else tuple(lengths)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev, autocast = torch.device(device), precision(torch.device(device), dtype)
    torch.manual_seed(seed)
    tasks = [_task(task_name, n, cfg) for n in lengths]
    vocab_size = max(t.vocab_size for t in tasks)
    longest = max(t.seq_len for n, made in zip(lengths, tasks) for t in (made, *longer_tasks(task_name, made, n, cfg)))
    model = decoder(vocab_size, cfg, variant, max_len=longest + 1, **options).to(dev)
    if prepare is not None:
        prepare(model)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    g = torch.Generator().manual_seed(seed)
    recipe = cfg.row_fields()
    resolved = resolved_options(variant, options)
    if (
        cfg.warm_start and task_name == "recall" and cfg.queries is not None
    ):  # not scored: a start, like the initialisation
        dense = make_task(task_name, lengths[0], vocab=tasks[0].symbols, pairs=cfg.pairs)
        for _ in _steps(
            model, opt, dense, cfg, cfg.warm_start, g, dev, autocast, f"{task_name} warm start {variant} seed {seed}"
        ):
            pass
    rows = []
    for stage, (length, task) in enumerate(zip(lengths, tasks)):
        state = decoding_state(model, task.seq_len, cfg)
        source = FixedSet(task, cfg.train_examples, seed) if cfg.train_examples else task
        start, loss_sum, loss_count = time.perf_counter(), 0.0, 0
        for step, loss in _steps(
            model, opt, source, cfg, cfg.steps, g, dev, autocast, f"{task_name} L={length} {variant} seed {seed}"
        ):
            loss_sum, loss_count = loss_sum + loss, loss_count + 1
            if step % cfg.eval_every == 0 or step == cfg.steps:
                scores = evaluate(model, task, seed, cfg, dev, autocast)
                stop = cfg.early_stop is not None and scores["eval_accuracy"] >= cfg.early_stop
                if cfg.extrapolate and (step == cfg.steps or stop):  # the final model, at lengths never trained
                    scores["extrapolation"] = extrapolated(model, task_name, task, length, seed, cfg, dev, autocast)
                row = {
                    "task": task_name,
                    "variant": variant,
                    "options": options,
                    "resolved_options": resolved,
                    "length": length,
                    "seq_len": task.seq_len,
                    "batch": cfg.batch_at(task.seq_len),
                    **state,
                    "seed": seed,
                    "device": dev.type,
                    "dtype": dtype,
                    "stage": stage,
                    "step": step,
                    "final": step == cfg.steps or stop,
                    "train_loss": loss_sum / loss_count,
                    **scores,
                    "wall_s": round(time.perf_counter() - start, 2),
                    "parameters": params,
                    **recipe,
                }
                loss_sum, loss_count = 0.0, 0
                rows.append(row)
                if save_to is not None and row["final"] and stage == len(lengths) - 1:
                    facts = model_facts(task_name, variant, options, cfg, vocab_size, longest + 1, length, seed)
                    save_model(save_to, model, facts)
                if on_eval:
                    on_eval(row)
                if stop:  # Zoology's early stop: this length is learned (with the curriculum, on to the next)
                    break
    return rows


def measure_training_step(
    task_name: str,
    length: int,
    variant: str,
    options: dict,
    cfg: TrainConfig,
    device: str = "cpu",
    dtype: str = "float32",
    repeats: int = 5,
) -> dict:
    """Model-level cost of one training step (forward, backward, optimizer) at `length`: median time of
    `repeats` samples after at least two warm-up steps (the measuring core's `measure_time`), tokens per
    second, and the step's peak memory (the measuring core's: process RSS over the state before, CPU; the
    allocator's peak, CUDA). Meant to run in a process of its own (it sets the allocator's thresholds):
    `harness.core.isolation.run_isolated`."""
    threads = set_threads(cfg.threads) if device == "cpu" else None
    dev, autocast = torch.device(device), precision(torch.device(device), dtype)
    torch.manual_seed(0)
    task = _task(task_name, length, cfg)
    model = decoder(task.vocab_size, cfg, variant, max_len=task.seq_len + 1, **options).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    batch = cfg.batch_at(task.seq_len)
    inputs, targets, mask = (t.to(dev) for t in task.batch(batch, torch.Generator().manual_seed(0)))

    def step():
        loss = masked_loss(model, inputs, targets, mask, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    times = measure_time(step, dev, warmup=2, repeats=repeats, min_time=math.inf).times
    if dev.type == "cpu":
        pin_mmap_threshold()
    opt.zero_grad(set_to_none=False)  # gradients and optimizer state exist before: the peak is the step's own
    memory = measure_peak(step, dev)
    seconds = statistics.median(times)
    return {
        "task": task_name,
        "variant": variant,
        "options": options,
        "resolved_options": resolved_options(variant, options),
        "length": length,
        "device": dev.type,
        "dtype": dtype,
        "seq_len": task.seq_len,
        "batch": batch,
        "step_ms": seconds * 1e3,
        "step_ms_min": min(times) * 1e3,
        "repeats": repeats,
        "tokens_per_s": batch * task.seq_len / seconds,
        "train_peak_bytes": memory["peak_bytes"],
        "memory_kind": memory["kind"],
        "threads": threads,
        **cfg.row_fields(),  # the recipe measured (a sweep measures each width)
    }
