"""`bench quality`: the same small decoder trained with each attention, on copy and recall."""

from __future__ import annotations

from harness import options as opts
from harness.quality.choices import QualityChoices
from harness.quality.config import TASKS
from harness.store import rundir
from harness.store.storage import QUALITY_RESULTS

from .common import (
    RunImportOption,
    ReportOption,
    OptionOption,
    Task,
    checked,
    interruptible,
    make_console,
    say,
    write_report,
)
from .training import print_accuracy, quality_with_progress

from .quality_options import (
    Preset,
    TaskOption,
    VariantsOption,
    PresetOption,
    LengthsOption,
    LongLengthsOption,
    LongVariantsOption,
    CopyLengthsOption,
    DeviceOption,
    DtypeOption,
    SeedsOption,
    StepsOption,
    CurriculumOption,
    PairsOption,
    QueriesOption,
    WarmStartOption,
    ShortConvOption,
    OutputGateOption,
    VocabOption,
    DModelOption,
    LayersOption,
    HeadsOption,
    BatchOption,
    BatchTokensOption,
    LrOption,
    EarlyStopOption,
    TrainExamplesOption,
    LabelSmoothingOption,
    WindowOption,
    CostOption,
    OutOption,
    ResumeOption,
    CompressionOption,
    CHOICES,
    KeepModelsOption,
    ExtrapolateOption,
    PositionsOption,
)


def quality(
    task: TaskOption = None,
    variants_: VariantsOption = None,
    preset: PresetOption = Preset(CHOICES["preset"]),
    lengths: LengthsOption = None,
    long_lengths: LongLengthsOption = None,
    long_variants: LongVariantsOption = None,
    copy_lengths: CopyLengthsOption = None,
    device: DeviceOption = CHOICES["device"],
    dtype: DtypeOption = CHOICES["dtype"],
    seeds: SeedsOption = None,
    steps: StepsOption = None,
    curriculum: CurriculumOption = None,
    pairs: PairsOption = None,
    queries: QueriesOption = None,
    warm_start: WarmStartOption = None,
    short_conv: ShortConvOption = None,
    output_gate: OutputGateOption = None,
    vocab: VocabOption = None,
    d_model: DModelOption = None,
    layers: LayersOption = None,
    heads: HeadsOption = None,
    batch: BatchOption = None,
    batch_tokens: BatchTokensOption = None,
    lr: LrOption = None,
    early_stop: EarlyStopOption = None,
    train_examples: TrainExamplesOption = None,
    positions: PositionsOption = None,
    extrapolate: ExtrapolateOption = None,
    keep_models: KeepModelsOption = CHOICES["keep_models"],
    label_smoothing: LabelSmoothingOption = CHOICES["label_smoothing"],
    window: WindowOption = None,
    compression: CompressionOption = None,
    option: OptionOption = None,
    cost: CostOption = CHOICES["measure_cost"],
    out: OutOption = None,
    resume: ResumeOption = None,
    import_: RunImportOption = None,
    report: ReportOption = None,
) -> None:
    """Train the same small decoder with each attention variant on copy and associative recall; report held-out accuracy.

    Only the attention differs between variants: same model size, steps, learning rate and data. Rows are
    appended to RUN_DIR/quality.jsonl as they exist; REPORT.md and the figures follow (`bench report RUN_DIR`
    redraws them). The default took 11 min 37 s on a 2-core CPU (results/quality-quick); the presets and
    their costs: docs/quality.md.
    """
    from harness.quality.session import QualityRequest, open_quality

    console = make_console()
    with checked():
        choices = QualityChoices(
            tasks=None if task is None else TASKS if task == Task.all else (task.value,),
            variants=variants_,
            preset=preset.value,
            given=opts.merge_options(option or [], window=window, compression=compression),
            measure_cost=cost,
            device=device,
            dtype=dtype,
            lengths=lengths,
            copy_lengths=copy_lengths,
            long_lengths=long_lengths,
            long_variants=long_variants,
            seeds=seeds,
            d_model=d_model,
            lr=lr,
            label_smoothing=label_smoothing,
            layers=layers,
            heads=heads,
            steps=steps,
            batch=batch,
            batch_tokens=batch_tokens,
            curriculum=curriculum,
            pairs=pairs,
            queries=queries,
            vocab=vocab,
            warm_start=warm_start,
            short_conv=short_conv,
            output_gate=output_gate,
            early_stop=early_stop,
            train_examples=train_examples,
            positions=positions,
            extrapolate=extrapolate,
            keep_models=keep_models,
        )
        request = QualityRequest(choices=choices, resume=resume, out=out, imports=tuple(import_ or []))
        session = open_quality(request, say(console))
    report = rundir.report_asked(session.run_dir, report, resume is not None)  # (recorded before a Ctrl-C can come)
    with interruptible(console, session.kept, session.resume_command):
        rows = quality_with_progress(session, console)
    print_accuracy(rows, session.config, console)
    console.print(f"results: {session.run_dir / QUALITY_RESULTS}")
    if report:
        write_report(session.run_dir, console)
