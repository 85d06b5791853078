"""The two stages of a linearization, a step at a time: attention transfer (each layer's variant trained on
the softmax output of the same q, k, v) and LoRA on next-token loss (`peft`)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

import variants.hf as vh
from harness.lm import distill as transfer
from harness.options import ArgumentError

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the projections LoRA adapts (LoLCATs: all four)


PEFT_INSTALL = "pip install -e '.[lm]'  (or: pip install peft)"


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


# -- stage 1: attention transfer ------------------------------------------------------------------------------


def attached_variants(model) -> dict[str, torch.nn.Module]:
    return transfer._attached(model)


def variant_parameters(model) -> list[torch.nn.Parameter]:
    return [p for m in attached_variants(model).values() for p in m.parameters()]


def attention_error(model, sequences: torch.Tensor, start: int = 0) -> float:
    """Held-out error of the attached variants against the softmax: per layer MSE / the softmax output's mean
    square, averaged over the sequences and the layers (1.0: as far as predicting zero); the sequences placed
    at positions start .. (the same text and targets anywhere: what the error owes to position alone)."""
    errors: dict[str, list[float]] = {}

    def on_layer(path, module, q, k, v, target, causal):
        out = module.forward(q, k, v, causal=causal)  # (not module(...): its teacher hook would run again)
        errors.setdefault(path, []).append(float(F.mse_loss(out, target) / target.pow(2).mean()))

    with transfer.softmax_teacher(model, on_layer), torch.no_grad():
        for ids in sequences:
            at = None if not start else positions(ids, start)
            model(ids[None], position_ids=at, use_cache=False, logits_to_keep=1)
    return sum(sum(e) / len(e) for e in errors.values()) / len(errors)


POSITION_BUCKETS = ((0, 1024), (1024, 2048), (2048, 4096), (4096, 8192))  # positions the held-out error is read in


def error_by_position(model, sequences: torch.Tensor, context: int | None) -> dict[str, float]:
    """The held-out error with the sequences placed at the end of each POSITION_BUCKETS span that the model's
    context holds ("0-1024": ..., "4096-8192": ...): the probe that showed post-RoPE maps failing past their
    training positions (a 1024-token sequence at 0, 1024, 3072 and 7168)."""
    length, out = sequences.shape[-1], {}
    for lo, hi in POSITION_BUCKETS:
        start = max(lo, hi - length)
        if context is None or start + length <= context:
            out[f"{lo}-{hi}"] = attention_error(model, sequences, start)
    return out


SHARE_LENGTHS = (1024, 2048, 4096, 8192)  # contexts the out-of-window attention share is read at
SHARE_ROWS = 64  # the last queries of each context it is read over


def older_shares(model, text: torch.Tensor, context: int | None) -> dict[str, list[float]]:
    """{"L": [the variant's share, softmax's]} for each SHARE_LENGTHS context the text and the model's context
    hold: the attention mass the last SHARE_ROWS queries put on keys older than the window, averaged over layers,
    heads and rows, with the model running softmax (so both read the same q, k). Only for variants that split
    their keys at a window (`older_shares`, window_linear's); {} for the others. `text`: 1-D token ids, its last
    L tokens read."""
    out = {}
    for length in SHARE_LENGTHS:
        if length > text.numel() or (context is not None and length > context):
            continue
        sums: list[list[float]] = []

        def on_layer(path, module, q, k, v, target, causal):
            if hasattr(module, "older_shares"):
                mine, exact = module.older_shares(q, k, rows=SHARE_ROWS)
                sums.append([float(mine.mean()), float(exact.mean())])

        with transfer.softmax_teacher(model, on_layer), torch.no_grad():
            model(text[-length:][None], use_cache=False, logits_to_keep=1)
        if not sums:
            return {}
        out[str(length)] = [sum(s[0] for s in sums) / len(sums), sum(s[1] for s in sums) / len(sums)]
    return out


def positions(ids: torch.Tensor, start: int) -> torch.Tensor:
    """(1, L) position ids of a training sequence placed at `start` (--position-offsets)."""
    return torch.arange(start, start + ids.shape[-1], device=ids.device)[None]


def transfer_step(model, ids: torch.Tensor, start: int = 0, weight: float = 1.0) -> float:
    """One forward of the softmax model over `ids` (at positions start ..); at every layer the variant's loss
    (distill.variant_loss: its output's MSE to the softmax's, or its own), times `weight`, back-propagated into
    the variant's parameters only (each layer's graph freed at once; gradients add up over calls). The mean
    loss."""
    losses = []
    layers = len(attached_variants(model))

    def on_layer(path, module, q, k, v, target, causal):
        with torch.enable_grad():
            loss = transfer.variant_loss(module, q, k, v, target, causal)
            (loss * weight / layers).backward()
        losses.append(float(loss.detach()))

    with transfer.softmax_teacher(model, on_layer), torch.no_grad():
        model(ids[None], position_ids=positions(ids, start), use_cache=False, logits_to_keep=1)
    return sum(losses) / len(losses)


# -- stage 2: LoRA --------------------------------------------------------------------------------------------


def next_token_loss(model, sequences: torch.Tensor) -> float:
    """Mean next-token cross-entropy over the sequences (nats a token)."""
    with torch.no_grad():
        return sum(
            float(model(input_ids=ids[None], labels=ids[None], use_cache=False).loss) for ids in sequences
        ) / len(sequences)


def with_lora(model, rank: int):
    peft = peft_module()
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", target_modules=list(TARGETS))
    with warnings.catch_warnings():  # (transformers' deprecation of a name peft still reads)
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def lora_state(wrapped) -> dict:
    state = peft_module().get_peft_model_state_dict(wrapped, save_embedding_layers=False)
    return {k: v.detach().clone() for k, v in state.items()}
