"""The small decoder every variant is trained in (embeddings, blocks with the attention swapped, an optional
short convolution) and its decoding state; which variants it can take, with what options, in how much memory."""

from __future__ import annotations

import torch
from torch import nn

import variants
from harness.options import SHAPE_HINTS
from harness.quality.config import TrainConfig


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
