"""What a run is: a sweep's `RunConfig` and cells, a quality run's `QualityConfig`, and the policies
that turn command-line values into them (devices, memory budgets, variant options, checks).

Reading a stored configuration imports neither torch nor the variants; building one does.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields

PASSES = ("fwd", "fwdbwd", "decode")  # decode: one step of one new position after N (causal only)
BASELINE = "full"  # the variant every other is compared with (speed-ups, crossovers)
SHAPE_HINTS = ("num_heads", "head_dim")  # options every variant takes, set from the run's shape


@dataclass(frozen=True)
class RunConfig:
    """Everything a sweep needs; stored in metadata.json so `--resume` repeats it exactly."""

    variants: tuple[str, ...]  # registered names, in the order they run
    lengths: tuple[int, ...]  # sequence lengths N, increasing
    devices: tuple[str, ...]  # "cpu", "cuda"
    passes: tuple[str, ...]  # "fwd", "fwdbwd", "decode"
    causal: tuple[bool, ...]  # (False,), (True,) or (False, True)
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    options: tuple[tuple[str, object], ...] = ()  # variant options, passed to the variants that take them
    repeats: int = 10  # at most this many timed calls per cell
    warmup: int = 1  # untimed calls before timing
    warmup_time: float = 0.25  # ... lasting at least this many seconds (measure.WARMUP_S)
    min_time: float = 1.0  # stop timing after 3 calls once this many seconds were timed
    cell_timeout: float = 300.0  # seconds a cell (warm-up, timing and memory) may take before it is killed
    memory_budget: tuple[tuple[str, int], ...] = ()  # per device: bytes a cell may use (predicted, and enforced on CPU)
    threads: int = 0  # CPU threads (0: all cores)
    check_len: int = 320  # N of the correctness check against the dense reference
    imports: tuple[str, ...] = ()  # modules imported first (they may register extra variants)
    # per variant, every option it runs with (defaults filled in), fixed when the run starts, so a
    # resume repeats them and reading the run needs no variant code; () for runs from before
    resolved_options: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()

    def resolved(self, name: str) -> dict | None:
        """Every option variant `name` runs with in this sweep, as fixed at its start (None: not stored)."""
        found = dict(self.resolved_options).get(name)
        return None if found is None else dict(found)

    def options_of(self, name: str) -> dict:
        """Every option variant `name` runs with (shape hints aside): as fixed at the start, else from the
        registry, the run's options over the variant's defaults."""
        opts = self.resolved(name)
        if opts is None:
            import variants

            opts = variants.effective_options(name, **variants.options_taken(name, dict(self.options)))
            opts = {k: v for k, v in opts.items() if k not in SHAPE_HINTS}
        return opts

    def variant_options(self, name: str) -> dict:
        """What the variant is built with: its options, plus the shape hints every variant takes."""
        return {**self.options_of(name), "num_heads": self.heads, "head_dim": self.head_dim}

    def with_resolved_options(self) -> "RunConfig":
        """This configuration with every variant's options fixed (from the registry, defaults filled in)."""
        resolved = {name: self.options_of(name) for name in self.variants}
        return RunConfig.from_json({**self.to_json(), "resolved_options": resolved})

    def budget(self, device: str) -> int | None:
        return dict(self.memory_budget).get(device)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def element_size(self) -> int:
        return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    def to_json(self) -> dict:
        data = asdict(self)
        data["options"] = dict(self.options)
        data["memory_budget"] = dict(self.memory_budget)
        data["resolved_options"] = {name: dict(opts) for name, opts in self.resolved_options}
        return data

    @classmethod
    def from_json(cls, data: dict) -> "RunConfig":
        """From metadata.json's "config"; TypeError when it has a field this version does not know."""
        data = dict(data)
        data["options"] = tuple(sorted(data.get("options", {}).items()))
        data["memory_budget"] = tuple(sorted(data.get("memory_budget", {}).items()))
        data["resolved_options"] = tuple(sorted((name, tuple(sorted(opts.items())))
                                                for name, opts in (data.get("resolved_options") or {}).items()))
        for key in ("variants", "lengths", "devices", "passes", "causal", "imports"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


@dataclass(frozen=True, order=True)
class Cell:
    """One measurement: a variant on a device, one pass, causal or not, at one length.

    device is the kind ("cpu", "cuda"); device_name the hardware (CPU model, GPU name) where the run
    knows it: a run over a cluster measures each kind on every distinct hardware it has."""

    device: str
    variant: str
    pass_: str
    causal: bool
    n: int
    device_name: str | None = None

    @property
    def series(self) -> tuple:
        return (self.device, self.variant, self.pass_, self.causal, self.device_name)

    @property
    def key(self) -> tuple:
        return (self.device, self.variant, self.pass_, self.causal, self.n, self.device_name)

    def label(self) -> str:
        where = f"{self.device} ({self.device_name})" if self.device_name and self.device != "cpu" else self.device
        return f"{where} {self.variant} {self.pass_}{' causal' if self.causal else ''} N={self.n}"


def names_of(device_names: dict | None, device: str) -> list:
    """The hardware names a run measures `device` on: a list (a cluster's), one name, or [None] (unknown)."""
    names = (device_names or {}).get(device)
    if isinstance(names, (list, tuple)):
        return list(names) or [None]
    return [names]


def plan(config: RunConfig, device_names: dict | None = None) -> list[Cell]:
    """Every cell of the sweep, grouped by series and increasing N within a series; each device kind
    once per hardware name in `device_names` ({kind: name or [names]})."""
    return [
        Cell(device, name, pass_, causal, n, device_name)
        for device in config.devices
        for device_name in names_of(device_names, device)
        for name in config.variants
        for causal in config.causal
        for pass_ in config.passes
        if causal or pass_ != "decode"  # decoding is causal: no non-causal decode cells
        for n in config.lengths
    ]


# -- parsing command-line values --------------------------------------------------------------------

class ArgumentError(ValueError):
    """A command-line value that is not allowed; the message names the option, the value and what is allowed."""


def check_number(option: str, value: float, low: float, high: float, unit: str = "", low_inclusive: bool = True) -> None:
    """ArgumentError unless `value` is a finite number within [low, high] (or (low, high])."""
    ok = isinstance(value, (int, float)) and math.isfinite(value) and value <= high and (value >= low if low_inclusive else value > low)
    if not ok:
        lower = f">= {low:g}" if low_inclusive else f"> {low:g}"
        raise ArgumentError(f"{option}: {value!r} is not allowed; use a finite number {lower} and <= {high:g}{' ' + unit if unit else ''}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str, option: str = "--memory-budget") -> int:
    """'512MiB', '2GiB', '1.5G', '800M', '1048576' -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise ArgumentError(f"{option}: {text!r} is not a size; use e.g. 512MiB, 2GiB, 1.5G or a number of bytes")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


# the measuring core's version, recorded in every run's metadata: rows timed by two cores never share a
# run (--resume refuses). 2: steady allocator while timing, warm-up >= --warmup-time, samples calibrated to
# >= 10 ms (CPU) from the last warm-up call (issue 31); 1: before (runs that record no version)
TIMING_CORE = 2

# the longest correctness check: its dense float64 reference holds B x H x N x N scores (2 x 8 x 4096² x 8 bytes = 2 GiB)
MAX_CHECK_LEN = 4096

# the longest sequence any command takes: at N = 2^31 the inputs alone hold 24 GiB even at B = H = D = 1 (float32)
MAX_LENGTH = 2**31


def parse_lengths(text: str) -> tuple[int, ...]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ArgumentError(f"--lengths: {text!r} is not a comma-separated list of integers (e.g. 1000,3000,10000)") from None
    if not values or any(not 1 <= v <= MAX_LENGTH for v in values):
        raise ArgumentError(f"--lengths: {text!r} must list integers from 1 to {MAX_LENGTH} (2^31)")
    return tuple(sorted(set(values)))


def powers_of_two(min_len: int, max_len: int) -> tuple[int, ...]:
    if min_len < 1 or max_len < min_len or max_len > MAX_LENGTH:
        raise ArgumentError(f"--min-len {min_len} / --max-len {max_len}: need 1 <= min-len <= max-len <= {MAX_LENGTH} (2^31)")
    lengths, n = [], 1
    while n <= max_len:
        if n >= min_len:
            lengths.append(n)
        n *= 2
    if min_len not in lengths:
        lengths.insert(0, min_len)
    if max_len not in lengths:
        lengths.append(max_len)
    return tuple(lengths)


def parse_option(text: str) -> tuple[str, object]:
    """'window=128' -> ('window', 128); values are read as JSON where they can be (ints, floats, true, null).
    NaN and infinities are refused: no option takes them, and they cannot be stored as standard JSON."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip() or not re.fullmatch(r"[A-Za-z_]\w*", name.strip()):
        raise ArgumentError(f"--option: {text!r} must look like name=value (e.g. window=128)")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    # json reads NaN and Infinity as floats; "inf" and "nan" would pass on as strings
    if (isinstance(value, float) and not math.isfinite(value)) or raw.strip().lower() in ("nan", "inf", "-inf"):
        raise ArgumentError(f"--option: {text!r}: {raw.strip()} is not allowed; option values must be finite")
    return name.strip(), value


def parse_list(text: str, option: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [item for item in items if item not in allowed]
    if bad or not items:
        raise ArgumentError(f"{option}: {text!r} is not allowed; choose from {', '.join(allowed)} (comma-separated)")
    return items


def resolve_variants(text: str, devices: tuple[str, ...], here: bool = True) -> tuple[str, ...]:
    """'all' = every registered variant available on at least one of the devices (here: on this machine;
    else, for a cluster, every variant whose spec lists one of them); else the named ones."""
    import variants

    registered = variants.available()
    if text.strip() == "all":
        def runs(name: str, device: str) -> bool:
            cls = variants.variant_class(name)
            return cls.unavailable_reason(device) is None if here else device in cls.spec.devices

        return tuple(name for name in registered if any(runs(name, device) for device in devices))
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in registered]
    if unknown or not names:
        raise ArgumentError(f"--variants: unknown variant(s) {', '.join(unknown) or repr(text)}; available: all, {', '.join(registered)}")
    return names


def recorded_facts(names: tuple[str, ...]) -> dict[str, dict]:
    """What a run records of its variants at its start (`VariantSpec.facts`: equivalences, reach, the
    options that change the function, labels), so readers take them from the run, not from code."""
    import variants

    return {name: variants.variant_class(name).spec.facts() for name in names}


def shape_only(name: str, **options):
    """Variant `name` built on the meta device: parameters have shapes but no storage, nothing is
    computed and no device is touched (so a huge option costs no memory, and CUDA stays uninitialized)."""
    import torch

    import variants

    with torch.device("meta"):
        return variants.variant_class(name)(**options)


def check_variant_options(name: str, options: dict, label: str, num_heads: int = 1, head_dim: int = 1) -> None:
    """ArgumentError (prefixed by `label`) unless variant `name` accepts `options` with these shape hints."""
    try:
        shape_only(name, **options, num_heads=num_heads, head_dim=head_dim)
    except (TypeError, ValueError) as err:
        raise ArgumentError(f"{label}: {err}") from None


def check_options(options: dict, names: tuple[str, ...]) -> None:
    """Every option must be taken by at least one of the selected variants, and valid for each that takes it."""
    import variants

    for key, value in options.items():
        takers = [name for name in names if key in variants.option_names(name)]
        if not takers:
            raise ArgumentError(f"option {key}={value!r} is taken by none of the selected variants ({', '.join(names)})")
        for name in takers:
            check_variant_options(name, {key: value}, f"option {key}={value!r}")



# -- policies: from the command line's values to a configuration --------------------------------------

def resolve_devices(text: str, cluster: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """'auto' = the CPU, plus CUDA when present; else the named devices, each of which must exist.

    cluster: the device kinds a cluster's nodes have (--executor ray): 'auto' means those, and a kind
    the cluster lacks is accepted (its cells are skipped with the reason), as nodes may join later."""
    import torch

    if text.strip() == "auto":
        if cluster is not None:
            return tuple(kind for kind in ("cpu", "cuda") if kind in cluster) or ("cpu",)
        return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    devices = parse_list(text, "--devices", ("cpu", "cuda"))
    if "cuda" in devices and cluster is None:
        require_cuda("--devices")
    return devices


def require_cuda(option: str) -> None:
    """ArgumentError naming `option` when CUDA was asked for and torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise ArgumentError(f"{option}: cuda was asked for, but no CUDA device is available (torch.cuda.is_available() is False)")


CPU_BUDGET_FRACTION = 0.6  # of the available RAM, for a CPU cell
GPU_BUDGET_FRACTION = 0.9  # of the free GPU memory, for a CUDA cell


def memory_budgets(text: str, devices: tuple[str, ...], machine: dict) -> tuple[tuple[str, int], ...]:
    """Bytes a cell may use per device: a size for every device, or auto (60% of the available RAM for
    CPU cells, 90% of the free GPU memory, from `machine["gpu"]`, for CUDA cells)."""
    from harness.machine import available_memory_bytes

    if text.strip() != "auto":
        size = parse_size(text)
        if size <= 0:
            raise ArgumentError(f"--memory-budget: {text!r} must be more than 0 bytes")
        return tuple((device, size) for device in devices)
    nodes = machine.get("nodes")  # a cluster (--executor ray): what its smallest node of each kind has free
    if nodes:
        cpu = min((n["memory_available"] for n in nodes if n.get("cpus") and n.get("memory_available")), default=None)
        gpu = min((n["gpu_free_bytes"] for n in nodes if n.get("gpus") and n.get("gpu_free_bytes")), default=None)
    else:
        cpu, gpu = available_memory_bytes(), (machine.get("gpu") or {}).get("free_bytes")
    budgets = []
    for device in devices:
        free, fraction = (cpu, CPU_BUDGET_FRACTION) if device == "cpu" else (gpu, GPU_BUDGET_FRACTION)
        if free:
            budgets.append((device, int(free * fraction)))
    return tuple(budgets)


def parse_resources(texts: list[str]) -> dict[str, float]:
    """--ray-resources NAME=AMOUNT texts -> {name: amount}; ArgumentError naming the bad one."""
    resources = {}
    for text in texts:
        name, sep, amount = text.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or not (value > 0 and math.isfinite(value)):
            raise ArgumentError(f"--ray-resources: {text!r} is not NAME=AMOUNT with a positive amount "
                                f"(e.g. accelerator_type:H100=0.001, or a custom resource your nodes declare)")
        resources[name.strip()] = value
    return resources


def merge_options(option: list[str], **named) -> dict:
    """--option name=value texts, plus the options with flags of their own (--window, ...) where given."""
    options = dict(parse_option(text) for text in option)
    options.update({key: value for key, value in named.items() if value is not None})
    return options


def build_run_config(*, variants: str, lengths: tuple[int, ...], devices: str, passes: str, causal: tuple[bool, ...],
                     options: dict, imports: list[str], min_time: float, cell_timeout: float, warmup_time: float = 0.25,
                     cluster: tuple[str, ...] | None = None, **settings) -> RunConfig:
    """A sweep's configuration from checked command-line values (`settings`: batch, heads, head_dim,
    dtype, repeats, warmup, threads, check_len); every variant's options are checked and fixed.
    cluster: the device kinds of a cluster's nodes, when the cells run there (--executor ray)."""
    check_number("--min-time", min_time, 0, 3600, "seconds")
    check_number("--warmup-time", warmup_time, 0, 3600, "seconds")
    check_number("--cell-timeout", cell_timeout, 1e-3, 86400, "seconds", low_inclusive=False)
    device_list = resolve_devices(devices, cluster)
    names = resolve_variants(variants, device_list, here=cluster is None)
    if not names:
        raise ArgumentError(f"--variants {variants}: no registered variant runs on {', '.join(device_list)}")
    check_options(options, names)
    pass_list = parse_list(passes, "--passes", PASSES)
    if "decode" in pass_list and True not in causal:
        raise ArgumentError("--passes decode: decoding is causal (one new position against the ones before it); "
                            "use --causal yes or both")
    config = RunConfig(variants=names, lengths=lengths, devices=device_list, passes=pass_list,
                       causal=causal, options=tuple(sorted(options.items())), min_time=min_time, cell_timeout=cell_timeout,
                       warmup_time=warmup_time, imports=tuple(imports), **settings)
    return config.with_resolved_options()


@dataclass(frozen=True)
class TrainConfig:
    """The model, training recipe and task parameters of `bench quality`, shared by every variant
    (recorded in every row as cfg_<field>)."""

    d_model: int = 64
    layers: int = 2
    heads: int = 4
    steps: int = 1500  # per length; with the curriculum, per stage
    batch: int = 32
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
    warm_start: int = 0  # recall with queries: steps on the dense layout (every place a query) at the first length, first
    short_conv: int = 0  # width of a causal depthwise convolution on each block's input, in every variant's model (0: none)


TASKS = ("copy", "recall")


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

    @property
    def seeds_list(self) -> tuple[int, ...]:
        return tuple(range(self.seeds))

    def lengths_of(self, task: str) -> tuple[int, ...]:
        return self.copy_lengths if task == "copy" and self.copy_lengths else self.lengths

    def to_json(self) -> dict:
        return {**asdict(self.train), "tasks": list(self.tasks), "variants": list(self.variants),
                "lengths": list(self.lengths), "options": dict(self.options), "imports": list(self.imports),
                "seeds": self.seeds, "device": self.device, "dtype": self.dtype, "preset": self.preset,
                "measure_cost": self.measure_cost, "copy_lengths": list(self.copy_lengths) if self.copy_lengths else None}

    @classmethod
    def from_json(cls, data: dict) -> "QualityConfig":
        """From metadata.json's "config"; ValueError naming what is missing."""
        missing = [key for key in ("tasks", "variants", "lengths") if key not in data]
        if missing:
            raise ValueError(f"the quality run's configuration lacks {', '.join(missing)}; it was not written by bench quality")
        recipe = {f.name: data[f.name] for f in fields(TrainConfig) if f.name in data}
        extra = {key: data[key] for key in ("seeds", "device", "dtype", "preset", "measure_cost") if key in data}
        if data.get("copy_lengths"):
            extra["copy_lengths"] = tuple(data["copy_lengths"])
        if "measure_cost" not in data:  # runs made before training costs were measured
            extra["measure_cost"] = False
        return cls(tasks=tuple(data["tasks"]), variants=tuple(data["variants"]), lengths=tuple(data["lengths"]),
                   options=dict(data.get("options") or {}), imports=tuple(data.get("imports") or ()), train=TrainConfig(**recipe), **extra)


QUALITY_OPTIONS = {"window": 16, "compression": 3}  # the quick preset's variant options, unless given

# What each preset sets where the command line does not. quick: short sequences, one seed, minutes on a
# laptop. long: where subquadratic attention begins to pay, recall with few pairs asked once each among
# filler (difficulty from distance), a window narrower than most distances, a length curriculum, 3 seeds.
PRESETS = {
    "quick": {"lengths": {"cpu": "32,64", "cuda": "32,64"}, "steps": 1500, "lr": 3e-3, "batch": 32, "seeds": 1,
              "curriculum": False, "pairs": None, "queries": None, "options": QUALITY_OPTIONS},
    "long": {"lengths": {"cpu": "64,128,256", "cuda": "64,128,256,512,1024,2048,4096"},
             "copy_lengths": {"cpu": "32,64,128", "cuda": "32,64,128,256,512,1024,2048"}, "steps": 800, "lr": 3e-3, "warm_start": 1000,
             "batch": 32, "seeds": 3, "curriculum": True, "pairs": 8, "queries": 8,
             "options": {"window": 64, "compression": 3}},
}


def resolve_quality_device(text: str) -> str:
    """'auto' = CUDA when present, else the CPU; 'cuda' must exist."""
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text not in ("cpu", "cuda"):
        raise ArgumentError(f"--device: {text!r} is not a device; choose cpu, cuda or auto")
    if text == "cuda":
        require_cuda("--device")
    return text


MAX_SEEDS = 1000  # seeds 0..K-1 of every training


def _quality_machine(device: str) -> dict:
    """What memory_budgets needs to size a quality training: the free GPU memory on CUDA."""
    if device != "cuda":
        return {}
    import torch

    return {"gpu": {"free_bytes": torch.cuda.mem_get_info()[0]}}


def _check_training_fits(train: "TrainConfig", task: str, length: int, made, names, options: dict, budget: int) -> None:
    """ArgumentError when a training of (task, L) would need more memory than the budget (the largest variant's)."""
    from harness.fmt import fmt_bytes
    from harness.quality import training_memory_estimate

    import variants as registry

    worst, parts = max(((name, training_memory_estimate(train, made.seq_len, made.vocab_size, name, registry.options_taken(name, options)))
                        for name in names), key=lambda item: sum(item[1].values()))
    need = sum(parts.values())
    if need > budget:
        detail = ", ".join(f"{part} {fmt_bytes(size)}" for part, size in parts.items())
        raise ArgumentError(f"{task} at L={length} ({made.seq_len} tokens, vocab {made.vocab_size}) with --d-model {train.d_model}, "
                            f"--layers {train.layers}, --batch {train.batch}: training {worst} needs about {fmt_bytes(need)} "
                            f"({detail}), more than the memory budget {fmt_bytes(budget)} (60% of the available RAM, 90% of a "
                            f"GPU's free memory); lower the sizes or the lengths")


def build_quality_config(*, tasks: tuple[str, ...], variants: str, preset: str = "quick", device: str = "cpu",
                         dtype: str = "float32", given: dict, imports: list[str], measure_cost: bool = True,
                         **chosen) -> QualityConfig:
    """A quality run's configuration from checked command-line values. `chosen`: the recipe values the
    command line gave (None = the preset's): lengths, seeds, lr, label_smoothing and TrainConfig's fields.
    Every variant must train on the device with its options, and every task must be well posed at every length.
    `given`: the variant options of the command line (each must be taken by a selected variant), over the preset's."""
    from harness.quality import cannot_train_reason, trainable_variants
    from harness.tasks import make_task

    if preset not in PRESETS:
        raise ArgumentError(f"--preset: {preset!r} is not a preset; choose {' or '.join(PRESETS)}")
    device = resolve_quality_device(device)
    if dtype not in ("float32", "bfloat16"):
        raise ArgumentError(f"--dtype: {dtype!r} is not allowed; choose float32 or bfloat16")
    if dtype == "bfloat16" and device != "cuda":
        raise ArgumentError(f"--dtype bfloat16 trains with CUDA autocast; the device is {device}: use float32 there")
    defaults = PRESETS[preset]
    recipe = dict(chosen)
    for key in ("steps", "lr", "batch", "seeds", "curriculum", "pairs", "queries", "warm_start", "short_conv"):
        if recipe.get(key) is None:
            recipe[key] = defaults.get(key)
    lengths = chosen.get("lengths") or defaults["lengths"][device]
    copy_lengths = chosen.get("copy_lengths") or (defaults.get("copy_lengths") or {}).get(device)
    if chosen.get("lengths") and not chosen.get("copy_lengths"):
        copy_lengths = None  # --lengths alone is every task's
    recipe.pop("lengths", None)
    recipe.pop("copy_lengths", None)
    seeds = recipe.pop("seeds")  # the command line's, else the preset's
    if not 1 <= seeds <= MAX_SEEDS:
        raise ArgumentError(f"--seeds {seeds} is not allowed; it must lie in 1..{MAX_SEEDS}")
    recipe = {key: value for key, value in recipe.items() if value is not None}  # the rest: TrainConfig's defaults
    check_number("--lr", recipe.get("lr", TrainConfig.lr), 0, 10, low_inclusive=False)
    check_number("--label-smoothing", recipe.get("label_smoothing", 0.0), 0, 0.999)
    train = TrainConfig(**recipe)
    if train.d_model % train.heads:
        raise ArgumentError(f"--d-model {train.d_model} must be divisible by --heads {train.heads}")
    names = tuple(trainable_variants(device)) if variants.strip() == "all" else resolve_variants(variants, (device,))
    for name in names:
        reason = cannot_train_reason(name, device)
        if reason:
            raise ArgumentError(f"--variants: {name} cannot be trained on {device}: {reason}")
    check_options(given, names)
    options = {**defaults["options"], **given}
    import variants as registry

    for name in names:
        check_variant_options(name, registry.options_taken(name, options), name, train.heads, train.d_model // train.heads)
    length_list = parse_lengths(lengths)
    copy_list = parse_lengths(copy_lengths) if copy_lengths else None
    if chosen.get("copy_lengths") and "copy" not in tasks:
        raise ArgumentError(f"--copy-lengths {chosen['copy_lengths']}: the copy task's lengths, but the run trains "
                            f"{', '.join(tasks)} only (--task)")
    for key in ("pairs", "queries"):
        if chosen.get(key) is not None and "recall" not in tasks:
            raise ArgumentError(f"--{key} {chosen[key]}: a recall option, but the run trains {', '.join(tasks)} only (--task)")
    budget = dict(memory_budgets("auto", (device,), _quality_machine(device))).get(device)
    for task in tasks:
        for n in (copy_list if task == "copy" and copy_list else length_list):
            try:
                made = make_task(task, n, vocab=train.vocab, pairs=train.pairs, queries=train.queries)
            except ValueError as err:
                raise ArgumentError(f"--lengths {n}: {err}") from None
            if budget:
                _check_training_fits(train, task, n, made, names, options, budget)
    return QualityConfig(tasks=tuple(tasks), variants=names, lengths=length_list, options=options, imports=tuple(imports),
                         train=train, seeds=seeds, device=device, dtype=dtype, preset=preset, measure_cost=measure_cost,
                         copy_lengths=copy_list if copy_list and copy_list != length_list and "copy" in tasks else None)
