"""The presets of `bench quality`: what each sets where the command line does not (quick, long, zoology), and
which of TrainConfig's fields a preset may set. Torch-free; plan.py resolves them into a QualityConfig."""

from __future__ import annotations

# the quick preset's variant options, unless given: a window of 16 at L = 32 and 64; each method's own options at that
# reach come from its `training_options` (MoBA's blocks, Performer's features)
QUALITY_OPTIONS = {"window": 16, "compression": 3}

# the long preset trains its long lengths on one variant of each family: those whose spec names a `family`
FAMILIES = "families"
# the positions preset trains the variants whose spec says `position_study`: each way a method handles order
POSITION_STUDY = "position_study"

# What each preset sets where the command line does not. quick: short sequences, one seed, minutes on a
# laptop. long: where subquadratic attention begins to pay, recall with few pairs asked once each among
# filler (difficulty from distance), a window narrower than most distances, a length curriculum, 3 seeds.
PRESETS = {
    # minutes on a laptop: one variant a family (`--variants all` for the whole menu), recall at L = 64 and copy at
    # L = 32 (sequences of 64 tokens both), and the short convolution without which no recurrence learns recall
    "quick": {
        "variants": FAMILIES,
        "lengths": {"cpu": "64", "cuda": "64"},
        "copy_lengths": {"cpu": "32", "cuda": "32"},
        "steps": 1000,
        "lr": 3e-3,
        "batch": 32,
        "seeds": 1,
        "curriculum": False,
        "pairs": None,
        "queries": None,
        "short_conv": 4,
        "options": QUALITY_OPTIONS,
    },
    "long": {
        "lengths": {"cpu": "64,128,256", "cuda": "64,128,256,512,1024,2048,4096"},
        "copy_lengths": {"cpu": "32,64,128", "cuda": "32,64,128,256,512,1024,2048"},
        "steps": 800,
        "lr": 3e-3,
        "warm_start": 2000,
        "batch": 32,
        "batch_tokens": {"cpu": 8192, "cuda": None},
        "seeds": 3,
        "curriculum": True,
        "pairs": 8,
        "queries": 8,
        # on the CPU every variant to L = 256, and one of each family on to 1024 (3 h would not hold the whole menu there)
        "long_lengths": {"cpu": "512,1024", "cuda": None},
        "long_variants": FAMILIES,
        # a causal depthwise convolution of width 4 before each block's attention, in every variant's model: the
        # published Mamba-2, GLA and DeltaNet layers have one, and without it no recurrence learned recall here
        # (results/quality-recipe/short-conv-4 at the quick layout; long-no-conv at this one)
        "short_conv": 4,
        # a window of 64; MoBA's blocks of 32, 2 chosen, and Performer's 64 features from their `training_options`
        "options": {"window": 64, "compression": 3},
    },
}


# Zoology's MQAR as its paper configs set it (HazyResearch/zoology, experiments/paper_configs/iclr24_zoology_figure2,
# and mqar_example_configs for the model): its data (vocab 8192, L/16 pairs, 100,000 training and 3,000 held-out
# sequences), its model (2 layers: a gated short convolution, then the attention; no MLP), its optimiser (AdamW,
# cosine from the peak, weight decay 0.1), its learning rates (logspace(-4, -2, 4)) and early stop (99%), and a
# d_model axis. What the CPU cannot afford (epochs, lengths) is cut where the run says so (docs/quality.md).
ZOOLOGY = {
    "tasks": ("mqar",),
    "variants": FAMILIES,
    "lengths": {"cpu": "128", "cuda": "64,128,256"},  # (L, pairs) = (64, 4), (128, 8), (256, 16): pairs L / 16
    "vocab": 8192,
    "d_model": {"cpu": "64,128", "cuda": "64,128,256,512"},
    "lr": {"cpu": "4.64e-4,2.15e-3,1e-2", "cuda": "1e-4,4.64e-4,2.15e-3,1e-2"},
    "layers": 2,
    "heads": 1,
    "arch": "zoology",
    "short_conv": 4,
    "steps": {"cpu": 1500, "cuda": 12_500},
    "batch": {"cpu": 128, "cuda": 512},
    "train_examples": 100_000,
    "eval_examples": 3000,
    "eval_every": 250,
    "early_stop": 0.99,
    "weight_decay": 0.1,
    "adam_beta2": 0.999,
    "warmup": 0.0,
    "seeds": 1,
    "curriculum": False,
    "options": {"window": 16},
}
PRESETS["zoology"] = ZOOLOGY

# The ALiBi paper's experiment at the quick layout: train at L, evaluate the same model at 2L, 4L and 8L, with
# each encoding every variant can carry (docs/quality.md, results/quality-positions)
PRESETS["positions"] = {
    **PRESETS["quick"],
    "variants": POSITION_STUDY,
    "positions": "all",
    "extrapolate": (2, 4, 8),
    "seeds": 3,
}

# the recipe values a preset may set (TrainConfig's fields), over TrainConfig's defaults and under the command line
PRESET_RECIPE = (
    "steps",
    "batch",
    "batch_tokens",
    "curriculum",
    "pairs",
    "queries",
    "warm_start",
    "short_conv",
    "output_gate",
    "layers",
    "heads",
    "vocab",
    "arch",
    "train_examples",
    "early_stop",
    "adam_beta2",
    "weight_decay",
    "warmup",
    "eval_every",
    "eval_examples",
    "extrapolate",
)
