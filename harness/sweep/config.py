"""What a sweep is: `RunConfig` (stored in metadata.json) and its cells. Reading a stored configuration
imports neither torch nor the variants."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from harness.options import SHAPE_HINTS
from harness.store.rows import device_label, key_of

PASSES = ("fwd", "fwdbwd", "decode")  # decode: one step of one new position after N (causal only)
MIN_REPEATS_BEFORE = 3  # the fewest timed calls a cell made before runs recorded `min_repeats`


@dataclass(frozen=True)
class RunConfig:
    """Everything a sweep needs; stored in metadata.json so `--resume` repeats it exactly."""

    variants: tuple[str, ...]  # registered names, in the order they run
    lengths: tuple[int, ...]  # sequence lengths N, increasing
    devices: tuple[str, ...]  # "cpu", "cuda"
    passes: tuple[str, ...]  # "fwd", "fwdbwd", "decode"
    causal: tuple[bool, ...]  # (False,), (True,) or (False, True): every mode the run measures
    batch: int = 1
    heads: int = 8
    kv_heads: int | None = None  # heads of k and v (grouped-query attention: a divisor of heads); None: heads
    head_dim: int = 64
    dtype: str = "float32"
    options: tuple[tuple[str, object], ...] = ()  # variant options, passed to the variants that take them
    repeats: int = 10  # at most this many timed calls per cell
    warmup: int = 1  # untimed calls before timing
    warmup_time: float = 0.25  # ... lasting at least this many seconds (measure.WARMUP_S)
    min_time: float = 1.0  # stop timing after `min_repeats` calls once this many seconds were timed
    min_repeats: int = (
        1  # 1: a call lasting min_time alone is timed once (runs from before timed >= 3: MIN_REPEATS_BEFORE)
    )
    cell_timeout: float = 60.0  # seconds a cell (warm-up, timing and memory) may take before it is killed
    memory_budget: tuple[tuple[str, int], ...] = ()  # per device: bytes a cell may use (predicted, and enforced on CPU)
    threads: int = 0  # CPU threads (0: all cores)
    check_len: int = 320  # N of the correctness check against the dense reference
    imports: tuple[str, ...] = ()  # modules imported first (they may register extra variants)
    # per variant, every option it runs with (defaults filled in), fixed when the run starts, so a
    # resume repeats them and reading the run needs no variant code; () for runs from before
    resolved_options: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    # per variant, the modes it is measured in where the run chose them per variant (--causal auto over a menu
    # that mixes causal-only and bidirectional-only methods); a variant not named here runs in every mode of `causal`
    modes: tuple[tuple[str, tuple[bool, ...]], ...] = ()

    def modes_of(self, name: str) -> tuple[bool, ...]:
        """The causal modes variant `name` is measured in (False: bidirectional, True: causal)."""
        return dict(self.modes).get(name, self.causal)

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
        return {
            **self.options_of(name),
            "num_heads": self.heads,
            "head_dim": self.head_dim,
            "num_kv_heads": self.key_heads,
        }

    @property
    def key_heads(self) -> int:
        """The heads of k and v (grouped-query attention), the query heads unless --kv-heads said fewer."""
        return self.heads if self.kv_heads is None else self.kv_heads

    def with_resolved_options(self) -> "RunConfig":
        """This configuration with every variant's options fixed (from the registry, defaults filled in)."""
        resolved = {name: tuple(sorted(self.options_of(name).items())) for name in self.variants}
        return replace(self, resolved_options=tuple(sorted(resolved.items())))

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
        data["modes"] = {name: list(modes) for name, modes in self.modes}
        return data

    @classmethod
    def from_json(cls, data: dict) -> "RunConfig":
        """From metadata.json's "config"; TypeError when it has a field this version does not know."""
        data = dict(data)
        data["options"] = tuple(sorted(data.get("options", {}).items()))
        data["memory_budget"] = tuple(sorted(data.get("memory_budget", {}).items()))
        data["resolved_options"] = tuple(
            sorted((name, tuple(sorted(opts.items()))) for name, opts in (data.get("resolved_options") or {}).items())
        )
        data["modes"] = tuple((name, tuple(modes)) for name, modes in (data.get("modes") or {}).items())
        for key in ("variants", "lengths", "devices", "passes", "causal", "imports"):
            data[key] = tuple(data.get(key, ()))
        data.setdefault("min_repeats", MIN_REPEATS_BEFORE)  # a run that does not record it timed 3 calls at least
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
        return key_of(self.device, self.variant, self.pass_, self.causal, self.n, self.device_name)

    def label(self) -> str:
        where = device_label(self.device, self.device_name if self.device != "cpu" else None)
        return f"{where} {self.variant} {self.pass_}{' causal' if self.causal else ''} N={self.n}"
