"""Planning a quality run: from checked command-line values to a `QualityConfig` that trains (every
variant on the device with its options, every task well posed, every training inside the memory budget)."""

from __future__ import annotations

from dataclasses import fields, replace

import torch

import variants as registry
from harness.fmt import fmt_bytes
from harness.options import ArgumentError, as_argument_error, check_number, parse_axis, parse_lengths
from harness.policy import memory_budgets, require_cuda, resolve_variants
from harness.quality.choices import QualityChoices
from harness.quality.config import MAX_SEEDS, QualityConfig, TrainConfig
from harness.quality.model import cannot_train_reason, trainable_variants, training_memory_estimate
from harness.quality.presets import FAMILIES, POSITION_STUDY, PRESET_RECIPE, PRESETS
from harness.quality.tasks import make_task
from variants.positions import ENCODINGS, encoding_unsupported_reason


def resolve_quality_device(text: str) -> str:
    """'auto' = CUDA when present, else the CPU; 'cuda' must exist."""
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text not in ("cpu", "cuda"):
        raise ArgumentError(f"--device: {text!r} is not a device; choose cpu, cuda or auto")
    if text == "cuda":
        require_cuda("--device")
    return text


def _quality_machine(device: str) -> dict:
    """What memory_budgets needs to size a quality training: the free GPU memory on CUDA."""
    if device != "cuda":
        return {}
    return {"gpu": {"free_bytes": torch.cuda.mem_get_info()[0]}}


def _check_training_fits(train: "TrainConfig", task: str, length: int, made, names, options: dict, budget: int) -> None:
    """ArgumentError when a training of (task, L) would need more memory than the budget (the largest variant's)."""
    worst, parts = max(
        (
            (
                name,
                training_memory_estimate(
                    train, made.seq_len, made.vocab_size, name, registry.options_taken(name, options)
                ),
            )
            for name in names
        ),
        key=lambda item: sum(item[1].values()),
    )
    need = sum(parts.values())
    if need > budget:
        detail = ", ".join(f"{part} {fmt_bytes(size)}" for part, size in parts.items())
        raise ArgumentError(
            f"{task} at L={length} ({made.seq_len} tokens, vocab {made.vocab_size}) with --d-model {train.d_model}, "
            f"--layers {train.layers}, --batch {train.batch_at(made.seq_len)}: training {worst} needs about {fmt_bytes(need)} "
            f"({detail}), more than the memory budget {fmt_bytes(budget)} (60% of the available RAM, 90% of a "
            f"GPU's free memory); lower the sizes or the lengths"
        )


