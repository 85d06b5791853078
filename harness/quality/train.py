"""Quality: train the same small decoder with each attention variant on copy and recall, and score it.

Every variant gets the same model size, steps, learning rate and data; only the attention differs.
`bench quality` sweeps tasks x variants x lengths; each evaluation row is appended to
RUN_DIR/quality.jsonl the moment it exists, so an interrupted run keeps what finished and
`--resume` retrains only the (task, variant, length) runs that had not finished.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import variants
from harness.core.isolation import run_isolated
from harness.core.measure import measure_time, set_threads
from harness.core.memory import measure_peak, pin_mmap_threshold
from harness.options import SHAPE_HINTS
from harness.quality.config import QualityConfig, TrainConfig
from harness.quality.tasks import distance_buckets, make_task
from harness.store.storage import QUALITY_RESULTS, TRAIN_COST, RowWriter, drop_torn_tail, read_rows, rewrite_rows

__all__ = ["TrainConfig", "TinyDecoder", "train_one", "sweep_quality", "trainable_variants", "cannot_train_reason"]


class ShortConv(nn.Module):
    """h + a causal depthwise convolution of width K over positions: each channel mixes positions t-K+1 .. t.
    The short convolution the published recurrent layers (Mamba-2, GLA, DeltaNet) put before their q, k, v,
    which lets a position see its predecessor's token; here, when the recipe asks, before every variant's attention."""

    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.conv = nn.Conv1d(d_model, d_model, width, groups=d_model, padding=width - 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        return h + self.conv(h.transpose(1, 2))[..., : h.shape[1]].transpose(1, 2)


class TinyDecoder(nn.Module):
    """Token embedding + sinusoidal positions + pre-norm TransformerBlocks (causal) + LM head; with
    cfg.short_conv, each block's input first passes a `ShortConv` (the same for every variant)."""

    def __init__(self, vocab_size: int, cfg: TrainConfig, variant: str, max_len: int, **variant_options):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.pos = variants.SinusoidalPositionalEncoding(cfg.d_model, max_len)
        self.blocks = nn.ModuleList(
            variants.TransformerBlock(
                cfg.d_model, cfg.heads, 4 * cfg.d_model, variant=variant, norm="pre", **variant_options
            )
            for _ in range(cfg.layers)
        )
        self.convs = (
            nn.ModuleList(ShortConv(cfg.d_model, cfg.short_conv) for _ in range(cfg.layers)) if cfg.short_conv else None
        )
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        h = self.pos(self.embed(tokens))
        for i, block in enumerate(self.blocks):
            h = block(h if self.convs is None else self.convs[i](h), causal=True)
        return self.head(self.norm(h))


def decoding_state(model: nn.Module, seq_len: int, cfg: TrainConfig) -> dict:
    """The decoding state the model's attention layers hold after `seq_len` positions, batch 1, all layers
    together (Zoology's state size: a KV cache grows with L, a window is bounded, a recurrence is constant):
    {"state_bytes", "state_kind"}, each None for an attention that cannot decode. Made by each layer's own
    prefill of random positions (what a state holds does not depend on the values), plus what the short
    convolutions keep (`cfg.short_conv` - 1 inputs of each layer: the same for every variant)."""
    layers = [m for m in model.modules() if isinstance(m, variants.AttentionVariant)]
    if not layers or any(layer.decode_unsupported_reason() for layer in layers):
        return {"state_bytes": None, "state_kind": None}
    heads, head_dim = cfg.heads, cfg.d_model // cfg.heads
    device = next(model.parameters()).device
    total, kind = 0, None
    with torch.no_grad():
        for layer in layers:
            q, k, v = (
                torch.randn(1, heads, seq_len, head_dim, generator=torch.Generator().manual_seed(0)).to(device)
                for _ in range(3)
            )
            state = layer.prefill(q, k, v, layer.init_state(1, heads, head_dim, head_dim, torch.float32, device))
            total, kind = total + state.nbytes(), state.kind
    conv = cfg.layers * max(0, cfg.short_conv - 1) * cfg.d_model * 4  # float32 inputs a causal convolution still needs
    return {"state_bytes": total + conv, "state_kind": kind}


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
    with autocast():
        pred = torch.cat([model(x.to(device)).argmax(-1).cpu() for x in sample.inputs.split(chunk)])
    model.train()
    right = (pred == sample.targets) & sample.mask
    return {
        "eval_accuracy": right.sum().item() / sample.mask.sum().item(),
        "eval_exact_match": (right.sum(1) == sample.mask.sum(1)).float().mean().item(),
        "by_distance": distance_buckets(sample.distance, pred == sample.targets, sample.mask),
    }


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite: the training is abandoned, not scored."""


def _autocast(device: torch.device, dtype: str):
    """The training's precision: float32, or bfloat16 autocast (CUDA)."""
    enabled = dtype == "bfloat16"
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def _task(task_name: str, length: int, cfg: TrainConfig):
    return make_task(task_name, length, vocab=cfg.vocab, pairs=cfg.pairs, queries=cfg.queries)


