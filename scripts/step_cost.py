"""A preset's training step at other widths and batch sizes: what a sweep point would cost before it is run.

    python scripts/step_cost.py --preset zoology --variant deltanet --length 128 --d-model 64,128,256 --batch 128,512

Each point is `bench quality`'s own training-step measurement (`harness.quality.train.measure_training_step`:
the median of 5 steps after 2 warm-up steps), in this process, one after the other. Run it alone on a quiet
machine: the figures are only comparable within one run.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import variants
from harness.options import parse_axis
from harness.quality.choices import QualityChoices
from harness.quality.plan import build_quality_config
from harness.quality.train import measure_training_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="zoology")
    parser.add_argument("--variant", default="full")
    parser.add_argument("--task", default=None, help="default: the preset's first task")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--d-model", default="64")
    parser.add_argument("--batch", default="128")
    args = parser.parse_args(argv)
    config = build_quality_config(QualityChoices(preset=args.preset, variants=args.variant), [])
    task = args.task or config.tasks[0]
    for d in parse_axis(args.d_model, "--d-model", int, 0, 2**31):
        for batch in parse_axis(args.batch, "--batch", int, 0, 2**31):
            cfg = replace(config.train, d_model=d, batch=batch)
            options = variants.options_taken(args.variant, config.options)
            row = measure_training_step(task, args.length, args.variant, options, cfg)
            print(f"{args.variant} {task} L={args.length} d_model={d} batch={batch}: {row['step_ms']:.0f} ms a step")


if __name__ == "__main__":
    main()
