"""Attention transfer (the first step of LoLCATs and Hedgehog): before a variant with parameters of its own is
evaluated inside a pretrained model, train only those parameters so that each layer's attention reproduces the
model's own softmax attention on real text.

    result = transfer(model, sequences, steps=200, lr=1e-3)   # the model already switched by variants.hf.use

How: the model runs its sequences once with every variant's output replaced by exact causal softmax attention
of the same q, k, v (a forward hook on each layer's attached variant), so every layer sees the hidden states of
the original model; each layer keeps its q, k, v and that softmax output. Then, layer by layer and independent
of each other, the variant's own parameters are trained by AdamW on the mean squared error between its output
and the softmax output (the model's weights are not touched). The last sequence is held out: its error before and
after training is what the run reports, as a fraction of the softmax output's mean square.

The text is the docstrings of a fixed list of standard-library modules (every Python has them; none of it is the
pydoc topics perplexity is measured on).
"""

from __future__ import annotations

import importlib
import inspect
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import variants.hf as vh

DOC_MODULES = (
    "argparse",
    "asyncio",
    "bisect",
    "calendar",
    "codecs",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "doctest",
    "email",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "heapq",
    "http.client",
    "inspect",
    "io",
    "itertools",
    "json",
    "locale",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
)
SEQUENCES = 8  # sequences of text captured; the last one held out


def distill_text() -> str:
    """The docstrings (over 200 characters) of the public names DOC_MODULES define, in a fixed order."""
    parts = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(parts)


def distill_sequences(tokenizer, length: int) -> torch.Tensor:
    """(SEQUENCES, length) token ids: consecutive pieces of the distillation text."""
    ids = tokenizer(distill_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < SEQUENCES * length:
        raise ValueError(f"--distill: the distillation text has {len(ids)} tokens, fewer than {SEQUENCES} x {length}")
    return torch.tensor(ids[: SEQUENCES * length], dtype=torch.long).view(SEQUENCES, length)


def trainable_parameters(model) -> int:
    """Parameters of the variants attached to the model's attention layers (what attention transfer trains)."""
    return sum(p.numel() for m in _attached(model).values() for p in m.parameters() if p.requires_grad)


def _attached(model) -> dict[str, torch.nn.Module]:
    return {
        path: layer._modules[vh.ATTRIBUTE]
        for path, layer in vh.attention_layers(model).items()
        if vh.ATTRIBUTE in layer._modules
    }


@contextmanager
def softmax_teacher(model, on_layer=None):
    """Inside: every attached variant's output replaced by exact causal softmax attention of its q, k, v (the
    layer's own scaling), so the model computes what it computes with its own attention; yields
    {layer path: [(q, k, v, softmax output) per forward]}, or, given `on_layer`, calls
    on_layer(path, variant, q, k, v, softmax output, causal) at each layer instead of keeping them."""
    layers = vh.attention_layers(model)
    kept: dict[str, list[tuple]] = {path: [] for path in _attached(model)}

    def teacher(path, scaling):
        def hook(module, args, kwargs, output):
            q, k, v = (t.detach() for t in args[:3])
            causal = bool(kwargs.get("causal", True))
            target = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
            )
            if on_layer is None:
                kept[path].append((q, k, v, target))
            else:
                on_layer(path, module, q, k, v, target, causal)
            return target  # the rest of the model sees the original attention's output

        return hook

    handles = [
        module.register_forward_hook(teacher(path, getattr(layers[path], "scaling", None)), with_kwargs=True)
        for path, module in _attached(model).items()
    ]
    try:
        yield kept
    finally:
        for handle in handles:
            handle.remove()


def fittable(model) -> bool:
    """Whether an attached variant sets itself from the model's keys and values (`fit`)."""
    return any(hasattr(m, "fit") for m in _attached(model).values())


def fit_to_own(model, sequences: torch.Tensor) -> dict[str, float]:
    """Variants that set themselves from the model's own keys and values (`fit`: mla's SVD, as MHA2MLA and
    TransMLA initialise it) fitted, layer by layer, on the softmax model's keys and values of `sequences`;
    {layer path: the fraction of their energy kept}. {} when no attached variant has a `fit`."""
    modules = {path: m for path, m in _attached(model).items() if hasattr(m, "fit")}
    if not modules:
        return {}
    kept = capture(model, sequences)
    return {
        path: module.fit(torch.cat([x[1] for x in kept[path]], dim=2), torch.cat([x[2] for x in kept[path]], dim=2))
        for path, module in modules.items()
    }


def capture(model, sequences: torch.Tensor) -> dict[str, list[tuple]]:
    """{layer path: [(q, k, v, softmax output) per sequence]} with the model running softmax attention throughout."""
    with softmax_teacher(model) as kept, torch.no_grad():
        for ids in sequences:
            model(ids[None], use_cache=False, logits_to_keep=1)
    return kept


def _error(module, samples) -> float:
    """Mean over the samples of MSE(variant, softmax) / mean square of the softmax output."""
    with torch.no_grad():
        return sum(
            float(F.mse_loss(module(q, k, v, causal=True), t) / t.pow(2).mean()) for q, k, v, t in samples
        ) / len(samples)


def variant_loss(module, q, k, v, target, causal: bool = True):
    """What attention transfer minimises for a variant: its own `transfer_loss` where it defines one (dsa: the
    indexer's KL to the softmax's attention, DeepSeek-V3.2's warm-up), else its output's MSE to the softmax's."""
    if hasattr(module, "transfer_loss"):
        return module.transfer_loss(q, k, v, target, causal=causal)
    return F.mse_loss(module.forward(q, k, v, causal=causal), target)  # (not module(...): a teacher hook's)


def transfer(model, sequences: torch.Tensor, steps: int, lr: float, seed: int = 0) -> dict:
    """Train every attached variant's own parameters `steps` AdamW steps (one captured sequence a step, cycling
    through all but the last) to reproduce softmax attention; the model's weights are left as they are. Returns
    the record of a distillation row: per layer the held-out error before and after, the parameters, the time."""
    began = time.perf_counter()
    kept = capture(model, sequences)
    layers = []
    torch.manual_seed(seed)
    for path, module in _attached(model).items():
        train, held_out = kept[path][:-1], kept[path][-1:]
        params = [p for p in module.parameters() if p.requires_grad]
        before = _error(module, held_out)
        if params:
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
            for step in range(steps):
                q, k, v, target = train[step % len(train)]
                loss = variant_loss(module, q, k, v, target)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        layers.append({"layer": path, "before": before, "after": _error(module, held_out)})
    return {
        "steps": steps,
        "lr": lr,
        "sequences": len(sequences),
        "tokens": int(sequences.numel()),
        "parameters": trainable_parameters(model),
        "layers": layers,
        "error_before": sum(r["before"] for r in layers) / len(layers),
        "error_after": sum(r["after"] for r in layers) / len(layers),
        "distill_s": time.perf_counter() - began,
    }


def attached_state(model) -> dict:
    """The attached variants' parameters and buffers (to put a distilled model back without training again)."""
    return {
        path: {k: v.detach().clone() for k, v in module.state_dict().items()}
        for path, module in _attached(model).items()
    }


def load_attached_state(model, state: dict) -> None:
    for path, module in _attached(model).items():
        module.load_state_dict(state[path])