def _loss(model, inputs, targets, mask, autocast, label_smoothing: float = 0.0):
    """Cross-entropy on the scored positions (the forward under the training's precision, the loss in float32)."""
    with autocast():
        logits = model(inputs)
    return F.cross_entropy(logits[mask].float(), targets[mask], label_smoothing=label_smoothing)


def _steps(model, opt, task, cfg: TrainConfig, steps: int, g, dev, autocast, what: str):
    """Train `steps` steps on batches of `task` (warm-up then cosine schedule over them); yields (step, loss)."""
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(step - 1, steps, cfg.warmup)
        inputs, targets, mask = (t.to(dev) for t in task.batch(cfg.batch_at(task.seq_len), g))
        loss = _loss(model, inputs, targets, mask, autocast, cfg.label_smoothing)
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
) -> list[dict]:
    """Train one model at each length of `lengths` in turn and return its rows (one per evaluation);
    on_eval(row) is called as each exists. Without cfg.curriculum, `lengths` is one length; with it, the
    model trained at one length goes on to the next (cfg.steps steps each, the schedule restarting)."""
    lengths = (lengths,) if isinstance(lengths, int) else tuple(lengths)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev, autocast = torch.device(device), _autocast(torch.device(device), dtype)
    torch.manual_seed(seed)
    tasks = [_task(task_name, n, cfg) for n in lengths]
    vocab_size = max(t.vocab_size for t in tasks)
    model = TinyDecoder(vocab_size, cfg, variant, max_len=max(t.seq_len for t in tasks) + 1, **options).to(dev)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    g = torch.Generator().manual_seed(seed)
    recipe = {f"cfg_{k}": v for k, v in asdict(cfg).items()}
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
        start, loss_sum, loss_count = time.perf_counter(), 0.0, 0
        for step, loss in _steps(
            model, opt, task, cfg, cfg.steps, g, dev, autocast, f"{task_name} L={length} {variant} seed {seed}"
        ):
            loss_sum, loss_count = loss_sum + loss, loss_count + 1
            if step % cfg.eval_every == 0 or step == cfg.steps:
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
                    "final": step == cfg.steps,
                    "train_loss": loss_sum / loss_count,
                    **evaluate(model, task, seed, cfg, dev, autocast),
                    "wall_s": round(time.perf_counter() - start, 2),
                    "parameters": params,
                    **recipe,
                }
                loss_sum, loss_count = 0.0, 0
                rows.append(row)
                if on_eval:
                    on_eval(row)
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
    dev, autocast = torch.device(device), _autocast(torch.device(device), dtype)
    torch.manual_seed(0)
    task = _task(task_name, length, cfg)
    model = TinyDecoder(task.vocab_size, cfg, variant, max_len=task.seq_len + 1, **options).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    batch = cfg.batch_at(task.seq_len)
    inputs, targets, mask = (t.to(dev) for t in task.batch(batch, torch.Generator().manual_seed(0)))

    def step():
        loss = _loss(model, inputs, targets, mask, autocast)
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
    }


