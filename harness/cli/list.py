"""`bench list`: the menu, what each variant supports and where it runs, and its options."""

from __future__ import annotations

import re

from rich import box
from rich.markup import escape
from rich.table import Table

from harness.options import SHAPE_HINTS

from .common import ImportOption, checked, make_console, print_wrapped


def list_variants(import_: ImportOption = None) -> None:
    """List the registered attention variants: what each computes, its options, what it supports, where it runs.

    Availability is checked per device; an unavailable variant shows why (for example, xformers is
    CUDA-only, or not installed).
    """
    import variants
    from harness import policy

    with checked():
        policy.import_modules(import_ or [])
    console = make_console()
    table, memory_notes, unavailable = _support_table(variants)
    console.print(table)
    for number, note in enumerate(memory_notes, start=1):
        print_wrapped(console, f"  [{number}] ", note)
    console.print("\n[bold]Methods[/]")
    for name in variants.available():
        spec = variants.variant_class(name).spec
        console.print(
            f"  [bold]{name}[/]: {spec.summary}. [dim]{spec.reference}[/]"
            + (f" Note: {spec.notes}." if spec.notes else "")
        )
    console.print(_options_table(variants))
    if unavailable:
        console.print("\n[bold]Unavailable here[/]")
        for line in unavailable:
            console.print(f"  {line}")


def _support_table(variants) -> tuple[Table, list[str], list[str]]:
    """bench list's first table: each variant's cost and what it supports and runs on; with the remarks on its
    memory bound (numbered under the table) and why it does not run on a device."""
    table = Table(
        title="attnbench variants",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
        collapse_padding=True,
    )
    for col in ("variant", "time", "extra memory", "causal", "cross", "pad", "cpu", "cuda"):  # causal: yes, no, only
        table.add_column(col, no_wrap=col in ("variant", "causal", "cross", "pad", "cpu", "cuda"), overflow="fold")
    unavailable, memory_notes = [], []
    for name in variants.available():
        cls = variants.variant_class(name)
        spec = cls.spec

        def where(device: str) -> str:
            reason = cls.unavailable_reason(device)
            if reason:
                unavailable.append(f"{name} on {device}: {reason}")
                return "[red]no[/]"
            return "[green]fwd only[/]" if cls.backward_unsupported_reason(device) else "[green]yes[/]"

        flags = [
            "yes" if f else "no"
            for f in (spec.supports_causal, spec.supports_cross_attention, spec.supports_key_padding_mask)
        ]
        flags[0] = flags[0] if spec.supports_non_causal else "only"
        flags[1] = flags[1] if spec.supports_non_causal else "no"  # no non-causal call, so no cross-attention either
        memory = spec.memory_complexity
        qualified = re.fullmatch(
            r"(O\(.*?\)) \((.+)\)", memory
        )  # "O(N D) (key padding: ...)": a remark under the table
        if qualified:
            memory_notes.append(f"{name}: {qualified.group(1)} ({qualified.group(2)})")
            memory = f"{qualified.group(1)} [{len(memory_notes)}]"
        table.add_row(name, spec.time_complexity, escape(memory), *flags, where("cpu"), where("cuda"))
    return table, memory_notes, unavailable


def _options_table(variants) -> Table:
    """bench list's options: each variant's options, their defaults and meanings (the run's shape left out)."""
    options = Table(
        title="\nOptions (set with --option name=value, or --window / --compression; num_heads, num_kv_heads "
        "and head_dim come from the run's shape)",
        title_justify="left",
    )
    for col in ("variant", "option", "default", "meaning"):
        options.add_column(col, overflow="fold")
    for name in variants.available():
        defaults = variants.effective_options(name)
        for option, doc in variants.option_docs(name).items():
            if option not in SHAPE_HINTS:
                options.add_row(name, option, repr(defaults[option]), doc or "(undocumented)")
    return options
