"""The measuring core: inputs, correctness gate, timing, peak memory, the machine, noise, isolated cells.
Shared by `bench run`, the training-step cost of `bench quality` and the micro-benchmarks.

This package's own module imports nothing; its modules import torch where they measure."""

# the measuring core's version, recorded in every run's metadata: rows timed by two cores never share a
# run (--resume refuses). 2: steady allocator while timing, warm-up >= --warmup-time, samples calibrated to
# >= 10 ms (CPU) from the last warm-up call (issue 31); 1: before (runs that record no version)
TIMING_CORE = 2