def cannot_train_reason(name: str, device: str = "cpu") -> str | None:
    """Why variant `name` cannot train the (causal) decoder on `device`, or None."""
    cls = variants.variant_class(name)
    if cls.causal_unsupported_reason():
        return f"{cls.causal_unsupported_reason()}, which the decoder needs"
    return cls.unavailable_reason(device) or cls.backward_unsupported_reason(device)


def resolved_options(variant: str, options: dict) -> dict:
    """Every option `variant` trains with (the given ones, else its defaults; the shape hints aside), as a
    row records it: readers then need no variant code to know a default."""
    return {k: v for k, v in variants.effective_options(variant, **options).items() if k not in SHAPE_HINTS}


def training_memory_estimate(
    cfg: TrainConfig, seq_len: int, vocab_size: int, variant: str, options: dict
) -> dict[str, int]:
    """Predicted bytes of one training of TinyDecoder (float32), by part, before anything is allocated:
    parameters with their gradients and AdamW's two moments, the activations a backward keeps (per block:
    about 16 d_model numbers a position, its attention call's own estimate), the logits with their softmax and
    gradient, and a batch of task data (recall draws a vocab / 2 wide random key order per example). An
    upper-end estimate: what `bench quality` refuses before writing anything when it passes the budget."""
    d, h, layers = cfg.d_model, cfg.heads, cfg.layers
    parameters = 2 * vocab_size * d + layers * (12 * d * d + 13 * d) + layers * cfg.short_conv * d
    batch = cfg.batch_at(seq_len)
    rows = max(batch, cfg.eval_examples)
    with torch.device("meta"):  # shapes only: a huge size costs nothing here
        attn = variants.build(variant, num_heads=h, head_dim=d // h, **variants.options_taken(variant, options))
    call = attn.memory_estimate(batch, h, seq_len, seq_len, d // h, d // h, 4, True, True)
    return {
        "parameters": 4 * 4 * parameters,
        "activations": 4 * batch * seq_len * d * 16 * layers + layers * int(call),
        "logits": 4 * 3 * batch * seq_len * vocab_size,
        "data": 8 * rows * (vocab_size + 2 * seq_len),
    }


def trainable_variants(device: str = "cpu") -> list[str]:
    """Every registered variant that trains on `device` — one per attention function: a variant whose spec
    says another computes the same function (`same_function_as`) would only repeat that one's rows."""
    return [
        name
        for name in variants.available()
        if variants.variant_class(name).spec.same_function_as is None and cannot_train_reason(name, device) is None
    ]


def run_key(row: dict) -> tuple:
    """(task, variant, length, seed) of an evaluation row (rows of old runs carry no seed: 0)."""
    return (row["task"], row["variant"], int(row["length"]), int(row.get("seed", 0)))


def trainings(config: QualityConfig) -> list[tuple[str, str, int, tuple[int, ...]]]:
    """Every training of the run as (task, variant, seed, lengths): one per length, or with the
    curriculum one per (task, variant, seed) through every length in increasing order. Seed by seed:
    an interrupted run holds whole seeds of every (task, variant) rather than every seed of a few; within
    a seed variant by variant, the `long_variants` (one of each family) first, so it holds whole families."""
    cfg = config.train
    if cfg.curriculum:
        first = tuple(v for v in config.long_variants if v in config.variants)
        ordered = first + tuple(v for v in config.variants if v not in first)
        return [
            (t, v, s, tuple(sorted(config.lengths_of(t, v))))
            for s in config.seeds_list
            for v in ordered
            for t in config.tasks
        ]
    every = {t: tuple(dict.fromkeys(n for v in config.variants for n in config.lengths_of(t, v))) for t in config.tasks}
    return [
        (t, v, s, (n,))
        for s in config.seeds_list
        for t in config.tasks
        for n in every[t]
        for v in config.variants
        if n in config.lengths_of(t, v)
    ]


def keep_finished_runs(run_dir: Path, config: QualityConfig | None = None) -> set[tuple]:
    """Drop the rows of trainings that did not finish (they are redone whole); return the finished
    (task, variant, length, seed) keys. With the curriculum, a training finishes when its last length does."""
    drop_torn_tail(run_dir, QUALITY_RESULTS)
    rows = read_rows(run_dir, QUALITY_RESULTS)
    finished = {run_key(r) for r in rows if r.get("final")}
    if config is not None and config.train.curriculum:
        whole = {(t, v, s) for t, v, s, chain in trainings(config) if all((t, v, n, s) in finished for n in chain)}
        finished = {key for key in finished if (key[0], key[1], key[3]) in whole}
    kept = [r for r in rows if run_key(r) in finished]
    if len(kept) != len(rows):
        rewrite_rows(run_dir, kept, QUALITY_RESULTS)
    return finished


def cost_key(row: dict) -> tuple:
    return (row["task"], row["variant"], int(row["length"]))


COST_TIMEOUT_S = 600  # for one cost measurement (model build, 7 steps, a measured step)


def _measure_cost(run_dir: Path, config: QualityConfig, task: str, name: str, length: int, options: dict) -> dict:
    """One training step's cost in a process of its own; a failure (OOM, crash, timeout) is a row that says so."""
    outcome = run_isolated(
        measure_training_step,
        (task, length, name, options, config.train, config.device, config.dtype),
        timeout=COST_TIMEOUT_S,
        imports=config.imports,
        log_path=str(run_dir / "cost.log"),
    )
    if outcome.kind == "result":
        return {**outcome.value, "status": "ok"}
    return {
        "task": task,
        "variant": name,
        "options": options,
        "length": length,
        "device": config.device,
        "dtype": config.dtype,
        "status": "error",
        "error": outcome.describe(),
    }


def sweep_quality(
    run_dir: Path, config: QualityConfig, on_eval=None, on_start=None, finished: set[tuple] | None = None
) -> list[dict]:
    """Run every training not finished yet; rows are appended as they exist. With config.measure_cost,
    each (task, variant, length) first gets its training-step cost in RUN_DIR/train_cost.jsonl.

    finished: the result of `keep_finished_runs(run_dir, config)` when the caller already called it.
    """
    finished = keep_finished_runs(run_dir, config) if finished is None else finished
    options, cfg = config.options, config.train
    if config.measure_cost:  # first, all together: a quiet machine for the timings, before hours of training
        drop_torn_tail(run_dir, TRAIN_COST)
        costed = {cost_key(r) for r in read_rows(run_dir, TRAIN_COST)}
        with RowWriter(run_dir, TRAIN_COST) as cost_writer:
            for task, name, n in dict.fromkeys((t, v, n) for t, v, _, chain in trainings(config) for n in chain):
                if (task, name, n) not in costed:
                    if on_start:
                        on_start(task, n, name, None, "cost")
                    cost_writer.append(
                        _measure_cost(run_dir, config, task, name, n, variants.options_taken(name, options))
                    )
    with RowWriter(run_dir, QUALITY_RESULTS) as writer:
        for task, name, seed, chain in trainings(config):
            if all((task, name, n, seed) in finished for n in chain):
                continue
            if on_start:
                on_start(task, chain[0], name, seed, "train")

            def record(row):
                writer.append(row)
                if on_eval:
                    on_eval(row)

            train_one(
                task,
                chain,
                name,
                variants.options_taken(name, options),
                cfg,
                seed=seed,
                device=config.device,
                dtype=config.dtype,
                on_eval=record,
            )
    return read_rows(run_dir, QUALITY_RESULTS)
