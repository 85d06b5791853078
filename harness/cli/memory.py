"""`bench memory`: what attention needs in memory in a whole model at N, textbook against fused and the menu."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich import box
from rich.table import Table

from harness import options as opts
from harness.fmt import fmt_bytes

from .common import DType, at_least, checked, make_console, print_wrapped

LengthsOption = Annotated[str, typer.Option(help="Sequence lengths N, comma-separated.")]
VariantsOption = Annotated[
    str, typer.Option("--variants", help="Names, comma-separated (full_naive: textbook attention; full: fused).")
]
LayersOption = Annotated[int, typer.Option(callback=at_least(1), help="Attention layers of the model.")]
HeadsOption = Annotated[int, typer.Option(callback=at_least(1), help="Query heads H.")]
KvHeadsOption = Annotated[
    Optional[int], typer.Option(callback=at_least(1), help="K/V heads (a divisor of --heads). Default: --heads.")
]
HeadDimOption = Annotated[int, typer.Option(callback=at_least(1), help="Head dimension D.")]
BatchOption = Annotated[int, typer.Option(callback=at_least(1), help="Sequences a batch.")]
TrainingOption = Annotated[
    bool,
    typer.Option(
        "--training/--inference",
        help="A training keeps every layer's saved activations until the backward; inference runs one layer at a time.",
    ),
]
CausalOption = Annotated[
    bool, typer.Option("--causal/--no-causal", help="Causal (a decoder) or bidirectional (an encoder).")
]


def memory(
    lengths: LengthsOption = "4000",
    variants_: VariantsOption = "full_naive,full",
    layers: LayersOption = 12,
    heads: HeadsOption = 12,
    kv_heads: KvHeadsOption = None,
    head_dim: HeadDimOption = 64,
    batch: BatchOption = 1,
    dtype: Annotated[DType, typer.Option(help="Data type of the activations.")] = DType.float32,
    training: TrainingOption = True,
    causal: CausalOption = True,
) -> None:
    """What attention needs in memory in a model of --layers layers at each N, per variant.

    A training keeps, for every layer until its backward, what the forward left alive: measured here, one layer
    at the N asked (the resident set's growth, on the CPU). One call's peak, bench run's prediction, comes on
    top. The defaults are BERT-base's shape at 4000 tokens (docs/speed.md: does it need 16 GB?).
    """
    from harness.core.kept import Shape, model_memory
    from harness.policy import memory_budgets, resolve_variants

    with checked():
        length_list = opts.parse_lengths(lengths)
        names = resolve_variants(variants_, ("cpu",))
        if kv_heads is not None and heads % kv_heads:
            raise opts.ArgumentError(f"--kv-heads {kv_heads}: must divide --heads {heads}")
    import torch

    budget = dict(memory_budgets("auto", ("cpu",), {})).get("cpu") or 2**62
    shape = Shape(batch, heads, kv_heads or heads, head_dim, getattr(torch, dtype.value), causal)
    console = make_console()
    what = "training" if training else "inference"
    console.print(
        f"[bold]Attention's memory[/], {what}: {layers} layers, H {heads} (K/V {shape.kv_heads}), D {head_dim}, "
        f"batch {batch}, {dtype.value}"
    )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("variant", no_wrap=True)
    for column in ("N", "kept a layer", f"kept x {layers}", "a call's peak", "needs"):
        table.add_column(column, justify="right", no_wrap=True)
    refused = []
    for name in names:
        for n in length_list:
            try:
                found = model_memory(name, {}, n, shape, layers, training, budget)
            except (ValueError, RuntimeError, TypeError) as err:  # a variant that cannot take this shape: named below
                refused.append(f"{name} at N={n}: {err}")
                continue
            table.add_row(name, f"{n:,}", *(fmt_bytes(found[key]) for key in ("kept_layer", "kept", "peak", "total")))
    console.print(table)
    print_wrapped(
        console,
        "",
        "needs = kept x layers + one call's peak. Beside it a model holds its weights, optimizer state and the "
        "other layers' activations; bench run measures one call's peak (docs/speed.md).",
    )
    for reason in refused:
        print_wrapped(console, "not counted: ", reason)
