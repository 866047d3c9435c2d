"""Statistics of timing samples: percentiles, the Mann-Whitney U test (scipy), the fewest runs that
can reach a significance level, and a bootstrap confidence interval for a ratio of medians.

scipy is imported inside the functions: every `gemma-parity` command imports this package, and
only the comparisons need scipy.
"""

from __future__ import annotations

import functools
import math
import statistics

from harness.base.errors import HarnessInputError

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20260101  # fixed: the same files always print the same interval
MAX_RUNS_SEARCHED = 1000


def percentile(samples, q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# A tail percentile q is reported only from n >= 1 / (1 - q/100) samples: below that it is the
# sample's maximum or an interpolation towards it, not an estimate of the tail. So p90 needs 10
# samples and p99 100; with fewer the summary holds None and the text prints "-" with the rule.
MIN_SAMPLES = {90: 10, 99: 100}


def tail_percentile(samples, q: int) -> float | None:
    """The q-th percentile, or None when there are fewer than MIN_SAMPLES[q] samples."""
    return percentile(samples, q) if len(samples) >= MIN_SAMPLES[q] else None


def summarize(samples) -> dict:
    return {"n": len(samples), "p50": percentile(samples, 50), "p90": tail_percentile(samples, 90),
            "p99": tail_percentile(samples, 99), "mean": statistics.fmean(samples),
            "min": min(samples), "max": max(samples)}


def _mannwhitney(current, baseline, alternative: str) -> float:
    from scipy.stats import mannwhitneyu

    if len(current) == 0 or len(baseline) == 0:
        raise HarnessInputError("Mann-Whitney U needs at least one sample on each side")
    if len(set(current) | set(baseline)) == 1:
        return 1.0  # every sample equal: no evidence either way (scipy would divide by zero)
    # Asymptotic: the normal approximation with tie and continuity correction, valid with the ties
    # that rounded timings have (scipy's exact method assumes none).
    return float(mannwhitneyu(current, baseline, alternative=alternative, method="asymptotic").pvalue)


def mann_whitney_greater(current, baseline) -> float:
    """One-sided p-value that `current` samples tend to be larger (slower) than `baseline`'s."""
    return _mannwhitney(current, baseline, "greater")


def mann_whitney_less(current, baseline) -> float:
    """One-sided p-value that `current` samples tend to be smaller (faster) than `baseline`'s."""
    return _mannwhitney(current, baseline, "less")


@functools.lru_cache(maxsize=4096)
def smallest_p(n1: int, n2: int) -> float:
    """The p-value when every current sample is slower than every baseline sample: with fewer
    runs than this allows, no slowdown (nor, by symmetry, speed-up) can be significant."""
    return mann_whitney_greater([float(n2 + k) for k in range(n1)], [float(k) for k in range(n2)])


def runs_needed(alpha: float, other: int | None = None) -> int:
    """The fewest runs on one side that can reach p < alpha: against `other` runs on the other
    side, or with the same number on both sides when `other` is None."""
    for n in range(1, MAX_RUNS_SEARCHED + 1):
        if smallest_p(n, other if other is not None else n) < alpha:
            return n
    return MAX_RUNS_SEARCHED + 1


def ratio_interval(baseline, current, confidence: float) -> tuple[float, float]:
    """Percentile bootstrap interval of median(current) / median(baseline) (Efron & Tibshirani,
    An Introduction to the Bootstrap, 1993, ch. 13), each side resampled on its own."""
    import numpy as np
    from scipy.stats import bootstrap

    def ratio(cur, base, axis=-1):
        return np.median(cur, axis=axis) / np.median(base, axis=axis)

    if len(current) < 2 or len(baseline) < 2:
        point = statistics.median(current) / statistics.median(baseline)
        return point, point
    result = bootstrap((np.asarray(current, float), np.asarray(baseline, float)), ratio,
                       n_resamples=BOOTSTRAP_RESAMPLES, vectorized=True, method="percentile",
                       confidence_level=confidence, rng=BOOTSTRAP_SEED)
    return float(result.confidence_interval.low), float(result.confidence_interval.high)
