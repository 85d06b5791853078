"""Intervals for figures measured on a few samples: a bootstrap over windows for a pooled mean (perplexity), and
Wilson's score interval for a proportion (retrieval accuracy). Pure Python: readers and reports import it.

    low, high = bootstrap_pooled_mean(sums, counts)   # 95% over windows of sum / count, resampled with replacement
    low, high = bootstrap_paired_difference(sums_a, sums_b, counts)  # the same windows scored two ways
    low, high = wilson_interval(correct, trials)       # 95% for correct / trials, inside [0, 1] even at 0 or n
"""

from __future__ import annotations

import math
import random

LEVEL = 0.95  # every interval attnbench prints
RESAMPLES = 2000  # bootstrap resamples: the 2.5th and 97.5th percentiles move by < 1% of the width past this
Z = 1.959963984540054  # the standard normal's 97.5th percentile


def bootstrap_pooled_mean(
    sums: list[float], counts: list[int], resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """95% percentile interval of sum(sums) / sum(counts) when the windows (each a sum over its `count` tokens) are
    resampled with replacement: the pooled mean's uncertainty from which windows were drawn. One window: (x, x)."""
    if len(sums) != len(counts) or not sums:
        raise ValueError(f"bootstrap_pooled_mean: {len(sums)} sums and {len(counts)} counts; give one of each a window")
    rng = random.Random(seed)
    n = len(sums)
    means = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        means.append(sum(sums[i] for i in picks) / sum(counts[i] for i in picks))
    means.sort()
    tail = (1 - LEVEL) / 2
    return means[int(tail * (resamples - 1))], means[int(math.ceil((1 - tail) * (resamples - 1)))]


def bootstrap_paired_difference(
    sums_a: list[float], sums_b: list[float], counts: list[int], resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """95% percentile interval of (sum(sums_a) - sum(sums_b)) / sum(counts), windows resampled with replacement
    together (each window scored by both a and b): a comparison on the same texts, free of the texts' spread."""
    if not (len(sums_a) == len(sums_b) == len(counts)) or not counts:
        raise ValueError(f"bootstrap_paired_difference: {len(sums_a)}, {len(sums_b)} sums and {len(counts)} counts")
    differences = [a - b for a, b in zip(sums_a, sums_b)]
    return bootstrap_pooled_mean(differences, counts, resamples, seed)


def wilson_interval(successes: int, trials: int) -> tuple[float, float]:
    """Wilson's 95% score interval of successes / trials (Wilson 1927): never outside [0, 1], never of zero width
    at 0 or all correct, unlike the normal approximation."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(
            f"wilson_interval: {successes} successes of {trials} trials; need 0 <= successes <= trials >= 1"
        )
    p = successes / trials
    centre = (p + Z**2 / (2 * trials)) / (1 + Z**2 / trials)
    half = Z * math.sqrt(p * (1 - p) / trials + Z**2 / (4 * trials**2)) / (1 + Z**2 / trials)
    return (0.0 if successes == 0 else centre - half), (1.0 if successes == trials else centre + half)
