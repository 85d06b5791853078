"""Why `mla` fails Zoology's MQAR from scratch: the zoology preset's model and recipe (d_model 64, one head,
L = 128, lr 1e-2), a short training of each `mla` layout, held-out accuracy side by side. A layout varies the
latent (32, the default; 128, lossless: [k̂, v] has 128 dims), the key dims kept out of it (rope_dim: DeepSeek's
decoupled key) and which of its projections train (W_down, W_uk / W_uv).

    python scripts/mla_mqar_probe.py                 # every layout, 250 steps, seed 0 (about 8 min on 2 cores)
    python scripts/mla_mqar_probe.py --steps 500 --seeds 3 --only lossless
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from harness.quality.config import TrainConfig
from harness.quality.model import attention_layers
from harness.quality.presets import PRESET_RECIPE, ZOOLOGY
from harness.quality.train import train_one

# name: (latent_dim, rope_dim, the projections that train)
LAYOUTS = {
    "default": (32, 0, "all"),
    "default, basis frozen": (32, 0, "none"),
    "lossless": (128, 0, "all"),
    "lossless, basis frozen": (128, 0, "none"),
    "lossless, W_down frozen": (128, 0, "up"),
    "rope_dim 16": (32, 16, "all"),
    "rope_dim 32": (32, 32, "all"),
    "latent 16, rope_dim 16": (16, 16, "all"),
}


def zoology_recipe(steps: int) -> TrainConfig:
    """The zoology preset's recipe on a CPU at d_model 64 and lr 1e-2 (its best rate for most methods)."""
    values = {k: ZOOLOGY[k] for k in PRESET_RECIPE if k in ZOOLOGY}
    values = {k: v["cpu"] if isinstance(v, dict) else v for k, v in values.items()}
    return TrainConfig(**{**values, "steps": steps, "eval_every": steps, "d_model": 64, "lr": 1e-2})


def lossless(attn: nn.Module) -> None:
    """Widen the latent past the variant's own bound (Hkv · D) to every dim of [k̂, v]: an orthonormal square
    basis, so keys and values pass through exactly at the start (a diagnostic, not a layout anyone deploys)."""
    width = attn.down.shape[0]
    basis = torch.linalg.qr(torch.randn(width, width, dtype=attn.down.dtype))[0]
    split = attn.kv_heads * (attn.head_dim - attn.rope_dim)
    attn.latent_dim = width
    attn.down = nn.Parameter(basis.clone())
    attn.up_k = nn.Parameter(basis[:split].T.clone())
    attn.up_v = nn.Parameter(basis[split:].T.clone())


def run(name: str, steps: int, seed: int) -> float:
    latent, rope, trains = LAYOUTS[name]

    def layout(model: nn.Module) -> None:  # the preset's model, its mla layers set to this layout
        for attn in attention_layers(model):
            if latent > attn.latent_dim:
                lossless(attn)
            attn.down.requires_grad_(trains == "all")
            for p in (attn.up_k, attn.up_v):
                p.requires_grad_(trains in ("all", "up"))

    options = {"latent_dim": min(latent, 64), "rope_dim": rope}  # (64 = Hkv · D, the variant's own bound)
    rows = train_one("mqar", 128, "mla", options, zoology_recipe(steps), seed=seed, prepare=layout)
    return rows[-1]["eval_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250, help="training steps of each layout")
    parser.add_argument("--only", default=None, help="run the layouts whose name contains this")
    parser.add_argument("--seeds", type=int, default=1, help="trainings of each layout (seeds 0, 1, ...)")
    args = parser.parse_args()
    names = [n for n in LAYOUTS if args.only is None or args.only in n]
    print(f"{'mla layout':<26} {'latent':>6} {'rope':>5} {'trains':>7}  accuracy, seed by seed")
    for name in names:
        latent, rope, trains = LAYOUTS[name]
        accuracies = " ".join(f"{run(name, args.steps, seed):6.1%}" for seed in range(args.seeds))
        print(f"{name:<26} {latent:>6} {rope:>5} {trains:>7}  {accuracies}", flush=True)


if __name__ == "__main__":
    main()
