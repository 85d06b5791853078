"""What a quality run is: the training recipe (`TrainConfig`), the run (`QualityConfig`, stored in
metadata.json), its tasks, and Zoology's configuration a zoology run is held against (the presets: presets.py).
Imports neither torch nor the variants."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace


@dataclass(frozen=True)
class TrainConfig:
    """The model, training recipe and task parameters of `bench quality`, shared by every variant
    (recorded in every row as cfg_<field>)."""

    d_model: int = 64
    layers: int = 2
    heads: int = 4
    steps: int = 1500  # per length; with the curriculum, per stage
    batch: int = 32
    batch_tokens: int | None = (
        None  # at most this many tokens a batch: fewer sequences at long L (None: always `batch`)
    )
    lr: float = 3e-3
    warmup: float = 0.1  # fraction of steps with a linear warm-up, then cosine decay to 0
    weight_decay: float = 0.01
    label_smoothing: float = 0.0
    eval_every: int = 250
    eval_examples: int = 256
    threads: int = 0
    curriculum: bool = False  # one model per (task, variant, seed), trained at each length in turn
    vocab: int | None = None  # task vocabulary (copy: symbols, default 16; recall: default max(64, 2 * pairs))
    pairs: int | None = None  # recall: key-value pairs (default length // 8)
    queries: int | None = None  # recall: distinct keys asked once each among filler (default: fill with queries)
    warm_start: int = (
        0  # recall with queries: steps on the dense layout (every place a query) at the first length, first
    )
    short_conv: int = (
        0  # width of a causal depthwise convolution on each block's input, in every variant's model (0: none)
    )
    output_gate: bool = False  # σ(x W_g) times the attention's heads before W_o, in every variant's model (Qwen3-Next)
    # "zoology": Zoology's model, its layers a gated short convolution then the attention in turn, no MLP and no
    # positions (its LanguageModel with Hybrid[BaseConv, mixer] and an Identity state mixer); "transformer": blocks
    # of attention and MLP over sinusoidal positions
    arch: str = "transformer"
    train_examples: int | None = None  # a fixed training set of this many sequences, in shuffled epochs; None: fresh
    early_stop: float | None = None  # stop a training once its held-out accuracy reaches this (Zoology: 0.99)
    adam_beta2: float = 0.98  # AdamW's second-moment decay (Zoology: torch's 0.999)
    positions: str | None = None  # the position encoding (variants/positions); None: the arch's own (`encoding`)
    extrapolate: tuple[int, ...] = ()  # after training at L, also evaluate the model at each factor x L

    @property
    def encoding(self) -> str:
        """The position encoding the model carries: `positions`, else its architecture's (transformer: sinusoidal;
        zoology: none, as Zoology's LanguageModel)."""
        return self.positions or ("none" if self.arch == "zoology" else "sinusoidal")

    def batch_at(self, seq_len: int) -> int:
        """Sequences a training batch holds at `seq_len` tokens: `batch`, or fewer where `batch_tokens` caps it
        (never less than one), so a curriculum stage at a long L costs what one at a short L does."""
        if not self.batch_tokens:
            return self.batch
        return max(1, min(self.batch, self.batch_tokens // seq_len))

    def row_fields(self) -> dict:
        """The recipe as a row records it: each field as cfg_<field> (accuracy rows, training-step cost rows)."""
        return {f"cfg_{k}": v for k, v in asdict(self).items()}


TASKS = ("copy", "recall", "mqar")
ARCHS = ("transformer", "zoology")
# TrainConfig's fields that change the model a training step runs or the work of the step (not the learning rate,
# the schedule or the number of steps): a step's cost is joined to an accuracy, or to another cost, on all of them
STEP_FIELDS = (
    "d_model",
    "layers",
    "heads",
    "arch",
    "short_conv",
    "output_gate",
    "vocab",
    "pairs",
    "queries",
    "batch",
    "batch_tokens",
    "positions",
)


def recall_layout(length: int, pairs: int | None = None) -> tuple[int, int]:
    """(pairs, places) of a recall sequence of `length` tokens: its key-value pairs (default length // 8, at least
    one) and the two-token places after the bindings, each a query or filler (tasks.RecallTask; torch-free, so
    reports read it too)."""
    p = pairs if pairs is not None else max(1, length // 8)
    return p, (length - 2 * p) // 2


TOKENS_PER_L = {
    "copy": 2,
    "recall": 1,
    "mqar": 1,
}  # the sequence a model reads at task length L, in units of L (copy: the string twice)


@dataclass(frozen=True)
class QualityConfig:
    """Everything a quality run needs; stored (flat: the recipe's fields beside these) in metadata.json."""

    tasks: tuple[str, ...]
    variants: tuple[str, ...]
    lengths: tuple[int, ...]
    options: dict = field(default_factory=dict)  # variant options, passed to the variants that take them
    imports: tuple[str, ...] = ()
    train: TrainConfig = TrainConfig()
    seeds: int = 1  # every training is made with seeds 0..seeds-1
    device: str = "cpu"
    dtype: str = "float32"  # or bfloat16: autocast, CUDA only
    preset: str = "quick"
    measure_cost: bool = True  # a training step's time and memory per (task, variant, length)
    copy_lengths: tuple[int, ...] | None = None  # copy's lengths when they differ from `lengths`
    long_lengths: tuple[int, ...] = ()  # lengths beyond `lengths` that only `long_variants` train (after `lengths`)
    long_variants: tuple[str, ...] = ()
    # sweep axes: every training is made at each model width and each learning rate ((): the recipe's one value)
    d_models: tuple[int, ...] = ()
    lrs: tuple[float, ...] = ()
    positions: tuple[str, ...] = ()  # an axis of encodings; each variant trains those it can carry
    refused: tuple[tuple[str, str, str], ...] = ()  # (variant, encoding, why) pairs of the axis not trained
    keep_models: bool = False  # each trained model kept in RUN_DIR/models (bench viz --run)

    def carries(self, variant: str, positions: str | None) -> bool:
        """Whether the run trains `variant` with encoding `positions` (not among the refused pairs)."""
        return not any(v == variant and p == positions for v, p, _ in self.refused)

    @property
    def seeds_list(self) -> tuple[int, ...]:
        return tuple(range(self.seeds))

    def lengths_of(self, task: str, variant: str | None = None) -> tuple[int, ...]:
        """The lengths `variant` trains `task` at (without a variant: every variant's): copy's own where
        given; else `lengths`, and `long_lengths` after them for the `long_variants`."""
        if task == "copy" and self.copy_lengths:
            return self.copy_lengths
        return self.lengths + (self.long_lengths if variant in self.long_variants else ())

    def recipes(self) -> tuple[TrainConfig, ...]:
        """The recipe of each point of the sweep: `train` at every (encoding, d_model, lr) of the axes."""
        return tuple(
            replace(self.train, d_model=d, lr=lr, positions=p)
            for p in self.positions or (self.train.positions,)
            for d in self.d_models or (self.train.d_model,)
            for lr in self.lrs or (self.train.lr,)
        )

    def step_recipes(self) -> tuple[TrainConfig, ...]:
        """The recipes whose training steps differ in cost: one a width of the sweep (its rates share a model)."""
        return tuple(dict.fromkeys(replace(r, lr=self.train.lr) for r in self.recipes()))

    def to_json(self) -> dict:
        axes = {"d_models": list(self.d_models), "lrs": list(self.lrs)} if self.d_models or self.lrs else {}
        axes.update(keep_models=True) if self.keep_models else None
        if self.positions:
            axes.update(positions_axis=list(self.positions), refused=[list(r) for r in self.refused])
        return {
            **asdict(self.train),
            "tasks": list(self.tasks),
            "variants": list(self.variants),
            "lengths": list(self.lengths),
            "options": dict(self.options),
            "imports": list(self.imports),
            "seeds": self.seeds,
            "device": self.device,
            "dtype": self.dtype,
            "preset": self.preset,
            "measure_cost": self.measure_cost,
            "copy_lengths": list(self.copy_lengths) if self.copy_lengths else None,
            "long_lengths": list(self.long_lengths),
            "long_variants": list(self.long_variants),
            **axes,
        }

    @classmethod
    def from_json(cls, data: dict) -> "QualityConfig":
        """From metadata.json's "config"; ValueError naming what is missing."""
        missing = [key for key in ("tasks", "variants", "lengths") if key not in data]
        if missing:
            raise ValueError(
                f"the quality run's configuration lacks {', '.join(missing)}; it was not written by bench quality"
            )
        recipe = {f.name: data[f.name] for f in fields(TrainConfig) if f.name in data}
        recipe["extrapolate"] = tuple(recipe.get("extrapolate") or ())
        extra = {k: data[k] for k in ("seeds", "device", "dtype", "preset", "measure_cost", "keep_models") if k in data}
        if data.get("copy_lengths"):
            extra["copy_lengths"] = tuple(data["copy_lengths"])
        if data.get("long_lengths"):
            extra["long_lengths"], extra["long_variants"] = (
                tuple(data["long_lengths"]),
                tuple(data.get("long_variants") or ()),
            )
        for axis, kind in (("d_models", int), ("lrs", float)):
            if data.get(axis):
                extra[axis] = tuple(kind(value) for value in data[axis])
        if data.get("positions_axis"):
            extra["positions"] = tuple(data["positions_axis"])
            extra["refused"] = tuple(tuple(r) for r in data.get("refused") or ())
        if "measure_cost" not in data:  # runs made before training costs were measured
            extra["measure_cost"] = False
        return cls(
            tasks=tuple(data["tasks"]),
            variants=tuple(data["variants"]),
            lengths=tuple(data["lengths"]),
            options=dict(data.get("options") or {}),
            imports=tuple(data.get("imports") or ()),
            train=TrainConfig(**recipe),
            **extra,
        )


# Zoology's published MQAR configuration against a zoology run's, as every such REPORT.md lists it: (what, Zoology's
# value, the run's config key or a fixed text, why the CPU preset differs). Sources: the paper configs named above,
# zoology/model.py, zoology/train.py, zoology/mixers/{delta_net,gated_delta_net,mamba2}.py; docs/quality.md.
ZOOLOGY_PUBLISHED = (
    (
        "sequences a step",
        "512 (256 at L = 256)",
        "batch",
        "a step of 512 takes 3.9 x one of 128 at d_model 64, 6.1 x at 128 (scripts/step_cost.py, 2 cores)",
    ),
    (
        "training",
        "64 epochs of its 100,000 sequences (12,500 steps at L = 128)",
        "steps",
        "12,500 steps of 512 take 2.2 h a training at d_model 64 (647 ms a step); 1,500 of 128, 4 min",
    ),
    ("early stop", "held-out accuracy above 99%", "early_stop", ""),
    (
        "d_model",
        "64, 128, 256, 512",
        "d_models",
        "at 128 sequences a step d_model 256 takes 688 ms, 4.2 x 64's (165 ms): beyond the budget",
    ),
    (
        "learning rates",
        "1e-4, 4.64e-4, 2.15e-3, 1e-2 (the best reported)",
        "lrs",
        "1e-4 not trained: at 4.64e-4 every variant stays at chance for 1,500 steps (this run's column)",
    ),
    ("(L, pairs)", "(64, 4), (128, 8), (256, 16)", "lengths", "the middle setting only, for the budget"),
    (
        "heads",
        "attention and Based 1, DeltaNet and Gated DeltaNet 2",
        "heads",
        "one model for every variant: only the attention differs",
    ),
    (
        "short convolution",
        "width 4 on q, k, v in DeltaNet, Gated DeltaNet and Mamba-2; none in attention and Based",
        "short_conv",
        "one model for every variant: before every attention",
    ),
    (
        "dropout",
        "0.1 on the embeddings and attention weights",
        "none",
        "a variant exposes no attention weights to drop; the same for all",
    ),
    ("gradient clipping", "none", "norm 1.0", "attnbench's training loop clips every run"),
    (
        "the mixers",
        "Zoology's own layers (Mamba-2's gated block; DeltaNet's SiLU on q, k and β from the hidden state)",
        "the variants inside MultiHeadAttention",
        "attnbench measures its own variants, gates from the keys",
    ),
)

# Zoology's values in a run's config form: where a run (the CUDA preset) matches one, its row's "why" is left empty
ZOOLOGY_VALUES = {
    "batch": 512,
    "steps": 12_500,
    "early_stop": 0.99,
    "d_models": [64, 128, 256, 512],
    "lrs": [1e-4, 4.64e-4, 2.15e-3, 1e-2],
    "lengths": [64, 128, 256],
}

MAX_SEEDS = 1000  # seeds 0..K-1 of every training
