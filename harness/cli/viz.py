"""`bench viz`: a variant's attention weights drawn on a small input."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

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
OutOption = Annotated[
    Optional[Path],
    typer.Option(
        help="Image to write (.png, .svg or .pdf). With --run: a folder. Default: attention_patterns.png; RUN_DIR/figures."
    ),
]
RunOption = Annotated[
    Optional[Path],
    typer.Option(
        help="A quality run that kept its models (bench quality --keep-models): draw what each trained model attends to, one held-out example, every layer and head, instead of random inputs."
    ),
]
TaskOption = Annotated[
    Optional[str], typer.Option(help="With --run: the task whose models to draw. Default: the first kept.")
]
HeadsOption = Annotated[
    Optional[str], typer.Option(help="With --run: the heads to draw, comma-separated (0,2). Default: all.")
]
AttributeOption = Annotated[
    bool,
    typer.Option(
        "--attribute",
        help="With --run: Integrated Gradients (Captum) of the last answer's logit per input token, beside the attention its query gives them, and their rank correlation.",
    ),
]
ForceOption = Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")]


def viz(
    variants_: VariantsOption = "all",
    n: NOption = 64,
    causal: CausalOption = False,
    window: WindowOption = 6,
    global_tokens: GlobalTokensOption = 2,
    compression: Annotated[int, typer.Option(help="Memory-compressed stride c.")] = 4,
    option: OptionOption = None,
    out: OutOption = None,
    import_: ImportOption = None,
    force: ForceOption = False,
    run: RunOption = None,
    task: TaskOption = None,
    heads: HeadsOption = None,
    attribute: AttributeOption = False,
) -> None:
    """Heat-maps, side by side, of the attention weights each variant applies to one random input.

    Softmax variants show their weights, linear its normalized kernel matrix, memory_compressed the
    weight each query gives each original position. The weights are read off the variant itself
    (called with v = identity), so the picture is also a visual check of causality and of the window.
    """
    import variants
    from harness import policy
    from harness.viz import attention_patterns, draw_patterns

    if run is not None:
        return _trained(run, task, heads, attribute, out)
    if task is not None or heads is not None or attribute:
        raise typer.BadParameter("--task, --heads and --attribute draw a trained model: give --run RUN_DIR with them")
    out = out or Path("attention_patterns.png")

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


def _trained(run: Path, task: str | None, heads: str | None, attribute: bool, out: Path | None) -> None:
    """bench viz --run: every kept model's attention maps (and attribution), a figure per variant and a table."""
    from harness.viz import draw_trained, trained_attention, trained_table

    if not (run / "metadata.json").exists():
        raise typer.BadParameter(f"--run: {run} is not a run directory (no metadata.json)")
    try:
        chosen = None if heads is None else [int(h) for h in heads.split(",") if h.strip()]
    except ValueError:
        raise typer.BadParameter(f"--heads: {heads!r} must be head numbers, comma-separated (0,2)") from None
    if chosen is not None and (not chosen or min(chosen) < 0):
        raise typer.BadParameter(f"--heads: {heads!r} must be head numbers >= 0, comma-separated (0,2)")
    if attribute:
        from importlib.util import find_spec

        from harness.quality.inspect import CAPTUM_INSTALL

        if find_spec("captum") is None:
            raise typer.BadParameter(f"--attribute needs Captum, an optional extra: {CAPTUM_INSTALL}")
    console = make_console()
    with checked():
        try:
            records = trained_attention(run, task, chosen, attribute)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
    folder = out or run / "figures"
    for record in records:
        console.print(f"wrote {draw_trained(record, folder)}")
    table = folder / f"trained_attention_{records[0]['task']}.md"
    table.write_text(trained_table(records))
    console.print(table.read_text())
    console.print(f"wrote {table}")