def build_quality_config(choices: QualityChoices, imports: list[str]) -> QualityConfig:
    """A quality run's configuration from the command line's `choices` (None: the preset's value). Every
    variant must train on the device with its options, and every task must be well posed at every length.
    `choices.given`: the variant options of the command line (each must be taken by a selected variant), over
    the preset's."""
    preset, dtype, given, variants = choices.preset, choices.dtype, choices.given, choices.variants
    if preset not in PRESETS:
        raise ArgumentError(f"--preset: {preset!r} is not a preset; choose {' or '.join(PRESETS)}")
    device = resolve_quality_device(choices.device)
    if dtype not in ("float32", "bfloat16"):
        raise ArgumentError(f"--dtype: {dtype!r} is not allowed; choose float32 or bfloat16")
    if dtype == "bfloat16" and device != "cuda":
        raise ArgumentError(f"--dtype bfloat16 trains with CUDA autocast; the device is {device}: use float32 there")
    defaults = PRESETS[preset]
    trained = {f.name for f in fields(TrainConfig)} | {"seeds"}  # what the preset fills where the choice is None
    recipe = {f.name: getattr(choices, f.name) for f in fields(choices) if f.name in trained}
    for key in (*PRESET_RECIPE, "seeds", "d_model", "lr"):
        if recipe.get(key) is None:
            value = defaults.get(key)
            recipe[key] = value.get(device) if isinstance(value, dict) else value  # a value per device
    positions_text = recipe.pop("positions") or defaults.get("positions")  # None: the architecture's own
    recipe["extrapolate"] = _factors(recipe.get("extrapolate") or ())
    d_models = parse_axis(recipe.pop("d_model") or TrainConfig.d_model, "--d-model", int, 0, 2**31)
    lrs = parse_axis(recipe.pop("lr") or TrainConfig.lr, "--lr", float, 0, 10)
    recipe["d_model"], recipe["lr"] = d_models[0], lrs[0]
    tasks = tuple(choices.tasks or defaults.get("tasks", ("copy", "recall")))
    lengths = choices.lengths or defaults["lengths"][device]
    copy_lengths = choices.copy_lengths or (defaults.get("copy_lengths") or {}).get(device)
    if choices.lengths and not choices.copy_lengths:
        copy_lengths = None  # --lengths alone is every task's
    long_lengths = choices.long_lengths  # the preset's unless --lengths was given (they would follow the preset's)
    if not long_lengths and not choices.lengths:
        long_lengths = (defaults.get("long_lengths") or {}).get(device)
    long_variants = choices.long_variants
    seeds = recipe.pop("seeds")  # the command line's, else the preset's
    if not 1 <= seeds <= MAX_SEEDS:
        raise ArgumentError(f"--seeds {seeds} is not allowed; it must lie in 1..{MAX_SEEDS}")
    recipe = {key: value for key, value in recipe.items() if value is not None}  # the rest: TrainConfig's defaults
    check_number("--label-smoothing", recipe.get("label_smoothing", 0.0), 0, 0.999)
    if recipe.get("early_stop") is not None:
        check_number("--early-stop", recipe["early_stop"], 0, 1, low_inclusive=False)
    train = TrainConfig(**recipe)
    for d in d_models:
        if d % train.heads:
            raise ArgumentError(f"--d-model {d} must be divisible by --heads {train.heads}")
    if train.arch == "zoology" and train.layers % 2:
        raise ArgumentError(
            f"--layers {train.layers}: Zoology's model alternates a convolution and the attention; give an even number"
        )
    if variants is None:  # the preset's: every trainable variant, or one a family
        named = defaults.get("variants", "all")
        variants = (
            "all" if named == "all" else ",".join(v for v in _preset_variants(named) if v in trainable_variants(device))
        )
    names = tuple(trainable_variants(device)) if variants.strip() == "all" else resolve_variants(variants, (device,))
    for name in names:
        reason = cannot_train_reason(name, device)
        if reason:
            raise ArgumentError(f"--variants: {name} cannot be trained on {device}: {reason}")
    encodings, refused = _positions(positions_text, names, train.arch) if positions_text else ((), ())
    if encodings:
        train = replace(train, positions=encodings[0])
    with as_argument_error():
        registry.check_options(given, names, train.heads, train.d_model // train.heads)
    options = {**defaults["options"], **given}
    for name in names:  # each method's own options at the run's reach, unless given (shared or scoped to it)
        taken = registry.options_taken(name, given)
        for key, value in (
            registry.variant_class(name)
            .training_options(options.get("window", 16), train.d_model // train.heads)
            .items()
        ):
            if key not in taken:
                options.setdefault(f"{name}.{key}", value)
    for name in names:
        with as_argument_error():
            registry.check_variant_options(
                name, registry.options_taken(name, options), name, train.heads, train.d_model // train.heads
            )
    length_list = parse_lengths(lengths)
    copy_list = parse_lengths(copy_lengths) if copy_lengths else None
    long_list, long_names = _long_lengths(
        long_lengths, long_variants, _preset_variants(defaults.get("long_variants", ())), length_list, names
    )
    if choices.copy_lengths and "copy" not in tasks:
        raise ArgumentError(
            f"--copy-lengths {choices.copy_lengths}: the copy task's lengths, but the run trains "
            f"{', '.join(tasks)} only (--task)"
        )
    for key, takers in (("pairs", ("recall", "mqar")), ("queries", ("recall",))):
        if getattr(choices, key) is not None and not set(takers) & set(tasks):
            raise ArgumentError(
                f"--{key} {getattr(choices, key)}: an option of {' and '.join(takers)}, but the run trains "
                f"{', '.join(tasks)} only (--task)"
            )
    budget = dict(memory_budgets("auto", (device,), _quality_machine(device))).get(device)
    for task in tasks:
        own = task == "copy" and copy_list  # copy's own lengths: no long ones after them
        for n in copy_list if own else length_list + long_list:
            try:
                made = make_task(task, n, vocab=train.vocab, pairs=train.pairs, queries=train.queries)
            except ValueError as err:
                raise ArgumentError(f"--lengths {n}: {err}") from None
            if budget:
                _check_training_fits(
                    replace(train, d_model=max(d_models)),
                    task,
                    n,
                    made,
                    long_names if not own and n in long_list else names,
                    options,
                    budget,
                )
    return QualityConfig(
        tasks=tuple(tasks),
        variants=names,
        lengths=length_list,
        options=options,
        imports=tuple(imports),
        train=train,
        seeds=seeds,
        device=device,
        dtype=dtype,
        preset=preset,
        measure_cost=choices.measure_cost and len(encodings) <= 1,  # (an axis of encodings: no step costs)
        copy_lengths=copy_list if copy_list and copy_list != length_list and "copy" in tasks else None,
        long_lengths=long_list,
        long_variants=long_names,
        d_models=d_models if len(d_models) > 1 else (),
        lrs=lrs if len(lrs) > 1 else (),
        positions=encodings if len(encodings) > 1 else (),
        refused=refused,
        keep_models=choices.keep_models,
    )


MAX_EXTRAPOLATE = 64  # the largest --extrapolate factor: the positions tables are sized to it


def _factors(value) -> tuple[int, ...]:
    """--extrapolate's factors (a text, or the preset's tuple), each an int in 2..MAX_EXTRAPOLATE, ascending."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        factors = sorted({int(str(part).strip()) for part in parts if str(part).strip()})
    except ValueError:
        raise ArgumentError(f"--extrapolate {value!r}: give whole factors, comma-separated (2,4,8)") from None
    if any(not 2 <= f <= MAX_EXTRAPOLATE for f in factors):
        raise ArgumentError(
            f"--extrapolate {value!r}: each factor must lie in 2..{MAX_EXTRAPOLATE} (1x is the training's own "
            "evaluation; the positions tables are sized to the largest)"
        )
    return tuple(factors)


def _positions(text: str, names: tuple[str, ...], arch: str) -> tuple[tuple[str, ...], tuple]:
    """(the encodings of --positions, the (variant, encoding, why) pairs not trained). 'all': every encoding, each
    variant with those it can carry; named encodings: every variant must carry each (else ArgumentError)."""
    chosen = tuple(ENCODINGS) if text.strip() == "all" else tuple(dict.fromkeys(p.strip() for p in text.split(",")))
    unknown = [p for p in chosen if p not in ENCODINGS]
    if unknown or not chosen:
        raise ArgumentError(f"--positions {text!r}: choose all, or some of {', '.join(ENCODINGS)}")
    if arch == "zoology" and chosen != ("none",):
        raise ArgumentError(f"--positions {text}: Zoology's model has no position encoding; leave it at none")
    refused = tuple(
        (name, p, why) for p in chosen for name in names for why in [encoding_unsupported_reason(name, p)] if why
    )
    if refused and text.strip() != "all":
        raise ArgumentError(
            f"--positions {text}: " + "; ".join(f"{why}" for _, _, why in refused) + " (--positions all trains "
            "each variant with the encodings it can carry)"
        )
    return chosen, refused


def _preset_variants(named) -> tuple[str, ...]:
    """A preset's variants: its names; FAMILIES, one variant a family (each that its spec gives a `family`); or
    POSITION_STUDY, each whose spec says `position_study`."""
    if named not in (FAMILIES, POSITION_STUDY):
        return tuple(named)
    key = "family" if named == FAMILIES else "position_study"
    return tuple(name for name in registry.available() if getattr(registry.variant_class(name).spec, key))


def _long_lengths(
    text: str | None,
    variants_text: str | None,
    preset_variants: tuple[str, ...],
    lengths: tuple[int, ...],
    names: tuple[str, ...],
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(--long-lengths, the variants that train them): lengths after every --lengths, for the variants named by
    --long-variants ('all': every selected one), else the preset's that the run selects; ((), ()) when none."""
    if not text:
        if variants_text:
            raise ArgumentError(
                f"--long-variants {variants_text}: the variants that train --long-lengths, but no long lengths are set"
            )
        return (), ()
    long_list = parse_lengths(text)
    if min(long_list) <= max(lengths):
        raise ArgumentError(
            f"--long-lengths {text}: each must be longer than the longest of --lengths ({max(lengths)}); "
            "they are trained after them, by the --long-variants only"
        )
    if variants_text is None:
        chosen = tuple(name for name in preset_variants if name in names) or names
    elif variants_text.strip() == "all":
        chosen = names
    else:
        chosen = tuple(dict.fromkeys(part.strip() for part in variants_text.split(",") if part.strip()))
        missing = [name for name in chosen if name not in names]
        if missing or not chosen:
            raise ArgumentError(
                f"--long-variants {variants_text!r}: {', '.join(missing) or 'none'} not among the run's variants "
                f"({', '.join(names)}); name some of them, or all"
            )
    return long_list, chosen
