"""The intervals every figure from a few samples carries: Wilson's for a proportion, a bootstrap over windows for a
pooled mean (harness/stats.py), against values computed independently."""

from __future__ import annotations

import math
import random

import pytest

from harness.stats import bootstrap_paired_difference, bootstrap_pooled_mean, wilson_interval


@pytest.mark.parametrize(
    "successes, trials, low, high",
    # Wilson 1927 by hand: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n), z = 1.95996
    [(0, 10, 0.0, 0.277533), (10, 10, 0.722467, 1.0), (5, 10, 0.236593, 0.763407), (9, 10, 0.596, 0.982124)],
    ids=["0of10", "10of10", "5of10", "9of10"],
)
def test_wilson_interval_matches_its_formula(successes, trials, low, high):
    got = wilson_interval(successes, trials)
    assert got == pytest.approx((low, high), abs=1e-3)
    assert 0.0 <= got[0] <= successes / trials <= got[1] <= 1.0


def test_wilson_interval_refuses_impossible_counts():
    with pytest.raises(ValueError, match="3 successes of 2 trials"):
        wilson_interval(3, 2)


def test_the_bootstrap_interval_holds_the_pooled_mean_and_shrinks_with_windows():
    rng = random.Random(1)
    few = [rng.gauss(2.5, 0.3) for _ in range(4)]
    many = [rng.gauss(2.5, 0.3) for _ in range(64)]
    lo4, hi4 = bootstrap_pooled_mean([x * 100 for x in few], [100] * 4)
    lo64, hi64 = bootstrap_pooled_mean([x * 100 for x in many], [100] * 64)
    assert lo4 <= sum(few) / 4 <= hi4 and lo64 <= sum(many) / 64 <= hi64
    assert hi64 - lo64 < (hi4 - lo4) * 0.6  # about 1 / sqrt(16) as wide, give or take the draw
    # the normal approximation's 95% half-width, 1.96 s / sqrt(n), is what 64 windows' bootstrap comes close to
    s = math.sqrt(sum((x - sum(many) / 64) ** 2 for x in many) / 63)
    assert (hi64 - lo64) / 2 == pytest.approx(1.96 * s / 8, rel=0.2)
    assert bootstrap_pooled_mean([3.0], [2]) == (1.5, 1.5)


def test_a_paired_comparison_cancels_the_spread_of_the_texts():
    # windows whose own losses spread widely, scored by two methods a constant 0.1 nats apart: the pooled intervals
    # of each overlap, the paired difference is exactly 0.1
    rng = random.Random(2)
    base = [rng.uniform(1.5, 3.5) * 100 for _ in range(8)]
    shifted = [x + 0.1 * 100 for x in base]
    low, high = bootstrap_paired_difference(shifted, base, [100] * 8)
    assert low == pytest.approx(0.1) and high == pytest.approx(0.1)
    a, b = bootstrap_pooled_mean(shifted, [100] * 8), bootstrap_pooled_mean(base, [100] * 8)
    assert a[0] < b[1]  # apart, each alone cannot tell the two methods apart
