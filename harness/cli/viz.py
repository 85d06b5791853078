"""`bench viz`: a variant's attention weights drawn on a small input."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from harness import options as opts

from .common import ImportOption, OptionOption, checked, make_console, within


VariantsOption = Annotated[str, typer.Option("--variants", help="'all' or names, comma-separated.")]
NOption = Annotated[
    int,
    typer.Option("--n", callback=within(1, 2048), help="Sequence length of the picture (it holds an N x N matrix)."),
]
CausalOption = Annotated[bool, typer.Option("--causal/--no-causal", help="Draw the causal pattern.")]
WindowOption = Annotated[int, typer.Option(help="Sliding window w for the picture (small, so the band shows).")]
GlobalTokensOption = Annotated[int, typer.Option(help="Global tokens for the sliding-window variants.")]
OutOption = Annotated[Path, typer.Option(help="Image to write (.png, .svg or .pdf).")]
ForceOption = Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")]


def viz(
    variants_: VariantsOption = "all",
    n: NOption = 64,
    causal: CausalOption = False,
    window: WindowOption = 6,
    global_tokens: GlobalTokensOption = 2,
    compression: Annotated[int, typer.Option(help="Memory-compressed stride c.")] = 4,
    option: OptionOption = None,
    out: OutOption = Path("attention_patterns.png"),
    import_: ImportOption = None,
    force: ForceOption = False,
) -> None:
    """Heat-maps, side by side, of the attention weights each variant applies to one random input.

    Softmax variants show their weights, linear its normalized kernel matrix, memory_compressed the
    weight each query gives each original position. The weights are read off the variant itself
    (called with v = identity), so the picture is also a visual check of causality and of the window.
    """
    import variants
    from harness import policy
    from harness.viz import attention_patterns, draw_patterns

    with checked():
        policy.import_modules(import_ or [])
        names = (
            tuple(variants.available()) if variants_.strip() == "all" else policy.resolve_variants(variants_, ("cpu",))
        )
        options = opts.merge_options(option or [], window=window, global_tokens=global_tokens, compression=compression)
    if out.suffix.lstrip(".") not in ("png", "svg", "pdf"):
        raise typer.BadParameter(f"--out: {out} must end in .png, .svg or .pdf")
    if out.exists() and not force:
        raise typer.BadParameter(f"--out: {out} already exists; pass --force to overwrite it")
    result = attention_patterns(list(names), n, causal, options)
    path = draw_patterns(result, out, n, causal)
    console = make_console()
    for name, reason in result["skipped"].items():
        console.print(f"skipped {name}: {reason}")
    console.print(f"wrote {path}")
