"""The small decoder every variant is trained in (embeddings, blocks with the attention swapped, an optional
short convolution) and its decoding state; which variants it can take, with what options, in how much memory."""

from __future__ import annotations

import math

import torch
from torch import nn

import variants
from harness.options import SHAPE_HINTS
from variants.positions import ENCODINGS, input_encoding
from harness.quality.config import TrainConfig


class ShortConv(nn.Module):
    """h + a causal depthwise convolution of width K over positions: each channel mixes positions t-K+1 .. t.
    The short convolution the published recurrent layers (Mamba-2, GLA, DeltaNet) put before their q, k, v,
    which lets a position see its predecessor's token; here, when the recipe asks, before every variant's attention."""

    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.conv = nn.Conv1d(d_model, d_model, width, groups=d_model, padding=width - 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        return h + self.convolved(h)

    def convolved(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d): the convolution alone
        return self.conv(h.transpose(1, 2))[..., : h.shape[1]].transpose(1, 2)


GATED_CONV_WIDTH = 3  # Zoology's BaseConv kernel in its MQAR configs


class GatedConv(nn.Module):
    """Zoology's BaseConv with a short kernel: u + conv_K(u) ⊙ W u, a causal depthwise convolution of width K
    gated by a linear map of the same input (`Hybrid`'s layer 0 in every Zoology MQAR model, K = 3)."""

    def __init__(self, d_model: int, width: int = GATED_CONV_WIDTH):
        super().__init__()
        self.conv = ShortConv(d_model, width)
        self.projection = nn.Linear(d_model, d_model)

    def forward(self, u: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        return u + self.conv.convolved(u) * self.projection(u)


def attention_layers(model: nn.Module) -> list[variants.AttentionVariant]:
    """The model's attention variants, each once: not a variant a layer holds inside it (mla's softmax)."""
    layers, inside = [], set()
    for module in model.modules():
        if isinstance(module, variants.AttentionVariant) and id(module) not in inside:
            layers.append(module)
            inside.update(id(m) for m in module.modules())
    return layers


class TinyDecoder(nn.Module):
    """Token embedding + positions (cfg.positions: added to the embeddings, or applied by each attention) +
    pre-norm TransformerBlocks (causal) + LM head; with cfg.short_conv, each block's input first passes a
    `ShortConv` (the same for every variant)."""

    def __init__(self, vocab_size: int, cfg: TrainConfig, variant: str, max_len: int, **variant_options):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.pos = input_encoding(cfg.encoding, cfg.d_model, max_len) or nn.Identity()
        in_attention = cfg.encoding if ENCODINGS[cfg.encoding] in ("rotation", "bias") else None
        self.blocks = nn.ModuleList(
            variants.TransformerBlock(
                cfg.d_model,
                cfg.heads,
                4 * cfg.d_model,
                variant=variant,
                norm="pre",
                output_gate=cfg.output_gate,
                positions=in_attention,
                **variant_options,
            )
            for _ in range(cfg.layers)
        )
        self.convs = (
            nn.ModuleList(ShortConv(cfg.d_model, cfg.short_conv) for _ in range(cfg.layers)) if cfg.short_conv else None
        )
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size)

    def forward(self, tokens: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) -> logits (B, T, vocab); with `at`, a (B, T) bool mask, only the logits there: (count, vocab)
        (a task scoring a few positions need not project the others onto the vocabulary)."""
        h = self.pos(self.embed(tokens))
        for i, block in enumerate(self.blocks):
            h = block(h if self.convs is None else self.convs[i](h), causal=True)
        return self.head(self.norm(h if at is None else h[at]))


class ZoologyLM(nn.Module):
    """Zoology's MQAR model (its `LanguageModel`): word embeddings (no positions), cfg.layers layers alternating a
    `GatedConv` and the variant's attention (cfg.short_conv: a `ShortConv` before its projections), no MLP, a final
    norm, and a head tied to the embeddings. Its residual stream as Zoology's blocks keep it (each layer adds its
    mixer's output, then the norm of the sum: the Identity state mixer's), and its GPT-2 initialisation (std 0.02,
    output projections scaled by 1/sqrt(2 layers)) on every module but the attention variant's own."""

    def __init__(self, vocab_size: int, cfg: TrainConfig, variant: str, **variant_options):
        super().__init__()
        if cfg.encoding != "none":
            raise ValueError(f"zoology: positions={cfg.positions!r}; Zoology's model has no position encoding (none)")
        d = cfg.d_model
        self.embed = nn.Embedding(vocab_size, d)
        self.mixers = nn.ModuleList(
            variants.MultiHeadAttention(d, cfg.heads, variant=variant, output_gate=cfg.output_gate, **variant_options)
            if i % 2
            else GatedConv(d)
            for i in range(cfg.layers)
        )
        self.convs = nn.ModuleList(
            ShortConv(d, cfg.short_conv) if i % 2 and cfg.short_conv else nn.Identity() for i in range(cfg.layers)
        )
        self.norms = nn.ModuleList(nn.ModuleList([nn.LayerNorm(d), nn.LayerNorm(d)]) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab_size, bias=False)
        inside = {id(m) for v in attention_layers(self) for m in v.modules()}
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and id(module) not in inside:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith("out_proj") else 0.02
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
        """As `TinyDecoder.forward`."""
        hidden, residual = self.embed(tokens), None
        for mixer, conv, (norm1, norm2) in zip(self.mixers, self.convs, self.norms):
            residual = hidden if residual is None else hidden + residual
            hidden = norm1(residual)
            hidden = mixer(hidden) if isinstance(mixer, GatedConv) else mixer(conv(hidden), causal=True)
            residual = hidden + residual
            hidden = norm2(residual)
        residual = hidden + residual
        return self.head(self.norm(residual if at is None else residual[at]))


def decoder(vocab_size: int, cfg: TrainConfig, variant: str, max_len: int, **variant_options) -> nn.Module:
    """The model every variant trains in, as cfg.arch says: `TinyDecoder` ("transformer") or `ZoologyLM`."""
    if cfg.arch == "zoology":
        return ZoologyLM(vocab_size, cfg, variant, **variant_options)
    return TinyDecoder(vocab_size, cfg, variant, max_len, **variant_options)


def decoding_state(model: nn.Module, seq_len: int, cfg: TrainConfig) -> dict:
    """The decoding state the model's attention layers hold after `seq_len` positions, batch 1, all layers
    together (Zoology's state size: a KV cache grows with L, a window is bounded, a recurrence is constant):
    {"state_bytes", "state_kind"}, each None for an attention that cannot decode. Made by each layer's own
    prefill of random positions (what a state holds does not depend on the values), plus what the short
    convolutions keep (`cfg.short_conv` - 1 inputs of each layer: the same for every variant)."""
    layers = attention_layers(model)
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
    # the float32 inputs each causal convolution still needs: width - 1 of them
    if cfg.arch == "zoology":  # half the layers a GatedConv (width 3), the others a ShortConv where asked
        widths = [GATED_CONV_WIDTH if i % 2 == 0 else cfg.short_conv for i in range(cfg.layers)]
    else:
        widths = [cfg.short_conv] * cfg.layers
    conv = sum(max(0, w - 1) for w in widths) * cfg.d_model * 4
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
    parameters += layers * (d * d + d) * cfg.output_gate
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
