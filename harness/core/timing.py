"""Timing a call: warm-up, samples calibrated to a minimum length, a clock for the device (wall time or CUDA
events), and the noise snapshots around the samples."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from harness.core.memory import steady_allocator
from harness.core.noise import Snapshot

# A fresh process runs its first calls slower for a few hundred milliseconds, whatever the count of
# calls (measured on a quiet 2-core VM: sliding_window N = 256 at 3.6 ms in its first 0.25 s, 2.6 ms
# after 1.5 s of work, or at once after a second of other work; on CUDA, kernels at small N take less
# time than the host needs to launch them): warm up for at least WARMUP_S. Then a sample times enough
# calls to last MIN_SAMPLE_S between one start and stop of the clock: a sub-millisecond CPU call timed
# alone catches a timer interrupt or a scheduler tick in a large share of its samples, and a CUDA
# kernel shorter than its launch would time the launch (pyperf and triton.testing.do_bench calibrate so).
WARMUP_S = 0.25
CPU_MIN_SAMPLE_S = 0.01
CUDA_MIN_SAMPLE_S = 0.001
MAX_CALLS_PER_SAMPLE = 1000


class WallClock:
    """Host wall time: start(), then stop() -> seconds since start."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self._t0


class CudaClock:
    """CUDA events around the enqueued work: start(), then stop() -> seconds, after a synchronize."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        torch.cuda.synchronize(self.device)
        return self._start.elapsed_time(self._end) / 1e3


def clock_for(device: torch.device):
    return CudaClock(device) if device.type == "cuda" else WallClock()


@dataclass(frozen=True)
class Timing:
    """The samples of one timed call: seconds per call of each sample, calls per sample, and the noise
    snapshots taken around the timed samples (warm-up excluded)."""

    times: list
    per_sample: int
    before: Snapshot
    after: Snapshot


def measure_time(
    call,
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    min_time: float,
    warmup_time: float = WARMUP_S,
    min_repeats: int = 3,
) -> Timing:
    """Time `call` as `bench run`'s cells and the training-step cost do: `warmed` (steady allocator, at
    least `warmup` calls lasting at least `warmup_time` seconds; the micro-benchmarks call it before
    pytest-benchmark's own loop), then `time_calls` with calls per sample calibrated from the last warm-up
    call to a sample of CPU_MIN_SAMPLE_S (CUDA_MIN_SAMPLE_S)."""
    clock, last = warmed(call, device, warmup=warmup, seconds=warmup_time)
    before = Snapshot.now()
    times, per_sample = time_calls(
        call,
        clock,
        repeats=repeats,
        min_time=min_time,
        per_call=last,
        min_repeats=min_repeats,
        min_sample_s=CUDA_MIN_SAMPLE_S if device.type == "cuda" else CPU_MIN_SAMPLE_S,
    )
    return Timing(times, per_sample, before, before.after())


def warmed(call, device: torch.device, *, warmup: int, seconds: float = WARMUP_S):
    """Make `call` ready to time on `device`: the allocator steady (CPU: `memory.steady_allocator`), then
    at least `warmup` calls, lasting at least `seconds`. Returns (the device's clock, the last call's seconds or None)."""
    if device.type != "cuda":
        steady_allocator()
    clock = clock_for(device)
    return clock, warm_up(call, clock, calls=warmup, seconds=seconds)


def warm_up(call, clock, *, calls: int, seconds: float) -> float | None:
    """At least `calls` calls, and (where `seconds` > 0) calls until that much time has passed.
    Returns the last call's seconds (what calibrates the samples), None when it made no call."""
    clock.start()
    done, elapsed, last = 0, 0.0, None
    while done < calls or (seconds > 0 and done < 1_000_000 and elapsed < seconds):
        call()
        done += 1
        now = clock.stop()
        last, elapsed = now - elapsed, now
    return last


def time_calls(
    call,
    clock,
    *,
    repeats: int,
    min_time: float,
    min_sample_s: float = 0.0,
    per_call: float | None = None,
    min_repeats: int = 3,
) -> tuple[list[float], int]:
    """(seconds per call of each sample, calls per sample).

    A sample times `per_sample` consecutive calls between one start and stop of the clock, with
    `per_sample` chosen so that a sample lasts >= min_sample_s (1 when min_sample_s is 0), from
    `per_call` (the last warm-up call's seconds) or else one calibrating call. Samples are taken until
    `repeats`, or `min_repeats` once `min_time` seconds were timed (with 1, a sample that alone lasts
    `min_time` is the only one: pyperf's calibration, a call that long being stable on its own).
    """
    per_sample = 1
    if min_sample_s > 0:
        if per_call is None:
            clock.start()
            call()
            per_call = clock.stop()
        per_sample = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(min_sample_s / max(per_call, 1e-9))))
    times: list[float] = []
    while len(times) < repeats and (len(times) < min_repeats or sum(times) * per_sample < min_time):
        clock.start()
        for _ in range(per_sample):
            call()
        times.append(clock.stop() / per_sample)
    return times, per_sample


def timing_stats(times: list[float]) -> dict:
    """Median, minimum and interquartile range of the per-call times of the samples."""
    ordered = sorted(times)
    if len(ordered) < 2:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {"time_median_s": statistics.median(ordered), "time_min_s": ordered[0], "time_iqr_s": q3 - q1}
