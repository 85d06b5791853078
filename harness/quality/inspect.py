"""What a trained quality model attends to, on one held-out example: each layer and head's attention matrix as the
model applies it (`MultiHeadAttention.attention_weights`: for linear attention and the recurrences, the matrix their
computation implies), a per-head summary (mean attention distance, entropy, the share within 3 positions), and, with
Captum, Integrated Gradients of the answer's logit with respect to each input token beside the attention the answer's
query gives each token (Spearman's rank correlation of the two)."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import torch
from torch import Tensor, nn

import variants
from harness.quality.config import TrainConfig
from harness.quality.model import decoder
from harness.quality.tasks import make_task

LOCAL_DISTANCE = 3  # a head is "local" when at least half its weight lies within this many positions back
CAPTUM_INSTALL = "pip install 'captum>=0.8,<1'  (or: pip install -e '.[attribution]')"


def load_model(path: Path) -> tuple[nn.Module, dict]:
    """(the model in eval mode with its trained weights, its facts) from a file `save_model` wrote."""
    kept = torch.load(path, map_location="cpu", weights_only=False)
    known = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: tuple(v) if k == "extrapolate" else v for k, v in kept["cfg"].items() if k in known})
    model = decoder(kept["vocab_size"], cfg, kept["variant"], kept["max_len"], **kept["options"])
    model.load_state_dict(kept["state_dict"])
    return model.eval(), {**{k: v for k, v in kept.items() if k != "state_dict"}, "cfg": cfg}


def example(facts: dict, seed: int = 0):
    """One held-out example of the model's task at its training length: (tokens (N,), scored (N,) bool, targets (N,),
    the task)."""
    cfg = facts["cfg"]
    task = make_task(facts["task"], facts["length"], vocab=cfg.vocab, pairs=cfg.pairs, queries=cfg.queries)
    sample = task.sample(1, torch.Generator().manual_seed(30_000 + seed))  # a stream no training or evaluation draws
    return sample.inputs[0], sample.mask[0], sample.targets[0], task


@torch.no_grad()
def attention_maps(model: nn.Module, tokens: Tensor) -> list[Tensor]:
    """Per attention layer, in order: its (H, N, N) weights on `tokens` (N,), causal, as the trained model applies
    them (each layer's input captured in one forward of the model)."""
    inputs: list[Tensor] = []
    layers = [m for m in model.modules() if isinstance(m, variants.MultiHeadAttention)]
    hooks = [m.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for m in layers]
    try:
        model(tokens[None])
    finally:
        for hook in hooks:
            hook.remove()
    return [layer.attention_weights(x, causal=True)[0] for layer, x in zip(layers, inputs)]


def head_summary(weights: Tensor) -> list[dict]:
    """Per head of one layer's (H, N, N) weights: the mean distance back and the entropy (nats) of each query's row,
    taken over |w| normalised (a recurrence's implied matrix may hold negative entries), averaged over queries; the
    share of weight within LOCAL_DISTANCE positions; and the head's kind: local (half its weight that close),
    long-range (a mean distance of N/4 or more: a retrieval head), else mixed."""
    n = weights.shape[-1]
    p = weights.abs().double()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    back = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).clamp_min(0).double()
    rows = []
    for h in range(weights.shape[0]):
        distance = (p[h] * back).sum(-1).mean().item()
        entropy = -(p[h] * p[h].clamp_min(1e-30).log()).sum(-1).mean().item()
        local = (p[h] * (back <= LOCAL_DISTANCE)).sum(-1).mean().item()
        rows.append(
            {
                "head": h,
                "distance": distance,
                "entropy": entropy,
                "local_share": local,
                "kind": "local" if local >= 0.5 else "long-range" if distance >= n / 4 else "mixed",
            }
        )
    return rows


def attribution(model: nn.Module, tokens: Tensor, position: int, target: int, steps: int = 32) -> Tensor:
    """Integrated Gradients (Captum's LayerIntegratedGradients on the token embedding, its default baseline: token 0
    at every position) of the logit of `target` at `position`, summed over the embedding's channels: (N,)."""
    try:
        from captum.attr import LayerIntegratedGradients
    except ImportError:
        raise ImportError(f"bench viz --attribute needs Captum, an optional extra: {CAPTUM_INSTALL}") from None

    def logit(batch: Tensor) -> Tensor:
        return model(batch)[:, position, target]

    ig = LayerIntegratedGradients(logit, model.embed)
    scores = ig.attribute(tokens[None], n_steps=steps, internal_batch_size=steps)
    return scores[0].sum(-1).detach()


def rank_correlation(a: Tensor, b: Tensor) -> float:
    """Spearman's rank correlation of two (n,) tensors (average ranks for ties); nan where either is constant."""

    def ranks(x: Tensor) -> Tensor:
        order = x.double().argsort()
        r = torch.empty_like(order, dtype=torch.float64)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for value in x.unique():  # ties share their mean rank
            tied = x == value
            r[tied] = r[tied].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum()) / denominator if denominator else float("nan")
